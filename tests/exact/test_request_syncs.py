"""The host-read budget of `test_syncs.py` under what a request may add: penalties and a logit bias cost no
read of their own (the counts live on the device beside the logits; the host keeps the distinct tokens seen);
greedy log-probabilities ride along the verdict's one read (`Verdict.riders`), sampled ones cost one more."""

from __future__ import annotations

import copy

import pytest
import torch

from test_syncs import FIXED_CURVE, PATHS, syncs_per_step, tracked
from specdecode import devices
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupTreeDrafter
from specdecode.engine import SpeculativeEngine
from specdecode.engine.penalties import TokenHistory
from specdecode.types import Draft, SamplingParams
from specdecode.verify.tree import verify

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only]

PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, logit_bias=((7, 2.0),))
GREEDY, SAMPLED = SamplingParams(**PENALTIES), SamplingParams(temperature=1.0, min_p=0.05, **PENALTIES)


@PATHS
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_penalised_chain_step_reads_the_device_once(tiny_target, params, static):
    engine = SpeculativeEngine(tracked(tiny_target, static), drafter=PromptLookupDrafter())
    counts, events = syncs_per_step(engine, params)
    assert any(e.stats.drafted for e in events)  # it did speculate
    assert counts and max(counts) == 1, counts


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_draft_models_penalised_chain_reads_the_device_once(tiny_target, params):
    drafter = DraftModelDrafter(tracked(copy.deepcopy(tiny_target)), adaptive=False, num_tokens=5)
    drafter.confidence_threshold = 0.0
    engine = SpeculativeEngine(tracked(tiny_target), drafter=drafter)
    counts, events = syncs_per_step(engine, params)
    assert max(e.stats.drafted for e in events) == 5
    assert max(counts) == 1, counts


def test_penalised_greedy_tree_verification_reads_the_device_once():
    """The tree's tokens on the device (a draft model's): each row's counts are formed there."""
    parents = torch.tensor([-1, -1, 0, 0, 2, 4])
    logits = torch.randn(len(parents) + 1, 11).as_subclass(devices.Tracked)
    draft = Draft(tokens=torch.randint(11, (len(parents),)).as_subclass(devices.Tracked), parents=parents)
    history = TokenHistory([1, 2, 2, 5], GREEDY, 11, "cpu")
    history.add([3, 3])
    with devices.SyncCounter("cpu") as counter:
        verify(history.penalise(logits, draft), draft, GREEDY, None)
    assert counter.total == 1


@PATHS
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(**PENALTIES)], ids=["greedy", "penalised"])
def test_greedy_logprobs_ride_along_the_verdict(tiny_target, params, static):
    """Greedy: every emitted token is its row's processed argmax, so its log-probability and the top ones are
    read with the verdict: still one read a step, chains and trees."""
    for drafter in (PromptLookupDrafter(), PromptLookupTreeDrafter(FIXED_CURVE), None):
        engine = SpeculativeEngine(tracked(tiny_target, static), drafter=drafter)
        counts, events = syncs_per_step(engine, params, logprobs=5)
        assert all(e.logprobs is not None and len(e.logprobs) == len(e.token_ids) for e in events)
        assert max(counts) == 1, counts
        assert drafter is None or any(e.stats.drafted for e in events)


def test_sampled_logprobs_cost_one_more_read(tiny_target):
    engine = SpeculativeEngine(tracked(tiny_target), drafter=PromptLookupDrafter())
    counts, events = syncs_per_step(engine, SamplingParams(temperature=1.0), logprobs=2)
    assert any(e.stats.drafted for e in events)
    assert max(counts) == 2, counts
