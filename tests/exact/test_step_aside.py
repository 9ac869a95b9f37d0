"""The engine steps aside (plain steps) while speculation is timed slower than plain decoding
(`engine.payoff`): the rule on fake step times, the engine on a fake clock, and every method's output
unchanged when its steps alternate between drafting and not."""

from __future__ import annotations

import collections

import pytest

from conftest import DRAFT_PRICES, LetterTokenizer, greedy_references, oracle_eagle_head, random_prompts
from specdecode.api import load_models
from specdecode.drafters import heads
from specdecode.drafters.composite import CompositeDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.sources import Source
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine import payoff
from specdecode.engine.payoff import StepAside
from specdecode.methods import resolve, variant_names
from specdecode.models.costs import CostCurve
from specdecode.models.live_curve import LiveCurve
from specdecode.models.hf import HFCausalLM
from test_eagle import eagle_drafter
from test_live_curve import FakeClock, TimedLM

pytestmark = pytest.mark.usefixtures("one_thread")


def play(aside: StepAside, steps: int, speculative: tuple[float, int], plain: float = 1.0) -> list[bool]:
    """`steps` steps: a speculative one takes speculative[0] seconds for speculative[1] tokens, a plain one
    `plain` seconds for one token. Returns which steps speculated."""
    ways = []
    for _ in range(steps):
        ways.append(aside.speculate)
        aside.record(*speculative) if aside.speculate else aside.record(plain, 1)
    return ways


def test_speculation_that_pays_keeps_the_lead_and_plain_trials_grow_rare():
    aside = StepAside()
    aside.begin()
    ways = play(aside, 400, speculative=(1.2, 2))  # 0.6 s a token against 1.0
    plain = [i for i, way in enumerate(ways) if not way]
    assert len(plain) <= 2 * 9  # one first trial, then trials at doubling intervals, 64 steps at most
    assert all(b - a <= payoff.LAST_PERIOD + payoff.TRIAL["plain"] for a, b in zip(plain, plain[1:]))
    assert sum(ways[-200:]) >= 200 - 2 * 4


def test_speculation_that_costs_steps_aside_after_one_trial():
    aside = StepAside()
    aside.begin()
    ways = play(aside, 400, speculative=(1.5, 1))  # 1.5 s a token against 1.0
    assert ways[: payoff.TRIAL["speculate"]] == [True] * payoff.TRIAL["speculate"]
    assert sum(ways) <= payoff.TRIAL["speculate"] * 8  # the first trial, then one per doubling period
    assert sum(ways[-200:]) <= payoff.TRIAL["speculate"] * 4


def test_the_lead_changes_hands_when_the_machine_or_the_text_does():
    aside = StepAside()
    aside.begin()
    play(aside, 300, speculative=(0.5, 2))
    assert aside.leader == payoff.SPECULATE
    late = play(aside, 300, speculative=(3.0, 1))  # the text stops being predictable
    assert aside.leader == payoff.PLAIN and sum(late[-100:]) <= 2 * payoff.TRIAL["speculate"]
    again = play(aside, 300, speculative=(0.5, 2))
    assert aside.leader == payoff.SPECULATE and sum(again[-100:]) >= 100 - 2 * payoff.TRIAL["plain"]


@pytest.mark.parametrize("speculative, leader", [((1.5, 1), payoff.PLAIN), ((0.5, 2), payoff.SPECULATE)])
def test_seconds_that_come_two_steps_late_lead_to_the_same_choice(speculative, leader):
    """On a GPU a step's seconds come a step or two after it (`StepAside.took`, `devices.EventStopwatch`): the
    runs are counted as they are played, the rates follow, and the faster way still leads."""
    aside = StepAside()
    aside.begin()
    late: collections.deque = collections.deque()
    for _ in range(300):
        seconds, tokens = speculative if aside.speculate else (1.0, 1)
        late.append((aside.took(tokens), seconds))
        if len(late) > 2:
            timed, seconds = late.popleft()
            timed(seconds)
    assert aside.leader == leader


def test_a_new_sequence_tries_speculation_first_and_its_prefill_is_not_timed():
    aside = StepAside()
    aside.begin()
    play(aside, 200, speculative=(3.0, 1))
    assert aside.leader == payoff.PLAIN
    aside.begin()
    assert aside.speculate
    aside.record(1000.0, 1)  # the prompt's prefill: not held against speculation
    assert aside.rates[payoff.SPECULATE].per_token < 1000.0 * (1 - payoff.DECAY)
    aside.forget()
    assert aside.leader == payoff.SPECULATE and aside.rates[payoff.PLAIN].per_token is None


