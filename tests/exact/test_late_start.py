"""A draft model joins a sequence only once its prefill of the prompt can pay for itself (`LateStart`):
before, the steps are plain; the output is plain decoding's either way."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from conftest import random_prompts
from specdecode.drafters.draft_model import DraftModelDrafter, LateStart, late_start
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")


def test_break_even_is_the_prefill_over_the_gain():
    start = LateStart(prefill=lambda n: n / 10, gain=0.25)  # 40 prompt tokens: 4 target forwards, 16 tokens
    start.begin(40)
    assert start.break_even(40) == pytest.approx(16.0)
    assert not start.ready(40, room=100)  # nothing generated yet
    assert not start.ready(55, room=100)  # 15 tokens generated: the prefill (of 55 tokens) needs 22
    assert not start.ready(62, room=100)  # 22 generated, 24.8 needed
    assert start.ready(67, room=100)  # 27 generated, 26.8 needed
    assert not start.ready(67, room=20)  # too few tokens left to pay back
    assert LateStart().ready(40, room=0)  # prefill cost unknown: at once


def test_gain_is_the_best_chains():
    """A draft token at 0.1 of a target forward, width free: the best chain at 95% acceptance gives
    several tokens per forward, so the gain is most of a forward; width as dear as depth: no chain pays."""
    free = late_start(0.1, DRAFT_CURVE, TARGET_CURVE, range(0, 9))
    assert 0.6 < free.gain < 1.0
    assert free.prefill(30) == pytest.approx(3.0)  # 30 tokens at 1 ms each, over 10 ms a target forward
    dear = late_start(0.5, DRAFT_CURVE, dataclasses.replace(CostCurve.linear(1.0), seconds=0.01), range(0, 9))
    assert dear.gain == pytest.approx(0.0) and dear.ready(10, room=0)  # (the drafter's own rule stops it)
    assert late_start(0.1, None, TARGET_CURVE, range(0, 9)).prefill is None
    assert late_start(0.1, CostCurve.linear(1.0), TARGET_CURVE, range(0, 9)).prefill is None  # not measured


TARGET_CURVE = dataclasses.replace(CostCurve.linear(0.0), seconds=0.01)  # width free, 10 ms a forward
DRAFT_CURVE = dataclasses.replace(CostCurve.linear(1.0), seconds=0.001, prefill=0.001)  # a prefill: 1 ms a token
PROMPT = random_prompts(1, seed=5, low=30, high=31)[0]


def _first_drafting_step(result) -> int | None:
    return next((i for i, step in enumerate(result.steps) if step.drafted), None)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_drafting_starts_at_break_even_and_output_is_plain(tiny_target, tree):
    target = HFCausalLM(tiny_target)
    width_free, dear_prefill = TARGET_CURVE, DRAFT_CURVE  # the draft model's prefill of n tokens: n / 10 forwards

    def drafter(draft_curve):
        model = HFCausalLM(copy.deepcopy(tiny_target))  # the target itself drafts: every draft accepted
        if tree:
            return DraftModelTreeDrafter(model, width_free, draft_cost=0.1, draft_curve=draft_curve, budget=8)
        return DraftModelDrafter(model, draft_cost=0.1, curve=width_free, draft_curve=draft_curve,
                                 confidence_threshold=0)

    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = SpeculativeEngine(target).generate(PROMPT, config)
    at_once = SpeculativeEngine(target, drafter=drafter(None), gate=False).generate(PROMPT, config)
    late_drafter = drafter(dear_prefill)
    late = SpeculativeEngine(target, drafter=late_drafter, gate=False).generate(PROMPT, config)
    assert late.token_ids == at_once.token_ids == plain.token_ids
    assert _first_drafting_step(at_once) == 0
    # step k comes after k generated tokens; the draft model's prefill of the 30 + k context tokens costs
    # 0.1 (30 + k) target forwards, paid back after that over the gain: plain steps until then
    start = late_drafter._cache.late_start
    first = _first_drafting_step(late)
    assert first == next(k for k in range(40) if k >= start.break_even(len(PROMPT) + k)) > 3 / start.gain
    assert all(step.new_tokens == 1 for step in late.steps[:first])
    short = SpeculativeEngine(target, drafter=drafter(dear_prefill), gate=False).generate(
        PROMPT, GenerationConfig(max_new_tokens=first, ignore_eos=True))
    assert _first_drafting_step(short) is None  # never enough room left to pay back
