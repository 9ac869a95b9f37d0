"""The cost curve corrects itself from the forwards the engine times (`LiveCurve`), with a fake clock: a
curve measured in a busy moment does not switch speculation off for good, and a quiet curve does not
keep it on when the machine gets busy."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.models.costs import CostCurve
from specdecode.models.live_curve import LiveCurve
from specdecode.models.hf import HFCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedLM(HFCausalLM):
    """A tiny model whose forwards take, on a fake clock, what `slope` says: 1 + slope * (n - 1) units."""

    def __init__(self, model, clock: FakeClock, slope: float):
        super().__init__(model)
        self.clock, self.slope = clock, slope

    def forward(self, token_ids, **kwargs):
        self.clock.now += 1.0 + self.slope * (token_ids.numel() - 1)
        return super().forward(token_ids, **kwargs)


def test_estimates_are_medians_of_the_latest_forwards():
    curve = LiveCurve(CostCurve.linear(1.0, sizes=(1, 2, 4, 8)))  # seconds 0: one unit per token
    assert curve(4) == pytest.approx(4.0)
    for seconds in (2.0, 2.0, 50.0):  # one outlier among the latest forwards of 4 tokens
        curve.observe(4, seconds)
    curve.observe(3, 2.0)  # three tokens count as a forward of the next measured size, 4
    assert curve(4) == pytest.approx(2.0)
    # a narrower size untimed keeps the prior's figure; a wider one, the prior's shape at the timed scale (8 costs
    # twice 4, whose forwards turned out half the prior's)
    assert curve(8) == pytest.approx(4.0) and curve.seconds == pytest.approx(1.0)
    for _ in range(LiveCurve.WINDOW):
        curve.observe(1, 0.5)  # single-token forwards got faster: everything relative to them is dearer
    assert curve.seconds == pytest.approx(0.5) and curve(4) == pytest.approx(4.0)
    curve.observe(100, 1.0)  # beyond the measured sizes: ignored
    assert curve(8) == pytest.approx(8.0)


def test_one_stall_does_not_price_a_size_but_two_in_three_do():
    """A slower figure needs two timings out of three (the prior's counting as one); a first one faster than the
    prior is believed at once."""
    curve = LiveCurve(CostCurve.linear(1.0, sizes=(1, 2, 4, 8)))
    curve.observe(4, 60.0)  # one stall
    assert curve(4) == pytest.approx(4.0) and curve(8) == pytest.approx(8.0)
    curve.observe(4, 50.0)  # the machine really got busy
    assert curve(4) == pytest.approx(50.0) and curve(8) == pytest.approx(100.0)  # the prior's shape, busy
    quick = LiveCurve(CostCurve.linear(1.0, sizes=(1, 2, 4, 8)))
    quick.observe(8, 5.0)  # a prior measured while busy: one quiet timing corrects it
    assert quick(8) == pytest.approx(5.0)


def test_a_prior_measured_while_busy_does_not_price_the_widths_never_timed():
    """The prior's seconds came from one moment (a busy one, or another process's curve in the cache); only its
    shape is believed past the widest size timed. Priced at the prior's seconds, the widths a gate had not yet
    verified looked five times dearer than a one-token forward said: nothing was drafted for 128 steps, and a
    hundredfold prior never drafted at all."""
    prior = CostCurve.linear(0.05, sizes=(1, 2, 4, 8, 16, 32, 64))
    busy = LiveCurve(CostCurve(prior.sizes, prior.relative, seconds=5.0))
    busy.observe(1, 1.0)  # the machine as it is now: only plain steps timed so far
    assert busy.seconds == pytest.approx(1.0)
    assert busy.relative == pytest.approx(prior.relative)  # not 5x dearer past one token
    busy.observe(4, 1.5)  # a width timed dearer than the prior said: the wider ones scale with it
    assert busy(16) == pytest.approx(prior(16) * 1.5 / prior(4))


def test_a_size_never_timed_between_timed_ones_is_priced_on_the_line_between_them():
    """A prior that prices 2 to 8 alike (measured busy, or flattened by the never-cheaper rule and stored) makes the
    gate verify 8 and never 2 or 4, whose stale figures held 8 at the prior's price whatever its timings said. Now
    a size never timed is priced no higher than the narrowest timed size wider than it, and once sizes on both
    sides of it are timed, on the line between them."""
    curve = LiveCurve(CostCurve((1, 2, 4, 8), (1.0, 3.0, 3.0, 3.0), seconds=1.0))
    assert curve(4) == pytest.approx(3.0)  # nothing timed: the prior
    curve.observe(8, 2.0)
    assert curve(8) == pytest.approx(2.0) and curve(2) == pytest.approx(2.0) and curve(4) == pytest.approx(2.0)
    curve.observe(2, 1.2)
    curve.observe(1, 1.0)
    assert curve(2) == pytest.approx(1.2) and curve(8) == pytest.approx(2.0)
    assert curve(4) == pytest.approx(1.2 + (2.0 - 1.2) * 2 / 6)
    curve.observe(4, 1.3)  # once timed, its own figure
    assert curve(4) == pytest.approx(1.3)
    curve.at(5000)  # a band met for the first time starts from the one below, what was timed there included
    assert curve.relative == pytest.approx((1.0, 1.2, 1.3, 2.0))


def test_a_prompts_prefill_is_not_timed(tiny_target):
    clock = FakeClock()
    target = TimedLM(tiny_target, clock, slope=5.0)  # width dear: the prompt's forward would price size 8 at 36
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(num_tokens=4), clock=clock)
    engine.curve = LiveCurve(CostCurve.linear(0.1, sizes=(1, 2, 4, 8)))
    for _ in range(3):  # three sequences of one step each: their prompts' prefills
        engine.generate(PROMPT[:8], GenerationConfig(max_new_tokens=1, ignore_eos=True))
    assert engine.curve(8) == pytest.approx(1.7)


def test_probes_one_size_beyond_the_widest_that_pays_once_a_period():
    curve = LiveCurve(CostCurve.linear(1.0, sizes=(1, 2, 4, 8)))
    assert curve.probe(1) is None  # nothing has been timed yet: the prior is fresh
    probes = []
    for _ in range(3 * LiveCurve.PROBE_EVERY):
        curve.observe(1, 1.0)
        probes.append(curve.probe(1))
    assert [p for p in probes if p is not None] == [2, 2, 2]  # the next measured size after 1, every period
    assert curve.probe(8) is None  # nothing measured beyond the widest size


PROMPT = random_prompts(1, seed=21, low=20, high=21)[0] * 6  # repeats itself: prompt lookup drafts every step
CONFIG = GenerationConfig(max_new_tokens=160, ignore_eos=True)


def _late_drafted(result) -> int:
    """Draft tokens verified in the second half of the steps."""
    return sum(s.drafted for s in result.steps[len(result.steps) // 2 :])


def _engine(target, clock, prior: CostCurve | None) -> SpeculativeEngine:
    drafter = PromptLookupDrafter(num_tokens=8, ramp_up=False)  # offers 8 tokens whenever it finds a match
    engine = SpeculativeEngine(target, drafter=drafter, clock=clock, gate=prior is not None)
    if prior is not None:
        engine.curve = LiveCurve(prior)
    return engine


def test_a_curve_measured_while_busy_is_corrected(tiny_target):
    """The prior says width is dear (each token costs a full forward): no draft pays and none is verified.
    The forwards actually cost 1 + 0.02 (n - 1): the probes time wider forwards, the curve learns that
    they are cheap, and speculation comes back within the generation. Output as plain decoding's."""
    clock = FakeClock()
    target = TimedLM(tiny_target, clock, slope=0.02)
    engine = _engine(target, clock, CostCurve.linear(1.0))
    result = engine.generate(PROMPT, CONFIG)
    ungated = _engine(target, clock, None).generate(PROMPT, CONFIG)
    assert result.token_ids == ungated.token_ids
    assert _late_drafted(result) >= 0.8 * _late_drafted(ungated) > 0  # drafting again, about all it is offered
    assert engine.curve(2) < 1.1


