"""Byte counts for humans, on the bottom floor: every module formats sizes alike."""
from __future__ import annotations

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: int) -> str:
    """Binary units, two decimals, rounded up (7356416 -> "7.02 MiB"): a printed budget typed back still fits."""
    n = int(n)
    sign = "-" if n < 0 else ""
    m = abs(n)
    if m < 1024:
        return f"{sign}{m} B"
    for k, unit in enumerate(_BINARY_UNITS[1:], start=1):
        hundredths = -(-m * 100 // 1024**k)  # exact integer ceiling
        if hundredths < 1024 * 100 or unit == _BINARY_UNITS[-1]:  # never "1024.00 KiB"
            break
    return f"{sign}{hundredths // 100}.{hundredths % 100:02d} {unit}"


def size_option(n: int) -> str:
    """`n` bytes exactly as a user would type them, in the largest unit that divides it (3145728 -> "3MiB")."""
    n = int(n)
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)
