"""Byte sizes: parse "80GiB" / "1.5TB" / "123456", print with binary units; seconds and token counts for people."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text) -> int:
    """``80GiB`` -> 85899345920. Decimal units (GB) are powers of 1000, binary units (GiB) of 1024."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a byte size must not be negative, got {text}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a byte size; write e.g. 80GiB, 512GB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt_over(need: float, budget: float) -> str:
    """``need`` against ``budget`` with the digits that show the difference: "2.00 TiB > 2.00 TiB" says nothing,
    "2.0004 TiB, 450.00 MiB over 2.0000 TiB" does (and "54.02 GiB of 77.10 GiB" when within)."""
    if need <= budget:
        return f"{fmt_bytes(need)} of {fmt_bytes(budget)}"
    a, b = fmt_bytes(need), fmt_bytes(budget)
    if a != b:  # the usual digits already tell them apart
        return f"{a}, {fmt_bytes(need - budget)} over {b}"
    unit = a.split()[-1]
    scale = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}[unit]
    digits = 2
    while a.split()[0] == f"{budget / scale:.{digits}f}" and digits < 6:
        digits += 1
        a = f"{need / scale:.{digits}f} {unit}"
    b = f"{budget / scale:.{digits}f} {unit}"
    return f"{a}, {fmt_bytes(need - budget)} over {b}"


def fmt_seconds(s: float) -> str:
    """42.1 s, 12 min 30 s, 2 h 05 min: a step time a person reads at a glance."""
    if s < 59.5:
        return f"{s:.3g} s"
    if s < 3570:  # below 59 min 30 s: minutes and seconds
        m, sec = divmod(int(round(s)), 60)
        return f"{m} min {sec:02d} s"
    h, m = divmod(int(round(s / 60)), 60)
    return f"{h} h {m:02d} min"


def fmt_tokens(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.2f}M"
    if n >= 1000:
        return f"{n / 1e3:.0f}K"
    return str(n)
