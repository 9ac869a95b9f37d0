"""Self-speculative decoding: drafting with a subset of the target's own layers over its own KV cache.

Exact forwards against the full model and against a copy with the layers removed; the target's cache
left exactly as it was after a draft; greedy equivalence through the engine; lossless sampling; the layer
search against brute force, within its budget, cached. Tiny randomly initialised Qwen2 models in float32.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import TOKENS, greedy_references, greedy_runs, random_prompts, tiny_qwen2, tiny_tokenizer
from goodness_of_fit import assert_follows, continuations, engine_outcomes, model_logits
from specdecode.drafters import self_speculative as ss
from specdecode.drafters.self_speculative import drafter as ss_drafter, search as ss_search
from specdecode.drafters.self_speculative import (
    CalibrationSet,
    EarlyExitDrafter,
    LayerSkipDrafter,
    Scorer,
    SkippedLayers,
    build_earlyexit,
    build_layerskip,
    calibration_prompts,
    chain_speedup,
    search_exit,
    search_skip,
)
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.methods import DrafterOptions
from specdecode.models.base import CausalLM
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.types import SamplingParams

PROMPTS = random_prompts(8, seed=5)  # 3 to 23 tokens: some prefills are drafted, some not (prefill_limit 16)
LENGTHS = [1, 2, 7, 40]
CURVE = CostCurve.linear(0.05)  # a fixed cost curve: tests do not time anything


pytestmark = pytest.mark.usefixtures("one_thread")


def full_logits(model, prompt: list[int]) -> torch.Tensor:
    return HFCausalLM(model).forward(torch.tensor(prompt)).logits  # [len(prompt), vocab]


def snapshot(target: HFCausalLM) -> list:
    """Every layer's cached keys and values (None for a layer that holds nothing)."""
    out = []
    for layer in target._cache.layers:
        empty = not layer.is_initialized or layer.keys.numel() == 0
        out.append(None if empty else (layer.keys.clone(), layer.values.clone()))
    return out


def same_cache(a: list, b: list) -> bool:
    def same(x, y) -> bool:
        if x is None or y is None:
            return x is None and y is None
        return torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])

    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def without_layers(model, skip: tuple[int, ...]):
    """Reference: a copy of `model` whose skipped layers are removed, run by transformers' own forward."""
    clone = copy.deepcopy(model)
    kept = [i for i in range(model.config.num_hidden_layers) if i not in skip]
    clone.model.layers = torch.nn.ModuleList([clone.model.layers[i] for i in kept])
    for new_index, layer in enumerate(clone.model.layers):
        layer.self_attn.layer_idx = new_index
    clone.config.num_hidden_layers = len(kept)
    clone.config.layer_types = clone.config.layer_types[: len(kept)]
    return clone


# --- Forwards -----------------------------------------------------------------------------------------


def test_all_layers_kept_equals_full_model(tiny_target):
    prompt = PROMPTS[3]
    expected = full_logits(tiny_target, prompt)
    target = HFCausalLM(tiny_target)
    target.forward(torch.tensor(prompt[:-4]))
    view = SkippedLayers(target, [])
    several = view.forward(torch.tensor(prompt[-4:-1])).logits  # three tokens over the target's cache
    one = view.forward(torch.tensor(prompt[-1:])).logits  # then one
    assert torch.allclose(several, expected[-4:-1], atol=1e-5)
    assert torch.allclose(one, expected[-1:], atol=1e-5)
    assert view.cache_length == len(prompt) and target.cache_length == len(prompt) - 4


def test_early_exit_equals_full_model_at_the_last_layer_and_hidden_states_before(tiny_target):
    prompt = PROMPTS[2]
    num_layers = tiny_target.config.num_hidden_layers
    with torch.no_grad():
        hidden_states = tiny_target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for exit_layer in range(1, num_layers + 1):
        view = EarlyExitDrafter(HFCausalLM(tiny_target), exit_layer).view
        logits = view.forward(torch.tensor(prompt)).logits
        if exit_layer == num_layers:
            expected = full_logits(tiny_target, prompt)
        else:  # transformers' hidden state after `exit_layer` layers, through the final norm and head
            with torch.no_grad():
                expected = tiny_target.lm_head(tiny_target.model.norm(hidden_states[exit_layer]))[0]
        assert torch.allclose(logits, expected, atol=1e-5), exit_layer


