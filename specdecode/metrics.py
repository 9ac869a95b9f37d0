"""Every metric specdecode reports, defined once.

- new tokens: generated token ids (EOS included when generated), counted from ids, never from text.
- target forwards: forward passes of the target model; the prefill is the first.
- mean accepted tokens: new tokens / target forwards. Includes the correction or bonus token each step
  makes, so plain decoding scores exactly 1.0 and a step that accepts 3 drafts scores 4.
- acceptance rate: accepted draft tokens / drafted tokens (0 drafted: undefined, reported as None).
- accepted per position: for draft position i (0-based), the fraction of steps that drafted at least
  i + 1 tokens in which the token at position i was accepted.
- tokens per second: new tokens / wall-clock seconds of the whole generation, prefill included.
- speedup: a method's tokens per second / plain decoding's, measured in the same run on the same prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.types import StepStats


def mean_accepted_tokens(steps: Sequence[StepStats]) -> float:
    forwards = len(steps)
    return sum(s.new_tokens for s in steps) / forwards if forwards else 0.0


def acceptance_rate(steps: Sequence[StepStats]) -> float | None:
    drafted = sum(s.drafted for s in steps)
    return sum(s.accepted for s in steps) / drafted if drafted else None


def accepted_per_position(steps: Sequence[StepStats]) -> list[float]:
    longest = max((s.drafted for s in steps), default=0)
    rates = []
    for i in range(longest):
        reached = [s for s in steps if s.drafted > i]
        rates.append(sum(s.accepted > i for s in reached) / len(reached))
    return rates


def tokens_per_second(new_tokens: int, seconds: float) -> float:
    return new_tokens / seconds if seconds > 0 else 0.0
