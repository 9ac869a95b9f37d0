"""Exactness of a lossless method's output against plain decoding, with a diagnosis when they part.

In bfloat16 a forward over k tokens does not round exactly like k single-token forwards, so a near-tie
between the target's two best tokens can flip with no bug at all. At the first differing position we
therefore report the target's top-1 / top-2 logit margin (from a fresh float32-logits forward of the
common prefix): a tiny margin is a numerical tie, a large one points at a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.models.base import CausalLM

TIE_MARGIN = 0.25  # logits; below this a flip between two candidates is attributed to rounding


@dataclass(frozen=True)
class Divergence:
    position: int  # index into the generated tokens of the first difference
    reference_token: int
    other_token: int
    margin: float  # target's top-1 minus top-2 logit at that position

    @property
    def likely_tie(self) -> bool:
        return self.margin < TIE_MARGIN

    def describe(self) -> str:
        kind = "numerical near-tie" if self.likely_tie else "LARGE MARGIN: likely a bug"
        return (
            f"differs at token {self.position} ({self.reference_token} vs {self.other_token}); "
            f"target top-1/top-2 margin {self.margin:.3f} ({kind})"
        )


def first_difference(reference: list[int], other: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def diagnose(target: CausalLM, prompt_ids: list[int], reference: list[int], other: list[int]) -> Divergence | None:
    """None when `other` equals `reference` up to the shorter length; else where and how they part."""
    position = first_difference(reference, other)
    if position is None or position >= min(len(reference), len(other)):
        return None
    target.reset()
    logits = target.forward(torch.tensor(prompt_ids + reference[:position]), num_logits=1).logits[0]
    target.reset()
    top2 = torch.topk(logits.float(), 2).values
    return Divergence(position, reference[position], other[position], float(top2[0] - top2[1]))
