"""Byte counts for humans, at the bottom floor so that every module (the network summary, the memory
reports, the CLI) formats sizes the same way. Parsing sizes (`parse_size`) stays with the pool, whose budgets
it reads."""
from __future__ import annotations

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: int) -> str:
    """A byte count in binary units with two decimals, rounded *up*: 1572864 -> "1.50 MiB", 512 -> "512 B",
    7356416 (7.0156 MiB) -> "7.02 MiB".

    Binary units (powers of 1024) because that is how memory is built and how `nvidia-smi` reports it. Rounded
    up (never to nearest) so that a printed size is never below the true one: the smallest budget a plan needs,
    printed and typed back as `--budget 7.02MiB`, still fits (`parse_size` reads it back, rounding up too).
    """
    n = int(n)
    sign = "-" if n < 0 else ""
    m = abs(n)
    if m < 1024:
        return f"{sign}{m} B"
    for k, unit in enumerate(_BINARY_UNITS[1:], start=1):
        hundredths = -(-m * 100 // 1024**k)  # exact integer ceiling: no float rounding
        if hundredths < 1024 * 100 or unit == _BINARY_UNITS[-1]:  # never "1024.00 KiB"
            break
    return f"{sign}{hundredths // 100}.{hundredths % 100:02d} {unit}"


def size_option(n: int) -> str:
    """`n` bytes as a user would type it after `--budget` or `--paged`, exactly: the largest unit that divides it
    (12000000000 -> "12GB", 3145728 -> "3MiB", 65536 -> "64KiB"), else plain bytes. A suggestion printed with it
    and typed back is the same number of bytes."""
    n = int(n)
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)
