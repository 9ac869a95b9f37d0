"""How far a measured ratio is from noise: the mean of paired log ratios and its two-sided interval at 0.9
confidence (Student's t over the pairs), its reading (`verdict`), the smallest gap a run of its size and noise
would find (`detectable`), and a one-sided p-value for *behind* (`p_behind`) with Holm's adjustment over a family of
comparisons (`holm`); shared by the benchmark scripts that judge one method against another
(`benchmarks/within_noise.py`, `benchmarks/serve_concurrency.py`)."""

from __future__ import annotations

import math
import statistics

# Student's t by degrees of freedom (1-30; beyond, the normal's quantile plus a little, `_t`): its 95th percentile
# (each side of an interval at 0.9 confidence) and its 80th (a power of 0.8)
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
       1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
T80 = (1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873, 0.870, 0.868, 0.866,
       0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854)
# how close two methods must be shown to be to call them level: the whole interval within this share either way (an
# interval that merely holds 1 says no gap was found, not that there is none: with a few pairs at the benchmark's
# noise, a method a tenth slower has an interval holding 1 in most runs, docs/results/auto.md)
MARGIN = 0.05


def _t(table: tuple[float, ...], normal: float, slack: float, degrees: int) -> float:
    return table[degrees - 1] if degrees <= len(table) else normal + slack / degrees


def t95(degrees: int) -> float:
    """Student's t, 95th percentile."""
    return _t(T95, 1.645, 1.5, degrees)


def t80(degrees: int) -> float:
    """Student's t, 80th percentile."""
    return _t(T80, 0.8416, 0.37, degrees)


def interval(differences: list[float]) -> tuple[float, float, float]:
    """Mean log ratio and its interval at 0.9 confidence (t over the pairs); one pair: no interval (infinite)."""
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return mean, -math.inf, math.inf
    half = t95(len(differences) - 1) * statistics.stdev(differences) / math.sqrt(len(differences))
    return mean, mean - half, mean + half


def detectable(differences: list[float]) -> float:
    """The smallest true log ratio this run would find (an interval clear of 0) four times in five: (t95 + t80)
    times the standard error of the mean; infinite for one pair."""
    if len(differences) < 2:
        return math.inf
    degrees = len(differences) - 1
    error = statistics.stdev(differences) / math.sqrt(len(differences))
    return (t95(degrees) + t80(degrees)) * error


def verdict(low: float, high: float, margin: float = MARGIN) -> str:
    """A log ratio's interval read: *ahead* where all of it is above 0, *behind* where all is below, *level* where
    all of it lies within `margin` either way (equivalence shown, as two one-sided tests), else *unresolved* (no gap
    found, and none up to the interval's ends ruled out)."""
    if low > 0:
        return "ahead"
    if high < 0:
        return "behind"
    bound = math.log1p(margin)
    return "level" if -bound < low and high < bound else "unresolved"


def chance_of_a_false_behind(comparisons: int) -> float:
    """Where every method is as fast as every other: the chance that at least one of `comparisons` independent
    verdicts reads *behind* by noise alone (each one-sided at a level of 0.05); a lower bound where the rival compared
    with is the slowest-looking of several."""
    return 1 - 0.95 ** comparisons


def t_tail(t: float, degrees: int) -> float:
    """P(T > t) for Student's t with a whole number of degrees of freedom, from the finite series in cos(atan(t /
    sqrt(degrees))) that the t distribution has for whole degrees (Abramowitz and Stegun 26.7.3-4): no library
    needed, exact to rounding."""
    if degrees < 1:
        raise ValueError("Student's t needs at least one degree of freedom")
    theta = math.atan(abs(t) / math.sqrt(degrees))
    cos2, term = math.cos(theta) ** 2, 1.0
    if degrees % 2:  # odd: (2 / pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        series = 0.0
        for k in range(1, (degrees - 1) // 2 + 1):
            series += term
            term *= cos2 * (2 * k) / (2 * k + 1)
        within = 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * series)
    else:  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        series = 0.0
        for k in range(1, degrees // 2 + 1):
            series += term
            term *= cos2 * (2 * k - 1) / (2 * k)
        within = math.sin(theta) * series
    tail = (1 - within) / 2  # P(|T| > |t|) / 2
    return tail if t >= 0 else 1 - tail


def p_behind(differences: list[float]) -> float:
    """The one-sided p-value of *behind*: how often a method no slower than its rival would show a mean log ratio
    this low or lower (t over the pairs); 1 for one pair, or for pairs that do not vary."""
    if len(differences) < 2:
        return 1.0
    spread = statistics.stdev(differences)
    mean = statistics.fmean(differences)
    if spread == 0:
        return 0.0 if mean < 0 else 1.0
    return t_tail(-mean / (spread / math.sqrt(len(differences))), len(differences) - 1)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family's p-values, in their order: an adjusted p below a level says the
    comparison holds at that level with the chance of any false finding in the family kept below it, whatever
    the comparisons' dependence."""
    order = sorted(range(len(p_values)), key=p_values.__getitem__)
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted
