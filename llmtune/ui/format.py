"""Number formatting shared by every report: counts, byte sizes, values with their error."""

from __future__ import annotations

import math
from typing import Optional


def human_count(n: int) -> str:
    """24413472 -> '24.4M' (decimal units, as parameter counts are quoted)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def human_bytes(n: int) -> str:
    """1185376 -> '1.1 MiB' (the unit chosen to fit the size)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def mib(n: int, digits: int = 1) -> str:
    """1185376 -> '1.1 MiB': always MiB, so the sizes in one table or line compare at a glance."""
    return f"{n / 2**20:,.{digits}f} MiB"


def plus_minus(value: Optional[float], err: Optional[float], fmt: str = ".4f") -> str:
    """'4.1727 ± 0.0246'; just the value when its error is unknown, '-' when the value is."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if err is None or math.isnan(err):
        return format(value, fmt)
    return f"{format(value, fmt)} ± {format(err, fmt)}"


def percent(value: Optional[float], err: Optional[float] = None, digits: int = 2) -> str:
    """An accuracy (a fraction) as eval prints it: '41.23 %', with an error '41.23 ± 1.10 %';
    '-' when unknown. finetune --eval-benchmark's lines and table show benchmark accuracy so too."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    err = None if err is None or math.isnan(err) else 100 * err
    return plus_minus(100 * value, err, f".{digits}f") + " %"


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values, width: int = 40) -> str:
    """The values as one line of `width` unicode blocks (fewer values: one block each), each block
    the mean of its share of them, scaled from the lowest mean (▁) to the highest (█); values that
    are not finite are left out. '' when none is."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = min(width, len(finite))
    if n == 0:
        return ""
    parts = (finite[i * len(finite) // n:(i + 1) * len(finite) // n] for i in range(n))
    means = [sum(part) / len(part) for part in parts]
    lo, hi = min(means), max(means)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return SPARKS[(len(SPARKS) - 1) // 2] * n
    return "".join(SPARKS[round((m - lo) / (hi - lo) * (len(SPARKS) - 1))] for m in means)