@pytest.mark.parametrize("skip", [(0,), (1,), (2,), (0, 2)])
def test_skipping_equals_a_model_without_those_layers(tiny_target, skip):
    reference = without_layers(tiny_target, skip)
    prompt = PROMPTS[0] + PROMPTS[1]
    view = SkippedLayers(HFCausalLM(tiny_target), skip)
    head = view.forward(torch.tensor(prompt[:-2])).logits
    tail = view.forward(torch.tensor(prompt[-2:])).logits  # over the view's own cache entries
    assert torch.allclose(torch.cat([head, tail]), full_logits(reference, prompt), atol=1e-5)


def test_view_crops_only_its_own_entries(target_lm):
    target_lm.forward(torch.tensor(PROMPTS[0]))
    view = SkippedLayers(target_lm, [1])
    view.forward(torch.tensor([1, 2]))
    with pytest.raises(ValueError):
        view.crop(target_lm.cache_length - 1)
    view.crop(target_lm.cache_length)
    assert view.cache_length == target_lm.cache_length


# --- The shared cache ---------------------------------------------------------------------------------


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("cached", ["prompt-but-last", "nothing"])
def test_draft_leaves_the_target_cache_as_it_was(tiny_target, greedy, cached):
    target = HFCausalLM(tiny_target)
    prompt = PROMPTS[1]
    if cached == "prompt-but-last":
        target.forward(torch.tensor(prompt[:-1]))
    drafter = LayerSkipDrafter(target, [1], num_tokens=6, adaptive=False, confidence_threshold=0)
    before, length = snapshot(target), target.cache_length
    params = SamplingParams() if greedy else SamplingParams(temperature=1.0)
    draft = drafter.propose(prompt, 6, params, torch.Generator().manual_seed(0))
    assert len(draft) == 6 and (draft.probs is None) == greedy
    assert target.cache_length == length and same_cache(snapshot(target), before)
    assert drafter.view.cache_length == length
    # and the target's next forward gives what it would have without the draft
    logits = target.forward(torch.tensor(prompt[length:]), num_logits=1).logits
    assert torch.allclose(logits, full_logits(tiny_target, prompt)[-1:], atol=1e-5)


# --- Through the engine ---------------------------------------------------------------------------------


def drafters(target: HFCausalLM):
    fixed = dict(adaptive=False, confidence_threshold=0)
    return {
        "all-kept": lambda: LayerSkipDrafter(target, [], num_tokens=4, **fixed),
        "skip-middle": lambda: LayerSkipDrafter(target, [1], curve=CURVE),
        "skip-two": lambda: LayerSkipDrafter(target, [0, 2], num_tokens=6, **fixed),
        "skip-all": lambda: LayerSkipDrafter(target, [0, 1, 2], num_tokens=2, **fixed),
        "no-prefill-draft": lambda: LayerSkipDrafter(target, [2], num_tokens=5, prefill_limit=1, **fixed),
        "exit-1": lambda: EarlyExitDrafter(target, 1, num_tokens=3, **fixed),
        "exit-2": lambda: EarlyExitDrafter(target, 2, curve=CURVE, draft_cost=0.2),
    }


@pytest.fixture(scope="module")
def reference(tiny_target):
    """Plain greedy continuations from transformers' own generate()."""
    return greedy_references(tiny_target, PROMPTS, max(LENGTHS))


@pytest.mark.parametrize("kind", list(drafters(None)))
def test_greedy_speculative_equals_plain(kind, tiny_target, reference):
    target = HFCausalLM(tiny_target)
    engine = SpeculativeEngine(target, drafter=drafters(target)[kind]())
    for i, n, _ in greedy_runs(engine, PROMPTS, reference, LENGTHS):
        assert target.cache_length == len(PROMPTS[i]) + n - 1  # the cache as plain decoding leaves it


@pytest.mark.parametrize("skip, least", [((), 0.95), ((1,), 0.1), ((2,), 0.1)])
def test_drafts_are_accepted(skip, least, tiny_target):
    """Skipping nothing, the draft is the target: all accepted; skipping one of three layers, some."""
    target = HFCausalLM(tiny_target)
    drafter = LayerSkipDrafter(target, skip, num_tokens=3, adaptive=False, confidence_threshold=0)
    engine = SpeculativeEngine(target, drafter=drafter)
    drafted = accepted = 0
    for prompt in PROMPTS:
        steps = engine.generate(prompt, GenerationConfig(max_new_tokens=40)).steps
        drafted += sum(s.drafted for s in steps)
        accepted += sum(s.accepted for s in steps)
    assert drafted > 100 and accepted >= least * drafted