def test_a_quiet_curve_follows_the_machine_when_it_gets_busy(tiny_target):
    """The prior says width is nearly free and drafts are verified whole; then every token a forward
    carries costs two single-token forwards (a machine busy elsewhere), so no draft can pay, and the gate
    stops verifying them, but for a probe now and then."""
    clock = FakeClock()
    target = TimedLM(tiny_target, clock, slope=0.02)
    engine = _engine(target, clock, CostCurve.linear(0.02))
    quiet = engine.generate(PROMPT, CONFIG)
    assert _late_drafted(quiet) >= 0.8 * _late_drafted(_engine(target, clock, None).generate(PROMPT, CONFIG)) > 0
    target.slope = 2.0
    busy = engine.generate(PROMPT, CONFIG)
    late = busy.steps[len(busy.steps) // 2 :]
    assert _late_drafted(busy) <= len(late) // LiveCurve.PROBE_EVERY + 1  # one-token probes only
    assert busy.token_ids == quiet.token_ids
    assert engine.curve(2) > 2.5


def test_a_corrected_curve_is_stored_for_the_next_process(tiny_target, monkeypatch):
    from specdecode.models import costs, live_curve

    stored = []
    monkeypatch.setattr(costs, "store", lambda key, curve: stored.append((key, curve)))
    curve = live_curve.live(HFCausalLM(tiny_target))
    before = len(stored)  # (the prior, measured and stored on first use)
    for _ in range(256):
        curve.observe(1, 1.0)
    assert len(stored) == before + 1 and stored[-1][1] == curve.current()


def test_the_engine_times_only_the_forward(tiny_target):
    clock = FakeClock()
    target = TimedLM(tiny_target, clock, slope=0.5)
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(num_tokens=4), clock=clock)
    engine.curve = LiveCurve(CostCurve.linear(0.5, sizes=(1, 2, 3, 4, 5, 6)))
    engine.generate(PROMPT, GenerationConfig(max_new_tokens=30, ignore_eos=True))
    torch.testing.assert_close(torch.tensor(engine.curve.relative),
                               torch.tensor(CostCurve.linear(0.5, sizes=(1, 2, 3, 4, 5, 6)).relative))


