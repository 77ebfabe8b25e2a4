"""Byte sizes for humans and from humans: '12GiB', '512 MB', '40%'."""
from __future__ import annotations

import math
import re

from .errors import UserError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


MAX_BYTES = 2**60            # 1 EiB: past it a size is a typo (and overflows what it is added to)
MAX_PERCENT = 100.0         # a budget above the baseline peak constrains nothing


def parse_bytes(text: str) -> int:
    """'12GiB' -> 12884901888; plain integers are bytes. Zero, sub-byte and past-1-EiB sizes are refused."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise UserError(f"cannot read '{text}' as a size; write e.g. 12GiB, 800MB or 1048576")
    n = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if not 0 < n <= MAX_BYTES:
        raise UserError(f"size '{str(text).strip()}' must be at least 1 byte and at most 1 EiB")
    return n


def parse_percent(text: str, what: str = "percentage") -> float:
    """'40%' -> 0.4: a finite percentage above 0 and at most MAX_PERCENT ('inf%', '0%', '1e30%' are refused).

    `what` names the value in the error ('budget')."""
    body = str(text).strip()
    try:
        if not body.isascii():      # float() reads '４０'; sizes ('１２GiB') refuse such digits too
            raise ValueError(body)
        percent = float(body.removesuffix("%"))
    except ValueError:
        raise UserError(f"cannot read {what} '{body}' as a percentage; write e.g. 40%") from None
    if not math.isfinite(percent) or not 0 < percent <= MAX_PERCENT:
        raise UserError(f"{what} '{body}' must be a percentage above 0% and at most {MAX_PERCENT:g}%")
    return percent / 100


def format_bytes(n: int | float | None) -> str:
    """1536 -> '1.50 KiB' (binary units, as GPU memory is sold and reported)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_seconds(x: float | None) -> str:
    """0.04584 -> '45.84 ms' (four significant digits, s/ms/us/ns); None -> '-'."""
    if x is None:
        return "-"
    for factor, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(x) >= factor:
            return f"{x / factor:.4g} {unit}"
    return f"{x / 1e-9:.4g} ns"
