"""How far a measured ratio is from noise: the mean of paired log ratios and its two-sided interval at 0.9
confidence (Student's t over the pairs), shared by the benchmark scripts that judge one method against another
(`benchmarks/within_noise.py`, `benchmarks/serve_concurrency.py`)."""

from __future__ import annotations

import math
import statistics

# Student's t, 95th percentile, by degrees of freedom (1-30; beyond, the normal's 1.645 plus a little)
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
       1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)


def interval(differences: list[float]) -> tuple[float, float, float]:
    """Mean log ratio and its interval at 0.9 confidence (t over the pairs); one pair: no interval (infinite)."""
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return mean, -math.inf, math.inf
    degrees = len(differences) - 1
    quantile = T95[degrees - 1] if degrees <= len(T95) else 1.645 + 1.5 / degrees
    half = quantile * statistics.stdev(differences) / math.sqrt(len(differences))
    return mean, mean - half, mean + half


def verdict(low: float, high: float) -> str:
    """A log ratio's interval read: *ahead* where all of it is above 0, *behind* where all is below, else *level*
    (the difference is within the noise of the measurement)."""
    return "ahead" if low > 0 else "behind" if high < 0 else "level"
