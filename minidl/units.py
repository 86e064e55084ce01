"""Byte counts for humans, at the bottom floor so that every module (the network summary, the memory
reports, the CLI) formats sizes the same way. Parsing sizes (`parse_size`) stays with the pool, whose budgets
it reads."""
from __future__ import annotations

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: int) -> str:
    """A byte count in binary units with two decimals: 1572864 -> "1.50 MiB", 512 -> "512 B".

    Binary units (powers of 1024) because that is how memory is built and how `nvidia-smi` reports it.
    """
    n = int(n)
    sign = "-" if n < 0 else ""
    m = abs(n)
    if m < 1024:
        return f"{sign}{m} B"
    value = float(m)
    unit = "B"
    for unit in _BINARY_UNITS[1:]:
        value /= 1024.0
        if round(value, 2) < 1024.0 or unit == _BINARY_UNITS[-1]:  # never "1024.00 KiB"
            break
    return f"{sign}{value:.2f} {unit}"