def test_sampled_output_follows_target_distribution():
    """The first two sampled tokens follow the target's exact distribution, the first step drafting two
    tokens from the skipped-layer model (over the prompt's prefill in the target's own cache) with
    their probs, the second starting from the cache as that step's verification left it. A run of the
    real architecture costs several milliseconds, so this checks the integration with power 0.9 against a
    10% error: vocabulary of 3, 1,200 runs over 9 cells, chi-square at 1e-4, power 0.97 against any 10%
    total-variation error, 0.08 against 5% (goodness_of_fit; test_engine's fake-model "chain" case
    carries 5% for the same verification of a sampled chain with probs)."""
    vocab, runs = 3, 1200
    model = tiny_qwen2(seed=24, layers=3, hidden=32, vocab=vocab)
    with torch.no_grad():  # flatten the distributions a little so every pair has mass
        model.lm_head.weight.mul_(0.8)
    prompt = [1, 0, 2, 1, 0, 2, 2, 0, 2]
    target = HFCausalLM(model)
    drafter = LayerSkipDrafter(target, [0, 2], num_tokens=2, adaptive=False, confidence_threshold=0)
    engine = SpeculativeEngine(target, drafter=drafter)
    engine.curve = CURVE
    params = SamplingParams(temperature=1.0)
    outcomes = engine_outcomes(engine, prompt, 2, params, runs, max_new_tokens=3)
    assert outcomes.deep_drafts == runs  # the first step drafted two tokens, and the target ...
    assert 0.2 * runs < outcomes.corrections < 0.9 * runs  # ... sometimes rejected one (residual sampling)
    assert_follows(outcomes.counts, continuations(model_logits(model), prompt, 2, params), "layer skip", tv=0.1)


# --- The search -------------------------------------------------------------------------------------------


def test_chain_speedup_by_hand():
    # agreement 0: one draft, one token per step for a draft forward plus a verification over 2 tokens
    speedup, length = chain_speedup(0.0, 0.5, CURVE, 8)
    assert length == 1 and speedup == pytest.approx(1 / (0.5 + 1.05))
    # agreement 0.8, cost 0.25: k drafts yield (1 - 0.8^(k+1)) / 0.2 tokens for k / 4 + 1 + 0.05 k forwards
    rates = [(1 - 0.8 ** (k + 1)) / 0.2 / (k * 0.25 + 1 + 0.05 * k) for k in range(1, 9)]
    speedup, length = chain_speedup(0.8, 0.25, CURVE, 8)
    assert speedup == pytest.approx(max(rates)) and length == 1 + rates.index(max(rates))


@pytest.fixture(scope="module")
def four_layers():
    return HFCausalLM(tiny_qwen2(seed=5, layers=4))


def test_search_finds_the_best_of_all_skip_sets(four_layers, tmp_path):
    prompts = calibration_prompts(None, four_layers.vocab_size)
    result = search_skip(four_layers, prompts, budget_seconds=60, continuation=16, curve=CURVE, folder=tmp_path,
                         progress=False)
    score = Scorer(four_layers, CalibrationSet(four_layers, prompts, continuation=16), CURVE, max_tokens=16)
    every = [tuple(i for i in range(4) if mask >> i & 1) for mask in range(16)]
    best = max((score(skip) for skip in every), key=lambda choice: choice.speedup)
    assert result.best == best and result.evaluated == 16
    assert 0 < best.draft_cost < 1 and best.speedup > 1  # skipping pays on this model


