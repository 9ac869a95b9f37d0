"""`auto` and what it is built of: heads as a composite's sources (the hidden states they share), the payoff
of each source per request (decisions from injected gains and costs, never timings), and the method's
composition for the loaded models. Its greedy equivalence comes from `equivalence/test_every_method.py`, its
sampling from `statistical/test_engine_sampling.py`."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    TOKENS, random_eagle3_head, random_medusa_heads, tiny_chat_qwen2, tiny_qwen2, tiny_tokenizer,
)
from specdecode.api import load_models
from specdecode.drafters import heads
from specdecode.drafters.auto import HEAD_BELOW, auto_sources, describe, heads_for
from specdecode.drafters.base import Drafter, Outcome
from specdecode.drafters.composite import CompositeDrafter
from specdecode.drafters.eagle3 import Eagle3TreeDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.source_payoff import EVIDENCE, FIRST_REST, Payoff, band, gains
from specdecode.drafters.sources import columns, hidden_request
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.methods import METHODS, choose
from specdecode.models.costs import CostCurve
from specdecode.models.live_curve import LiveCurve
from specdecode.models.hf import HFCausalLM
from specdecode.types import Draft, SamplingParams, StepStats, Verdict

pytestmark = pytest.mark.usefixtures("one_thread")

FREE = CostCurve.linear(0.0)
STATS = StepStats(0, 0, 0, 0.0, 0.0, 0)


# --- the hidden states the sources share ----------------------------------------------------------


def test_hidden_request_by_hand():
    assert hidden_request([False, False], 8) == (False, [None, None])
    assert hidden_request([False, True, True], None) == (True, [None, [0], [0]])
    assert hidden_request([True, (2, 5)], 8) == ((8, 2, 5), [[0], [1, 2]])
    assert hidden_request([(1, 4, 6), False, (4, 7)], 9) == ((1, 4, 6, 7), [[0, 1, 2], None, [1, 3]])
    with pytest.raises(ValueError):
        hidden_request([True, (2,)], None)


def test_columns_pick_a_sources_blocks():
    hidden = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 12)  # [2 rows, 3 blocks of 4]
    assert torch.equal(columns(hidden, [0, 1, 2], 3), hidden)
    picked = columns(hidden, [2, 0], 3)
    assert torch.equal(picked[:, :4], hidden[:, 8:]) and torch.equal(picked[:, 4:], hidden[:, :4])


def test_heads_in_a_composite_follow_the_context():
    """A Medusa tree (final-norm state) and an EAGLE-3 tree (three layers' inputs) beside prompt lookup: after
    every step, whichever source drafted it, each head holds the target's own features of the context: Medusa
    the final-norm state of the context's last-but-one token, EAGLE-3 those layers' inputs of every context
    token but the last."""
    target_model = tiny_qwen2(seed=3, layers=3, hidden=32)
    target = HFCausalLM(target_model)
    medusa = MedusaDrafter(random_medusa_heads(target_model), target_model, FREE, tree=True, budget=4)
    eagle3 = Eagle3TreeDrafter(random_eagle3_head(target_model), target_model, FREE, budget=4)
    composite = CompositeDrafter([PromptLookupDrafter(), medusa, eagle3], FREE, final_layer=3)
    assert composite.needs.hidden == (3, *eagle3.needs.hidden)
    engine = SpeculativeEngine(target, drafter=composite)
    engine.curve = FREE
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 9, 11, 5, 6]
    context = list(prompt)
    checked = drafted = 0

    def check(event):
        nonlocal checked, drafted
        context.extend(event.token_ids)
        drafted += event.stats.drafted > 0
        with torch.inference_mode():
            out = target_model(input_ids=torch.tensor([context]), output_hidden_states=True)
        states = out.hidden_states  # each layer's input, then the final-norm state: [1, n, d] each
        assert medusa._valid_for == len(context)
        assert torch.allclose(medusa._feature, states[-1][0, len(context) - 2], atol=1e-4)
        layers = eagle3.needs.hidden
        assert len(eagle3.state.features) == len(context) - 1
        expected = torch.cat([states[i][0, len(context) - 2] for i in layers])
        assert torch.allclose(eagle3.state.features[-1], expected, atol=1e-4)
        checked += 1

    engine.generate(prompt, GenerationConfig(max_new_tokens=24), on_step=check)
    assert checked >= 3 and drafted >= 2


# --- the payoff of each source --------------------------------------------------------------------


def test_gains_are_beyond_the_sources_before():
    assert gains([3, None, 5, 1]) == [3.0, None, 2.0, 0.0]
    assert gains([None, 0, 2]) == [None, 0.0, 2.0]


def test_a_source_that_does_not_pay_is_benched_then_tried_again():
    payoff = Payoff(2)
    for _ in range(EVIDENCE):  # the first pays its way, the second costs half a step and adds nothing
        assert payoff.asks(0) and payoff.asks(1)
        payoff.record([2, 2], [0.0, 0.5], verified=2)
    assert payoff.asks(0) and not payoff.asks(1) and payoff.benched() == [1]
    for _ in range(FIRST_REST - 1):  # the text keeps its character: benched for its whole rest
        payoff.record([2, None], [0.0, 0.0], verified=2)
        assert not payoff.asks(1)
    payoff.record([2, None], [0.0, 0.0], verified=2)
    assert payoff.asks(1)  # on trial again
    for _ in range(EVIDENCE):
        payoff.record([2, 2], [0.0, 0.5], verified=2)
    assert not payoff.asks(1)
    rest = payoff.ledgers[1].benched_until - payoff.step
    assert rest == 2 * FIRST_REST  # failing again: a longer rest
    payoff.begin()  # a new request: asked again
    assert payoff.asks(1)


def test_a_source_that_adds_tokens_worth_its_cost_stays():
    payoff = Payoff(2)
    for _ in range(5 * EVIDENCE):  # the second costs half a step and adds a token beyond the first
        payoff.record([1, 2], [0.0, 0.5], verified=2)
        assert payoff.asks(1)


def test_a_change_of_character_puts_benched_sources_back_on_trial():
    assert [band(x) for x in (0.0, 0.49, 0.5, 1.9, 2.0, 9.0)] == [0, 0, 1, 1, 2, 2]
    payoff = Payoff(2)
    for _ in range(EVIDENCE):  # open text, little accepted; the second source adds nothing
        payoff.record([0, 0], [0.0, 0.3], verified=0)
    assert not payoff.asks(1)
    for _ in range(10):  # long copies start
        payoff.record([6, None], [0.0, 0.0], verified=6)
        if payoff.asks(1):
            break
    assert payoff.asks(1) and payoff.step < EVIDENCE + FIRST_REST


class Costly(Drafter):
    """Proposes a fixed chain, each proposal advancing the injected clock by `seconds`."""

    def __init__(self, tokens: list[int], clock: list[float], seconds: float):
        self.tokens, self.clock, self.seconds, self.calls = tokens, clock, seconds, 0

    def propose(self, context, max_tokens, params, generator) -> Draft:
        self.calls += 1
        self.clock[0] += self.seconds
        return Draft(tokens=torch.tensor(self.tokens))


def test_the_composite_stops_asking_a_source_that_does_not_pay():
    """Costs are the sources' timed proposals (an injected clock) over the target's one-token forward."""
    clock = [0.0]
    curve = CostCurve((1, 2, 4), (1.0, 1.0, 1.0), seconds=0.1)
    cheap = Costly([1, 2], clock, 0.0)
    dear = Costly([7, 8], clock, 0.05)  # half a plain step, never right
    composite = CompositeDrafter([cheap, dear], curve, clock=lambda: clock[0])
    composite.begin([0])
    for _ in range(EVIDENCE + 3):
        draft = composite.propose([0], 4, SamplingParams(), None)
        merged = composite._merged
        assert merged is not None
        path = tuple(merged.tokens.index(t) for t in (1, 2))
        verdict = Verdict(num_drafted=len(draft), num_accepted=2, tokens=(1, 2, 3), path=path)
        composite.observe(Outcome(draft, verdict, STATS))
    assert cheap.calls == EVIDENCE + 3 and dear.calls == EVIDENCE
    assert composite.payoff.benched() == [1]


@pytest.mark.parametrize("pace", [None, 0.01])
def test_a_source_worth_its_time_alone_is_benched_at_a_batchs_pace(pace):
    """A source adds a token a step for half a plain step of drafting: worth it for a sequence alone; in a batch that
    outputs a token every 10 ms (every sequence waiting for it), its 50 ms cost five tokens: not worth it."""
    clock = [0.0]
    curve = CostCurve((1, 2, 4), (1.0, 1.0, 1.0), seconds=0.1)
    cheap, dear = Costly([1, 2], clock, 0.0), Costly([1, 2, 3], clock, 0.05)
    composite = CompositeDrafter([cheap, dear], curve, clock=lambda: clock[0])
    composite.begin([0])
    for _ in range(EVIDENCE + 3):
        composite.batch_pace(pace)
        draft = composite.propose([0], 4, SamplingParams(), None)
        merged = composite._merged
        assert merged is not None
        drafted = [t for t in (1, 2, 3) if t in merged.tokens]  # (the target's text: 1, 2, 3, 4)
        path = tuple(merged.tokens.index(t) for t in drafted)
        verdict = Verdict(num_drafted=len(draft), num_accepted=len(drafted),
                          tokens=(1, 2, 3, 4)[: len(drafted) + 1], path=path)
        composite.observe(Outcome(draft, verdict, STATS))
    assert composite.payoff.benched() == ([] if pace is None else [1])


def test_nothing_asked_is_a_plain_step():
    composite = CompositeDrafter([PromptLookupDrafter()], FREE)
    composite.begin([1, 2, 3])
    composite.payoff.ledgers[0].benched_until = 10
    assert len(composite.propose([1, 2, 3, 1, 2], 4, SamplingParams(), None)) == 0


# --- the method ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folders = []
    for layers in (3, 1):
        folders.append(tmp_path_factory.mktemp(f"auto-{layers}"))
        tiny_chat_qwen2(vocab_size=len(TOKENS) + 10, layers=layers).save_pretrained(folders[-1])
        tiny_tokenizer().save_pretrained(folders[-1])
    return load_models(*map(str, folders), dtype="float32", draft_dtype="float32", progress=False)


@pytest.fixture(scope="module")
def random_heads(models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("auto-heads")
    random_eagle3_head(models.target.model).save(folder / "eagle3", {})
    random_medusa_heads(models.target.model).save(folder / "medusa", {})
    return folder


def test_auto_is_made_of_what_the_models_allow(models, random_heads, monkeypatch, tmp_path):
    auto = METHODS["auto"]
    assert auto.lossless and auto.loads_draft_model and not auto.needs_draft_model
    options = choose("auto").options
    # no head for this target: the copy sources and the draft model
    monkeypatch.setattr(heads, "shipped_head", lambda model, kind: tmp_path / kind)
    assert heads_for(models.target) == []
    sources = auto_sources(models.target, models.draft, options)
    assert describe(sources) == "pld, suffix; draft (fallback)"
    assert describe(auto_sources(models.target, None, options)) == "pld, suffix"
    # the cheapest of its shipped heads
    monkeypatch.setattr(heads, "shipped_head", lambda model, kind: random_heads / kind)
    assert heads_for(models.target) == [("medusa", None)]
    drafter = models.drafter_for(choose("auto"))
    assert isinstance(drafter, CompositeDrafter) and drafter.name == "auto"
    assert describe(drafter.sources) == "pld, suffix; medusa (fallback)"  # a head guesses: no draft model beside it
    assert drafter.fallback_below == HEAD_BELOW  # asked while the copies promise fewer tokens than that
    assert drafter.needs.hidden is True  # Medusa reads the final-norm state alone
    # a head given is the one auto drafts with, whatever its kind
    given = choose("auto", head=str(random_heads / "eagle3"))
    assert heads_for(models.target, given.options.head) == [("eagle3", random_heads / "eagle3")]
    drafter = models.drafter_for(given)
    assert describe(drafter.sources) == "pld, suffix; eagle3-tree (fallback)"
    assert drafter.needs.hidden == drafter.sources[2].drafter.needs.hidden  # its layers alone
    # what a server counts against an owner's memory budget: its sources' (an EAGLE-3 head's features and cache)
    assert drafter.memory_bytes() == sum(source.drafter.memory_bytes() for source in drafter.sources) > 0


def test_auto_loads_the_draft_model_only_where_no_head_will_draft(models, random_heads, monkeypatch, tmp_path):
    """Known before the models load, from the target's name: where a head ships (or is given) auto drafts
    with it, not with the draft model, so the commands do not load one; elsewhere it is auto's fallback."""
    monkeypatch.setattr(heads, "shipped_head", lambda target, kind: (random_heads if "with-heads" in str(target)
                                                                    else tmp_path) / kind)
    auto = choose("auto")
    assert not auto.loads_draft_model("models/with-heads")
    assert auto.loads_draft_model("models/with-heads", backend="llamacpp")  # no hidden states there: no head
    assert auto.loads_draft_model("models/plain")
    assert not choose("auto", head=str(random_heads / "eagle3")).loads_draft_model("models/plain")
    assert choose("draft").loads_draft_model("models/with-heads") and not choose("pld").loads_draft_model("x")
    # the rule that finds a shipped head on the loaded model finds it from the name the model was loaded by
    monkeypatch.undo()
    assert heads.shipped_head("~/.cache/specdecode/models/qwen-x/", "medusa") == heads.shipped_head(
        type("Model", (), {"config": type("Config", (), {"_name_or_path": "qwen-x"})})(), "medusa")
    assert heads.shipped_head("Org/Qwen-X", "medusa") == heads.shipped_head("qwen-x", "medusa")  # a hub id's case


def test_auto_weighs_its_own_steps_so_the_engine_does_not_step_aside(models):
    """Where the gate follows a live curve the engine times whole steps and steps aside (`engine.payoff`), but not
    for `auto`: its merged tree keeps only nodes that pay and its sources' drafting time is charged against their
    gains (`Drafter.weighs_itself`). A switch asked for still applies."""
    for method, switch in (("auto", False), ("pld", True), ("composite", True)):
        engine = models.engine(method)
        engine.curve = LiveCurve(CostCurve.linear(0.02))
        assert (engine.step_aside is not None) is switch, method
    engine = SpeculativeEngine(models.target, models.tokenizer, models.drafter_for(choose("auto")), step_aside=True)
    engine.curve = LiveCurve(CostCurve.linear(0.02))
    assert engine.step_aside is not None


def test_auto_off_the_torch_backend_has_no_heads():
    class NoHidden:  # a backend without hidden states (llama.cpp's)
        pass

    assert heads_for(NoHidden()) == []  # type: ignore[arg-type]


def test_auto_is_every_default():
    import inspect

    from specdecode import api
    from specdecode.cli import generate, serve
    from specdecode.serve.server import Server

    assert inspect.signature(api.generate).parameters["method"].default == "auto"
    assert inspect.signature(generate.generate).parameters["method"].default.value == "auto"
    assert inspect.signature(serve.serve).parameters["method"].default.value == "auto"
    assert inspect.signature(Server).parameters["default_method"].default == "auto"
    assert list(METHODS)[0] == "auto"  # the methods table leads with it

