"""Every metric specdecode reports, defined once.

- new tokens: generated token ids (EOS included when generated), counted from ids, never from text.
- target forwards: forward passes of the target model; the prefill is the first.
- mean accepted tokens: new tokens / target forwards. Includes the correction or bonus token each step
  makes, so plain decoding scores exactly 1.0 and a step that accepts 3 drafts scores 4.
- mean draft tokens: draft tokens (tree nodes) verified per target forward, the prefill included.
- acceptance rate: accepted draft tokens / drafted tokens (0 drafted: undefined, reported as None).
- accepted per position: for draft position i (0-based), the fraction of steps that drafted at least
  i + 1 tokens in which the token at position i was accepted. For a token tree, position i is depth
  i + 1: the fraction of steps whose tree reached that depth in which a node at that depth was accepted.
- acceptance rate of a tree counts every node as drafted, so it is lower than a chain's for the same
  accepted tokens; compare trees and chains by mean accepted tokens and tokens per second.
- tokens per second: new tokens / wall-clock seconds of the whole generation, prefill included.
- speedup: a method's tokens per second / plain decoding's (our `ar`), measured in the same run on the
  same prompts; over repeats, the mean and standard deviation of the per-repeat ratios.
- draft share: seconds spent drafting / (seconds drafting + seconds verifying).
- predicted speedup: what the standard analytical model gives from the measured acceptance and the
  measured costs of a draft token, a verification and a plain decoding step (`predicted_speedup`).
- exact: a lossless method's new token ids equal `ar`'s on the same prompt, token for token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specdecode.types import StepStats


def mean_accepted_tokens(steps: Sequence[StepStats]) -> float:
    forwards = len(steps)
    return sum(s.new_tokens for s in steps) / forwards if forwards else 0.0


def mean_drafted(steps: Sequence[StepStats]) -> float:
    """Draft tokens (tree nodes) verified per target forward."""
    return sum(s.drafted for s in steps) / len(steps) if steps else 0.0


def stepped_aside(steps: Sequence[StepStats]) -> float:
    """The share of steps that did not draft because speculation was timed slower than plain decoding."""
    return sum(s.stepped_aside for s in steps) / len(steps) if steps else 0.0


def forced_share(steps: Sequence[StepStats]) -> float:
    """The share of new tokens that a constraint's grammar forced and that were drafted from it alone
    (`engine.forced`): output the target verified but no drafter had to guess."""
    new = sum(s.new_tokens for s in steps)
    return sum(s.forced for s in steps) / new if new else 0.0


def acceptance_rate(steps: Sequence[StepStats]) -> float | None:
    drafted = sum(s.drafted for s in steps)
    return sum(s.accepted for s in steps) / drafted if drafted else None


def accepted_per_position(steps: Sequence[StepStats]) -> list[float]:
    def depth(s: StepStats) -> int:
        return s.drafted if s.draft_depth is None else s.draft_depth

    longest = max((depth(s) for s in steps), default=0)
    rates = []
    for i in range(longest):
        reached = [s for s in steps if depth(s) > i]
        rates.append(sum(s.accepted > i for s in reached) / len(reached))
    return rates


def tokens_per_second(new_tokens: int, seconds: float) -> float:
    return new_tokens / seconds if seconds > 0 else 0.0


def chain_acceptance(mean_accepted_drafts: float, mean_draft_length: float) -> float:
    """The per-token acceptance probability a of the standard model (each draft token accepted
    independently with probability a, a chain stops at the first rejection) that explains the measured
    accepted drafts per step: a (1 - a^k) / (1 - a) = mean accepted drafts, for k = mean draft length.
    Solved by bisection; 0 when nothing was accepted."""
    k = mean_draft_length
    if k <= 0 or mean_accepted_drafts <= 0:
        return 0.0
    if mean_accepted_drafts >= k:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        a = (low + high) / 2
        expected = a * (1 - a**k) / (1 - a)
        low, high = (a, high) if expected < mean_accepted_drafts else (low, a)
    return (low + high) / 2


def predicted_speedup(acceptance: float, draft_length: float, draft_token_seconds: float,
                      verify_seconds: float, plain_token_seconds: float) -> float:
    """Speedup the standard analytical model predicts (Leviathan et al. 2023): a step yields
    (1 - a^(k+1)) / (1 - a) tokens and costs k draft tokens plus one verification, against one plain
    decoding step per token."""
    k, a = draft_length, min(acceptance, 1 - 1e-9)
    tokens_per_step = (1 - a ** (k + 1)) / (1 - a)
    step_seconds = k * draft_token_seconds + verify_seconds
    return tokens_per_step * plain_token_seconds / step_seconds if step_seconds > 0 else 0.0


def stepwise_speedup(tokens: Sequence[int], verify_costs: Sequence[float], draft_costs: Sequence[float]) -> float:
    """The speedup over plain decoding that a cost curve predicts for a run's steps: step i adds tokens[i]
    tokens (accepted + 1) and costs verify_costs[i] (its verify forward at its width, relative to a one-token
    forward: the cost curve) plus draft_costs[i] (its drafting's seconds over a one-token forward's), so the
    run takes sum(costs) one-token forwards where plain decoding takes sum(tokens)."""
    cost = sum(verify_costs) + sum(draft_costs)
    return sum(tokens) / cost if cost > 0 else 0.0


def mean_and_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    std = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return mean, std


def two_sample_ks(first: Sequence[float], second: Sequence[float]) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov test: (largest gap between the empirical CDFs, asymptotic p-value).

    Used to judge sampled output statistically: if a method is lossless, the target's log-probabilities
    of the tokens it samples follow the same distribution as those plain decoding samples.
    """
    a, b = sorted(first), sorted(second)
    n, m = len(a), len(b)
    if not n or not m:
        return float("nan"), float("nan")
    i = j = 0
    gap = 0.0
    while i < n and j < m:
        value = min(a[i], b[j])
        while i < n and a[i] == value:
            i += 1
        while j < m and b[j] == value:
            j += 1
        gap = max(gap, abs(i / n - j / m))
    effective = (n * m / (n + m)) ** 0.5
    lam = (effective + 0.12 + 0.11 / effective) * gap  # Stephens' small-sample correction
    if lam < 0.3:  # the series below converges badly there; the true value exceeds 0.99999
        return gap, 1.0
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return gap, min(max(p, 0.0), 1.0)