def test_a_probe_never_widens_a_tree_cut_to_a_subtree(tiny_target, monkeypatch):
    """Where a gate cuts a scored tree to the subtree that pays (the batch engine's, with several sequences; here
    the single engine's made to), a probe due that step asks for one size wider, which a chain gets as a longer
    prefix and a tree does not have: the tree goes as cut (it once raised "a tree draft has no prefix")."""
    from specdecode.drafters.base import Drafter
    from specdecode.engine import loop
    from specdecode.tree.budget import cut_batch
    from specdecode.types import Draft

    monkeypatch.setattr(loop, "cut_chain", lambda draft, curve, pending=1: cut_batch([draft], curve, pending)[0])

    class ScoredTree(Drafter):
        name = "scored-tree"

        def propose(self, context, max_tokens, params, generator):
            n = min(6, max_tokens)
            return Draft(tokens=torch.tensor(context[-n:][::-1], device="cpu"),
                         parents=torch.tensor([-1] + [i - 1 for i in range(1, n)], device="cpu"),
                         scores=torch.tensor([0.5 ** (i + 1) for i in range(n)], device="cpu"))

    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=ScoredTree())
    engine.curve = LiveCurve(CostCurve.linear(0.1, sizes=(1, 2, 4, 8)))  # two of the six nodes pay
    engine.curve.probe = lambda widest: widest + 2  # a probe due at every step
    result = engine.generate(PROMPT, GenerationConfig(max_new_tokens=12))
    assert result.new_tokens == 12 and any(0 < s.drafted < 6 for s in result.steps)  # cut, and not widened


def test_a_long_caches_forwards_are_priced_in_their_own_band():
    """A crowded batch's cache holds thousands of tokens, over which every width costs more: its timings price its own
    band of cache lengths, not the short contexts of the lone requests after it, nor the curve stored for later."""
    stored = []
    curve = LiveCurve(CostCurve.linear(0.1, sizes=(1, 2, 4, 8)), on_change=stored.append)
    curve.at(300)
    assert curve(4) == pytest.approx(1.3)
    for _ in range(LiveCurve.WINDOW):  # over 5,000 cached tokens every width costs three times as much
        curve.observe(1, 3.0, context=5000)
        curve.observe(4, 3.9 * 2, context=5000)  # and width more than that: attention over the cache per token
    assert curve(4) == pytest.approx(1.3)  # the short band as it was
    curve.at(5000)
    assert curve(4) == pytest.approx(2.6) and curve.seconds == pytest.approx(3.0)
    curve.at(2500)  # a band not met yet starts from the nearest below it
    assert curve(4) == pytest.approx(1.3)
    for _ in range(256 - 2 * LiveCurve.WINDOW):
        curve.observe(1, 1.0, context=5000)
    assert stored and stored[-1](4) == pytest.approx(1.3)  # what goes to the cache: the first band's


