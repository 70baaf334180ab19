"""Byte sizes as people write them (``5GB``, ``512MiB``) and as the tools print them."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10^9, as Hugging Face counts) or ``"5GiB"`` (2^30)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(str(value))
        if match is None:
            raise ValueError(f"not a size: {value!r} (write e.g. 5GB, 500MB, 2GiB or a number of bytes)")
        number, unit, binary = match.groups()
        size = int(float(number) * (1024 if binary else 1000) ** _POWERS[unit.upper()])
    if size <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return size


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
