"""Exactness of a lossless method's output against plain decoding, with a diagnosis when they part.

In bfloat16 a forward over k tokens does not round exactly like k single-token forwards, so a near-tie
between the target's two best tokens can flip with no bug at all. At the first differing position we
therefore report the target's top-1 / top-2 logit margin (from a fresh float32-logits forward of the
common prefix): a tiny margin is a numerical tie, a large one points at a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode import metrics
from specdecode.bench.harness import Record
from specdecode.bench.report import same_output
from specdecode.models.base import CausalLM
from specdecode.sampling import logits_to_probs

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


def diagnose_divergences(models, records: list[Record], lossless: dict[str, bool],
                         references: dict[str, str] | None = None, reference: str = "ar") -> list[str]:
    """For each lossless run whose output differs from its reference's (`ar`, or the row `references`
    names), where and with what logit margin; for an engine that streams text only, where the texts part
    (no logits: a near-tie cannot be told from a bug)."""
    runs = {(r.method, r.task, r.repeat): r for r in records if r.ok}
    notes = []
    for r in records:
        name = (references or {}).get(r.method, reference)
        other = runs.get((name, r.task, r.repeat))
        if r.method == name or not r.ok or other is None or not lossless[r.method] or same_output(r, other):
            continue
        against = "" if name == "ar" else f" vs {name}"
        if not (r.ids_known and other.ids_known):
            turn = next(i for i, (a, b) in enumerate(zip(r.texts, other.texts)) if a != b)
            my_text, their_text = r.texts[turn], other.texts[turn]
            at = next((i for i, (a, b) in enumerate(zip(my_text, their_text)) if a != b),
                      min(len(my_text), len(their_text)))
            notes.append(f"{r.method} on {r.task_id}{against} (repeat {r.repeat}, turn {turn + 1}): the text "
                         f"differs at character {at} ({their_text[at:at + 12]!r} vs {my_text[at:at + 12]!r}); the "
                         "engine streams text without logits, so a numerical near-tie cannot be told from a bug")
            continue
        engine = r.engine_prompt_tokens is not None or other.engine_prompt_tokens is not None
        for turn, ((prompt, mine), (_, theirs)) in enumerate(zip(r.turns(), other.turns())):
            if mine != theirs:
                divergence = diagnose(models.target, prompt, theirs, mine)
                what = divergence.describe() if divergence else f"lengths differ ({len(mine)} vs {len(theirs)})"
                if divergence and engine:
                    what += " (the margin of our local target: an engine's own weights may round otherwise)"
                notes.append(f"{r.method} on {r.task_id}{against} (repeat {r.repeat}, turn {turn + 1}): {what}")
                break
    return notes


def target_log_probs(models, records: list[Record], lossless: dict[str, bool], params) -> dict[str, list[float]]:
    """Per lossless method, the target's log-probability (under the processed distribution) of every token
    it sampled."""
    log_probs: dict[str, list[float]] = {}
    for r in records:
        if not r.ok or not lossless[r.method]:
            continue
        for prompt, new in r.turns():
            if not new:
                continue
            models.target.reset()
            logits = models.target.forward(torch.tensor(prompt + new), num_logits=len(new) + 1).logits[:-1]
            probs = logits_to_probs(logits, params)  # [new, vocab]
            picked = probs[torch.arange(len(new)), torch.tensor(new)].clamp_min(1e-30)
            log_probs.setdefault(r.method, []).extend(picked.log().tolist())
    models.target.reset()
    return log_probs


def distribution_notes(log_probs: dict[str, list[float]]) -> list[str]:
    """Each method's sampled tokens' target log-probabilities against plain sampling's (`ar`), by a
    two-sample KS test."""
    notes = []
    for method, values in log_probs.items():
        if method == "ar" or "ar" not in log_probs:
            continue
        gap, p = metrics.two_sample_ks(values, log_probs["ar"])
        # (a p above the threshold finds no difference; it does not show there is none)
        verdict = "no difference from plain sampling found" if p > 0.01 else "DIFFERS from plain sampling"
        notes.append(f"{method}: target log-probabilities of its {len(values)} sampled tokens vs ar's "
                     f"{len(log_probs['ar'])}: KS distance {gap:.3f}, p = {p:.3f} ({verdict}; tokens within "
                     "a sequence are not independent, so p is approximate)")
    return notes


def sampled_fidelity(models, records: list[Record], lossless: dict[str, bool], params) -> list[str]:
    """Statistical exactness for sampling runs: the target's log-probability (under the processed
    distribution) of every sampled token, per method, against plain decoding's, by a two-sample KS test."""
    return distribution_notes(target_log_probs(models, records, lossless, params))