class Clock:
    """A clock for the search to read (`time.perf_counter`): each reading a quarter of a second after the last, so
    a budget ends the search after as many trials on any machine, however busy."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.25
        return self.now


def test_search_respects_its_budget_and_caches_its_result(tmp_path, monkeypatch):
    from specdecode.drafters.self_speculative import search

    target = HFCausalLM(tiny_qwen2(seed=6, layers=8))
    prompts = calibration_prompts(None, target.vocab_size, count=2, length=8)
    options = dict(continuation=8, curve=CURVE, folder=tmp_path, progress=False)
    monkeypatch.setattr(search.time, "perf_counter", Clock())
    result = search_skip(target, prompts, budget_seconds=3.0, max_trials=10**6, **options)
    assert not result.from_cache
    assert 1 < result.evaluated <= 3.0 / 0.25 + 1  # the budget (12 readings, the baseline), not the search space
    monkeypatch.setattr(search.time, "perf_counter", Clock())
    twice = search_skip(target, prompts, budget_seconds=3.0, max_trials=10**6, use_cache=False, **options)
    assert twice.evaluated == result.evaluated and twice.best == result.best  # (the same trials, in the same order)
    skip = result.best.skip
    assert list(skip) == sorted(set(skip)) and all(0 <= i < 8 for i in skip) and len(skip) < 8
    assert len(list(tmp_path.glob("*.json"))) == 1
    # its budget stopped it after a dozen sets: a result too thin to keep for good (a busy machine's), so the next
    # starts search again, keeping the best and counting what all scored, until SEARCHES searches; then it is cached
    assert not result.settled and result.evaluated < search.SETTLED
    for searches in range(2, search.SEARCHES + 1):
        monkeypatch.setattr(search.time, "perf_counter", Clock())
        more = search_skip(target, prompts, budget_seconds=3.0, **options)
        assert not more.from_cache and more.searches == searches and more.evaluated == searches * result.evaluated
        assert more.best.speedup >= result.best.speedup
    again = search_skip(target, prompts, budget_seconds=3.0, **options)
    assert again.from_cache and again.settled and again.best == more.best and again.evaluated == more.evaluated
    fewer = search_skip(target, prompts, budget_seconds=1.0, max_trials=3, use_cache=False, **options)
    assert fewer.evaluated <= 3  # a trial cap holds too
    other = search_skip(target, prompts[:1], budget_seconds=0.5, **options)  # other prompts: another key
    assert not other.from_cache and len(list(tmp_path.glob("*.json"))) == 2


def test_exit_search_scores_every_exit_and_returns_a_suffix(four_layers, tmp_path):
    prompts = calibration_prompts(None, four_layers.vocab_size)
    result = search_exit(four_layers, prompts, budget_seconds=60, continuation=16, curve=CURVE, folder=tmp_path,
                         progress=False)
    assert result.evaluated == 4  # exits after 3, 2 and 1 layers, and no exit at all
    skip = result.best.skip
    assert skip == () or skip == tuple(range(skip[0], 4))


# --- Builders ---------------------------------------------------------------------------------------------


@pytest.fixture
def quick_builders(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(ss_drafter, "SEARCH_SECONDS", 4.0)
    monkeypatch.setattr(ss_drafter, "CONTINUATION", 8)
    return tmp_path


def test_builders_search_once_then_read_the_cache(quick_builders, monkeypatch):
    model = tiny_qwen2(seed=7, layers=2, vocab=len(TOKENS) + 10)  # byte-level tokens: room for long prompts
    target = HFCausalLM(model)
    options = DrafterOptions(tokenizer=tiny_tokenizer())  # texts and a chat turn through a real tokenizer
    assert len(calibration_prompts(options.tokenizer, target.vocab_size)) == 3
    skipper = build_layerskip(target, None, options)
    exiter = build_earlyexit(target, None, options)
    assert isinstance(skipper, LayerSkipDrafter) and isinstance(exiter, EarlyExitDrafter)
    assert exiter.skip == tuple(range(exiter.exit_layer, 2))
    assert len(list((quick_builders / "layerskip").glob("*.json"))) == 2
    def no_search(*args, **kwargs):
        raise AssertionError("searched again instead of reading the cache")

    monkeypatch.setattr(ss_search, "_skip_strategy", no_search)
    assert build_layerskip(target, None, options).skip == skipper.skip  # from the cache
    engine = SpeculativeEngine(target, drafter=skipper)
    plain = SpeculativeEngine(HFCausalLM(model))
    prompt = calibration_prompts(options.tokenizer, target.vocab_size)[0]
    config = GenerationConfig(max_new_tokens=12)
    assert engine.generate(prompt, config).token_ids == plain.generate(prompt, config).token_ids


class NotTorch(CausalLM):
    vocab_size, max_context, eos_token_ids = 10, 100, frozenset()
    cache_length = weight_bytes_per_token = 0

    def forward(self, token_ids, **kwargs):
        raise NotImplementedError

    def crop(self, length):
        pass


def test_unsupported_targets_are_user_errors(tiny_target):
    for build in (build_layerskip, build_earlyexit):
        with pytest.raises(UserError, match="torch backend"):
            build(NotTorch(), None, DrafterOptions())
    with pytest.raises(UserError, match="torch backend"):
        LayerSkipDrafter(NotTorch(), [0])
    with pytest.raises(UserError):
        LayerSkipDrafter(HFCausalLM(tiny_target), [3])  # no such layer
    with pytest.raises(UserError):
        EarlyExitDrafter(HFCausalLM(tiny_target), 0)
    sliding = tiny_qwen2(seed=0, layers=2)
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(UserError, match="full-attention"):
        ss.check_layer_skipping(sliding)