def test_a_draft_models_catch_up_after_draftless_steps_is_not_timed():
    """Speculative steps that drafted nothing (a draft model waiting for its prefill to pay) count as plain:
    the step after them, where the draft model catches up on the whole context, is not held against
    speculation."""
    aside = StepAside()
    aside.begin()
    aside.record(1.0, 1)  # the prefill
    aside.record(1.0, 1, drafted=False)
    aside.record(1.0, 1, drafted=False)
    before = aside.rates[payoff.SPECULATE].per_token
    aside.record(50.0, 3)  # the catch-up: not timed
    assert aside.rates[payoff.SPECULATE].per_token == before


def play_sequences(aside: StepAside, sequences: int, steps: int, speculative: float,
                   catch_up: float) -> list[list[bool]]:
    """`sequences` sequences of `steps` one-token steps (plain: 1 s; speculative: `speculative` s; the first
    speculative step after plain ones, a draft model catching up: `catch_up` s). Returns the ways taken."""
    runs = []
    for _ in range(sequences):
        aside.begin()
        ways, previous = [], None
        for step in range(steps):
            way = aside.speculate
            seconds = 1.0 if not way or step == 0 else catch_up if previous is False else speculative
            aside.record(seconds, 1)
            ways.append(way)
            previous = way
        runs.append(ways)
    return runs


def test_dear_trials_grow_rare_and_a_new_sequence_carries_on_the_plain_run():
    """A draft model that does not pay and must catch up on 30 plain steps' worth of context at every
    trial: after the first sequence, new sequences do not start with a trial, and trials (their catch-ups
    and speculative steps) cost at most about TRIAL_SHARE of the time."""
    aside = StepAside()
    runs = play_sequences(aside, sequences=40, steps=60, speculative=1.1, catch_up=31.0)
    assert aside.leader == payoff.PLAIN and aside.trial_cost == pytest.approx(30.0)
    assert not any(ways[1] for ways in runs[2:])  # the second step of a sequence: no trial at its start
    later = [way for ways in runs[2:] for way in ways]
    lost = sum(30.0 + payoff.TRIAL["speculate"] * 0.1 for i, way in enumerate(later) if way and not later[i - 1])
    assert lost <= 1.5 * payoff.TRIAL_SHARE * len(later)
    cheap = StepAside()  # the same, catching up for free: every sequence starts with a trial, as before
    runs = play_sequences(cheap, sequences=4, steps=60, speculative=1.1, catch_up=1.1)
    assert all(ways[1] for ways in runs)


def test_a_drafter_that_owes_nothing_after_plain_steps_never_makes_trials_dear(tiny_target, tiny_drafter):
    """The same slow first speculative steps, from a drafter that catches up on nothing (`Drafter.catches_up`
    False: the copies, Medusa, a composite of them): they are noise, so every new sequence still starts with a
    trial; the engine tells its switch which kind of drafter it has."""
    aside = StepAside(dear_trials=False)
    runs = play_sequences(aside, sequences=6, steps=60, speculative=1.1, catch_up=31.0)
    assert not aside._dear() and all(ways[1] for ways in runs[1:])
    curve = CostCurve((1, 2), (1.0, 1.0))
    draft = HFCausalLM(tiny_drafter)
    copies = CompositeDrafter([PromptLookupDrafter(), Source(DraftModelDrafter(draft, **DRAFT_PRICES), "expensive")],
                              curve)
    assert copies.catches_up  # a draft model among its sources
    copies = CompositeDrafter([PromptLookupDrafter()], curve)
    assert not copies.catches_up
    for drafter, dear in ((copies, False), (DraftModelDrafter(draft, **DRAFT_PRICES), True)):
        engine = SpeculativeEngine(HFCausalLM(tiny_target), None, drafter, step_aside=True)
        assert engine.step_aside is not None and engine.step_aside.dear_trials is dear


class SlowDrafter(DraftModelDrafter):
    """A draft model whose every proposal costs `cost` units on the fake clock."""

    def __init__(self, model, clock: FakeClock, cost: float, **kwargs):
        super().__init__(model, **kwargs)
        self.clock, self.cost = clock, cost

    def propose(self, context, max_tokens, params, generator):
        self.clock.now += self.cost
        return super().propose(context, max_tokens, params, generator)


