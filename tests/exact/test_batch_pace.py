"""The batch's pace (`engine.pacing.Pace`): seconds a token of its output over its latest steps, told to each
sequence's drafter before it drafts where the forward carries several sequences (`Drafter.batch_pace`), on a clock the
test turns (the fake model spends a tick a token it feeds), so nothing here depends on the machine."""

from __future__ import annotations

import math

import pytest

from fakes import TARGET, FakeLM
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.engine import GenerationConfig
from specdecode.engine.batch import BatchEngine
from specdecode.engine.pacing import Pace
from specdecode.engine.payoff import DECAY

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_pace_is_decayed_seconds_over_decayed_tokens():
    pace, seen = Pace(), []
    assert pace.per_token is None
    pace.took(2, seen.append)(0.5)
    assert pace.per_token == 0.25 and seen == [0.5]  # (the step's seconds handed on)
    pace.took(0, seen.append)(1.0)  # a step that output nothing (a prompt's chunk) still took its time
    assert math.isclose(pace.per_token, (DECAY * 0.5 + 1.0) / (DECAY * 2))


class Ticking(FakeLM):
    """Spends a tick of `now` for each token a forward feeds."""

    def __init__(self):
        super().__init__(TARGET, max_context=512)
        self.now = 0.0

    def forward(self, token_ids, **options):
        self.now += token_ids.numel()
        return super().forward(token_ids, **options)


class Told(PromptLookupDrafter):
    """Prompt lookup that keeps the paces it is told."""

    def __init__(self):
        super().__init__()
        self.paces: list[float | None] = []

    def batch_pace(self, seconds_per_token):
        self.paces.append(seconds_per_token)


def test_drafters_hear_the_batchs_pace_only_while_they_share_its_forward():
    target = Ticking()
    engine = BatchEngine(target, clock=lambda: target.now)
    short, long = Told(), Told()
    engine.add([1, 2, 3, 1, 2], GenerationConfig(max_new_tokens=3, ignore_eos=True), short)
    engine.add([3, 2, 1, 3, 2], GenerationConfig(max_new_tokens=12, ignore_eos=True), long)
    heard = []  # (sequences in the forward, the engine's pace before the step, what the long one was told)
    while engine.members:
        before, count = engine.pace.per_token, len(engine.members)
        engine.step()
        heard.append((count, before, long.paces[-1]))
    shared = [(before, told) for count, before, told in heard if count == 2]
    alone = [told for count, _, told in heard if count == 1]
    assert shared[0] == (None, None)  # before any step was timed
    assert all(told == before for before, told in shared) and shared[-1][1] > 0
    assert alone and all(told is None for told in alone)  # the last one left decodes alone: a plain step's price
