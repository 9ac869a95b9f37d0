"""The replay of a model-free drafter on recorded greedy outputs takes exactly the steps the engine takes."""

from __future__ import annotations

import pytest

from specdecode.bench.replay import predicted_speedup, replay
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupTreeDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM

PROMPT = [5, 17, 42, 8, 90, 3, 5, 17, 42, 8, 61, 7, 5, 17, 42] * 3


@pytest.mark.parametrize("curve", [CostCurve.linear(0.05), CostCurve((1, 2, 4, 16), (1.0, 1.7, 2.6, 5.3))])
@pytest.mark.parametrize("make", [lambda curve: PromptLookupDrafter(num_tokens=12),
                                  lambda curve: PromptLookupTreeDrafter(curve)], ids=["pld", "pld-tree"])
def test_replay_takes_the_engines_steps(tiny_target, curve, make):
    target = HFCausalLM(tiny_target)
    config = GenerationConfig(max_new_tokens=60, ignore_eos=True)
    plain = SpeculativeEngine(target).generate(PROMPT, config)
    engine = SpeculativeEngine(target, drafter=make(curve))
    engine.curve = curve
    result = engine.generate(PROMPT, config)
    assert result.token_ids == plain.token_ids
    steps = replay(make(curve), PROMPT, plain.token_ids, curve)
    assert [(s.drafted, s.accepted) for s in steps] == [(s.drafted, s.accepted) for s in result.steps]
    assert [s.forward_tokens for s in steps] == [s.forward_tokens for s in result.steps]
    if curve(16) < 2:  # where width is cheap the drafts are verified: the case is not vacuous
        assert sum(s.accepted for s in steps) > 0
    plain_steps = replay(None, PROMPT, plain.token_ids, curve)
    assert len(plain_steps) == len(plain.token_ids) and predicted_speedup([plain_steps], [plain_steps]) == 1.0


def test_the_drafters_room_is_the_budget_not_the_outputs_length():
    """An output that ended early (an end-of-sequence token) does not tell the engine so in advance: a
    replay with the generation's budget offers the drafter the room the engine did, and accepts nothing
    past the output's end."""
    prompt = list(range(1, 41)) + [1, 2, 3]  # the lookup copies 4, 5, ..., 40
    output = [4, 5, 6, 7, 8]  # the answer ended after five tokens
    rooms = []

    class Copier(PromptLookupDrafter):
        def propose(self, context, max_tokens, params, generator):
            rooms.append(max_tokens)
            return super().propose(context, max_tokens, params, generator)

    curve = CostCurve.linear(0.0)
    steps = replay(Copier(num_tokens=40, ramp_up=False), prompt, output, curve, gate=False, max_new_tokens=32)
    assert rooms == [31] and steps[0].drafted == 31  # the engine's room: budget - 1
    assert len(steps) == 1 and steps[0].accepted == len(output)
    rooms.clear()
    steps = replay(Copier(num_tokens=40, ramp_up=False), prompt, output, curve, gate=False)
    assert rooms == [len(output) - 1] and steps[0].drafted == len(output) - 1