@pytest.mark.parametrize("drafter_kind, cost, most_steps_aside", [("unrelated", 2.0, True), ("self", 0.2, False)])
def test_the_engine_steps_aside_where_drafting_costs_more_than_it_saves(
        tiny_target, tiny_drafter, drafter_kind, cost, most_steps_aside):
    """On a fake clock where width is nearly free (the gate lets every draft through): an unrelated draft
    model that costs two forwards a proposal is left out after its trial; the target drafting for itself
    (everything accepted) keeps drafting. The output is plain decoding's either way."""
    clock = FakeClock()
    prompts = random_prompts(3, seed=41)
    references = greedy_references(tiny_target, prompts, 60)
    draft = HFCausalLM(tiny_drafter if drafter_kind == "unrelated" else tiny_target)
    drafter = SlowDrafter(draft, clock, cost, num_tokens=4, adaptive=False, confidence_threshold=0)
    engine = SpeculativeEngine(TimedLM(tiny_target, clock, slope=0.02), LetterTokenizer(), drafter,
                               clock=clock, step_aside=True)
    engine.curve = LiveCurve(CostCurve.linear(0.02))
    aside = []
    for prompt, reference in zip(prompts, references):
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=60))
        assert result.token_ids == reference
        aside.append(result.summary()["stepped_aside"])
    if most_steps_aside:
        assert min(aside) > 0.7
    else:
        assert max(aside) < 0.15


class Alternating(StepAside):
    """A fixed schedule instead of timings: speculate and step aside in runs of 1, 2, 3 ... steps."""

    def __init__(self):
        super().__init__()
        self._ways = [way for n in range(1, 8) for way in [True] * n + [False] * n] * 10

    def begin(self) -> None:
        self._step = 0

    @property
    def speculate(self) -> bool:
        return self._ways[self._step % len(self._ways)]

    def took(self, tokens: int, drafted: bool = True):
        self._step += 1
        return lambda seconds: None


@pytest.fixture(scope="module")
def tiny_models(tiny_folder):
    return load_models(str(tiny_folder), str(tiny_folder), dtype="float32", draft_dtype="float32", progress=False)


@pytest.mark.parametrize("variant", [m for m in variant_names() if m != "ar" and not resolve(m)[0].trained])
def test_every_method_is_exact_when_its_steps_alternate_with_plain_ones(tiny_models, variant):
    """Drafters keep state between proposals (caches, windows, guesses, indexes); a step that never asks
    the drafter must leave it able to go on, and the output plain decoding's."""
    prompts = [tiny_models.encode(text) for text in ("the cat the cat sat", "a dog and the cat", "the the the")]
    plain = SpeculativeEngine(tiny_models.target, tiny_models.tokenizer)
    config = GenerationConfig(max_new_tokens=40)
    references = [plain.generate(prompt, config).token_ids for prompt in prompts]
    base = variant.removesuffix("-fixed")
    engine = tiny_models.engine(base.replace("-tree", ""), tree="-tree" in base,
                                choices=(((0,), (1,), (0, 0)) if variant.endswith("-fixed") else None))
    engine.step_aside = Alternating()
    for prompt, reference in zip(prompts, references):
        result = engine.generate(prompt, config)
        assert result.token_ids == reference, variant
        assert 0 < result.summary()["stepped_aside"] < 1


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_an_eagle_head_keeps_its_features_aligned_across_plain_steps(tiny_target, kind, monkeypatch):
    """The head that knows the target (its 'prediction' is the target's own next feature) still has every
    draft accepted after plain steps: the features of the tokens those steps output reached it. (The head
    drafts in float32 here: quantized, the target's LM head would no longer be the oracle's.)"""
    monkeypatch.setattr(heads, "DRAFT_BITS", None)
    prompt = random_prompts(1, seed=8)[0]
    head, reference = oracle_eagle_head(tiny_target, prompt, 40)
    engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), eagle_drafter(kind, head, tiny_target),
                               gate=False, step_aside=False)
    engine.step_aside = Alternating()
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=40))
    assert result.token_ids == reference
    drafted = [s for s in result.steps[1:-1] if s.drafted]  # the last step may be cut by the length
    assert drafted and all(s.accepted == (s.draft_depth or s.drafted) for s in drafted)