@pytest.mark.parametrize("engine_kind", ["single", "batch"])
def test_the_engines_time_each_forward_in_the_band_of_its_cache(tiny_target, engine_kind):
    from specdecode.engine.batch import BatchEngine

    clock = FakeClock()
    target = TimedLM(tiny_target, clock, slope=0.5)
    seen = []

    class Recording(LiveCurve):
        def at(self, context):
            seen.append(("at", context))
            super().at(context)

        def observe(self, n, seconds, context=None):
            seen.append(("observe", context))
            super().observe(n, seconds, context)

    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    if engine_kind == "single":
        engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(num_tokens=4), clock=clock)
        engine.curve = Recording(CostCurve.linear(0.1, sizes=(1, 2, 4, 8)))
        engine.generate(PROMPT[:40], config)
    else:
        engine = BatchEngine(target, clock=clock)
        engine.curve = Recording(CostCurve.linear(0.1, sizes=(1, 2, 4, 8)))
        for _ in range(2):
            engine.add(PROMPT[:40], config, PromptLookupDrafter(num_tokens=4))
        while engine.members:
            engine.step()
    observed = [c for kind, c in seen if kind == "observe"]
    assert observed and all(c is not None and c >= 40 for c in observed)
    # every timed forward was priced beforehand over the cache it then ran over
    priced = [c for kind, c in seen if kind == "at"]
    assert set(observed) <= set(priced)


def test_a_batchs_curve_measured_while_busy_is_corrected(tiny_target):
    """As above, in the batch engine: two sequences whose prior says width is dear verify no draft, and without a
    probe the widths beyond theirs would never be timed again, keeping that price for good (and in the cache). The
    batch's gate fills a forward up to the probed width now and then, the curve learns that width is cheap, and
    speculation comes back; each output is plain decoding's."""
    from specdecode.engine.batch import BatchEngine

    clock = FakeClock()
    target = TimedLM(tiny_target, clock, slope=0.02)
    engine = BatchEngine(target, clock=clock)
    engine.curve = LiveCurve(CostCurve.linear(1.0))
    prompts = [PROMPT, PROMPT[20:]]
    results = {}
    idents = [engine.add(p, CONFIG, PromptLookupDrafter(num_tokens=8, ramp_up=False)) for p in prompts]
    while engine.members:
        results |= {ident: result for ident, _, result in engine.step() if result is not None}
    plain = SpeculativeEngine(HFCausalLM(tiny_target))
    assert [results[i].token_ids for i in idents] == [plain.generate(p, CONFIG).token_ids for p in prompts]
    assert engine.curve(4) < 1.2  # (the prior: 4)
    assert all(_late_drafted(results[i]) > 0 for i in idents)


def test_tokens_beyond_the_widest_size_cost_at_least_a_prompt_token():
    """Beyond its widest measured size a curve goes on at its last segment's slope, but never below what a token of
    a prompt's prefill costs: a live curve's last segment can be flat (its estimates never fall with the width),
    which would price every token beyond it at nothing."""
    flat = CostCurve((1, 2, 4), (1.0, 2.0, 2.0), seconds=0.1, prefill=0.05)  # a prompt token: half a forward
    assert flat(4) == 2.0 and flat(6) == pytest.approx(3.0) and flat(10) == pytest.approx(5.0)
    assert CostCurve((1, 2, 4), (1.0, 2.0, 2.0), seconds=0.1)(6) == 2.0  # (no prefill measured: as before)
    steep = CostCurve((1, 2, 4), (1.0, 2.0, 4.0), seconds=0.1, prefill=0.05)
    assert steep(6) == pytest.approx(6.0)  # the last segment's slope where it is the steeper


def test_the_stored_curve_is_the_first_bands_and_a_new_band_starts_from_the_nearest_below():
    """What goes to the cache for the next process is the band of short caches (where the prior is measured),
    not the band a long conversation is in; a band met first starts from the nearest band below it, not the first."""
    sizes = (1, 2, 4, 8)
    prior = CostCurve(sizes, (1.0, 1.1, 1.3, 1.8), 0.01)
    stored: list[CostCurve] = []
    curve = LiveCurve(prior, on_change=stored.append)
    for _ in range(200):  # short caches: fast
        curve.observe(1, 0.01, context=100)
    curve.at(5000)  # a long cache: every forward ten times slower
    while curve._forwards < 256:
        curve.observe(1, 0.1)
    assert stored and stored[-1].seconds == pytest.approx(0.01)
    fresh = LiveCurve(prior)
    for _ in range(5):
        fresh.observe(1, 0.05, context=1500)  # the second band, timed at 0.05 s
    fresh.at(3000)  # the third, met first
    assert fresh.seconds == pytest.approx(0.05)
