"""Self-speculation over a compressed cache (`sparse-kv`): the view's forward against the full model with
the same keys masked out, the target's cache untouched by a draft, greedy equivalence through the engine,
lossless sampling, and the cost model that keeps it off on short inputs. Tiny Qwen2 models in float32."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import greedy_references, greedy_runs, random_prompts, tiny_qwen2
from goodness_of_fit import assert_follows, continuations, engine_outcomes, model_logits
from specdecode.drafters.self_speculative import run_layers
from specdecode.drafters.sparse_kv import CompressedView, SparseKVDrafter, kv_bytes_per_token, under_lookup
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.methods import get_method
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = random_prompts(8, seed=11, low=10, high=30)  # longer than sinks + window below
LENGTHS = [1, 7, 40]
CURVE = CostCurve.linear(0.05)


def kept_mask(length: int, sinks: int, window: int, new: int) -> torch.Tensor:
    """[new, length + new] bool: the new tokens see the first `sinks` and the last `window` cached ones
    and, causally, each other."""
    allowed = torch.zeros(new, length + new, dtype=torch.bool)
    allowed[:, :sinks] = True
    allowed[:, max(sinks, length - window) : length] = True
    allowed[:, length:] = torch.ones(new, new, dtype=torch.bool).tril()
    return allowed


@pytest.mark.parametrize("sinks, window", [(0, 3), (2, 5), (4, 100)])
def test_view_equals_the_full_model_with_the_other_keys_masked(tiny_target, sinks, window):
    target = HFCausalLM(tiny_target)
    prompt, new = PROMPTS[0], [5, 9, 2]
    target.forward(torch.tensor(prompt))
    full_cache = copy.deepcopy(target._cache)
    view = CompressedView(target, sinks, window)
    view.refresh()
    got = view.forward(torch.tensor(new)).logits  # [3, vocab]
    length = len(prompt)
    with torch.inference_mode():
        hidden = run_layers(tiny_target, range(3), torch.tensor(new), torch.arange(length, length + 3),
                            kept_mask(length, sinks, window, 3), full_cache)
        expected = tiny_target.lm_head(hidden).float()
    assert torch.allclose(got, expected, atol=1e-5)
    if sinks + window >= length:  # nothing dropped: the target's own next-token logits
        assert torch.allclose(got, target.forward(torch.tensor(new)).logits, atol=1e-5)
    assert view.cache_length == length + 3
    view.crop(length + 1)
    assert view.cache_length == length + 1
    with pytest.raises(ValueError):
        view.crop(length - 1)  # never into the target's part


@pytest.mark.parametrize("greedy", [True, False])
def test_draft_leaves_the_target_cache_as_it_was(tiny_target, greedy):
    target = HFCausalLM(tiny_target)
    prompt = PROMPTS[1]
    target.forward(torch.tensor(prompt[:-1]))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in target._cache.layers]
    drafter = SparseKVDrafter(target, sinks=2, window=4, num_tokens=5, adaptive=False, confidence_threshold=0)
    params = SamplingParams() if greedy else SamplingParams(temperature=1.0)
    draft = drafter.propose(prompt, 5, params, torch.Generator().manual_seed(0))
    assert len(draft) == 5 and (draft.probs is None) == greedy
    after = [(layer.keys, layer.values) for layer in target._cache.layers]
    assert target.cache_length == len(prompt) - 1
    assert all(torch.equal(k0, k1) and torch.equal(v0, v1) for (k0, v0), (k1, v1) in zip(before, after))


@pytest.fixture(scope="module")
def reference(tiny_target):
    return greedy_references(tiny_target, PROMPTS, max(LENGTHS))


@pytest.mark.parametrize("sinks, window, tokens", [(2, 4, 4), (0, 1, 3), (4, 100, 6)])
def test_greedy_speculative_equals_plain(tiny_target, reference, sinks, window, tokens):
    target = HFCausalLM(tiny_target)
    drafter = SparseKVDrafter(target, sinks=sinks, window=window, num_tokens=tokens, adaptive=False,
                              confidence_threshold=0)
    engine = SpeculativeEngine(target, drafter=drafter)
    drafted = accepted = 0
    for _, _, result in greedy_runs(engine, PROMPTS, reference, LENGTHS):
        drafted += sum(step.drafted for step in result.steps)
        accepted += sum(step.accepted for step in result.steps)
    assert drafted > 100
    if sinks + window >= max(map(len, PROMPTS)) + max(LENGTHS):  # the whole cache: the draft is the target
        assert accepted == drafted
    else:
        assert 0 < accepted < drafted


def test_under_lookup_both_tiers_draft_and_greedy_equals_plain(tiny_target, reference):
    """`sparse-kv-pld`: prompt lookup where it finds a copy, the compressed cache where it does not; each tier
    drafts on some steps, and the output is plain decoding's."""
    target = HFCausalLM(tiny_target)
    drafter = under_lookup(target, curve=CURVE, sinks=2, window=4, num_tokens=4, adaptive=False,
                           confidence_threshold=0)
    lookup, sparse = (source.drafter for source in drafter.sources)
    drafts = {lookup: 0, sparse: 0}
    for tier in drafts:
        def counted(*args, tier=tier, propose=tier.propose, **kwargs):
            draft = propose(*args, **kwargs)
            drafts[tier] += len(draft) > 0
            return draft
        tier.propose = counted
    engine = SpeculativeEngine(target, drafter=drafter)
    engine.curve = CURVE
    list(greedy_runs(engine, PROMPTS, reference, LENGTHS))  # each run checked against plain decoding
    assert drafts[lookup] > 0 and drafts[sparse] > 0
    assert get_method("sparse-kv-pld").lossless


def test_sampled_output_follows_target_distribution():
    """The first two sampled tokens follow the target's exact distribution when the second step drafts
    two tokens over a compressed cache that lacks most of the prompt (see test_self_speculative's
    version of this test for the test's power). A tiny random model barely reads what the view leaves out, so its
    drafts are rarely turned down (about 1.5% of the runs): this checks the sparse view's sampled drafts and their
    distributions, while a rejection's residual is held to 0.05 by the fake-model chain cases
    (`statistical/test_engine_sampling.py`), which verify the same way."""
    vocab, runs = 3, 1200
    model = tiny_qwen2(seed=24, layers=3, hidden=32, vocab=vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.8)
    prompt = [1, 0, 2, 1, 0, 2, 2, 0, 2]
    target = HFCausalLM(model)
    drafter = SparseKVDrafter(target, sinks=1, window=2, num_tokens=2, adaptive=False, confidence_threshold=0)
    engine = SpeculativeEngine(target, drafter=drafter)
    engine.curve = CURVE
    params = SamplingParams(temperature=1.0)
    outcomes = engine_outcomes(engine, prompt, 2, params, runs, max_new_tokens=4)
    assert outcomes.deep_drafts == runs and outcomes.corrections > 0  # it drafted every run, and was turned down
    assert_follows(outcomes.counts, continuations(model_logits(model), prompt, 2, params), "sparse-kv", tv=0.1)


def test_cost_follows_the_bytes_read_and_keeps_short_inputs_plain(tiny_target):
    target = HFCausalLM(tiny_target)
    view = CompressedView(target, sinks=4, window=16)
    assert view.relative_cost(10) == view.relative_cost(20) == 1.0  # the whole cache: a full forward
    weights, per_token = target.weight_bytes_per_token, kv_bytes_per_token(target)
    assert view.relative_cost(1000) == pytest.approx((weights + 20 * per_token) / (weights + 1000 * per_token))
    assert view.relative_cost(1000) < view.relative_cost(100) < 1.0
    # adaptive, on short prompts it does not draft at all: a draft forward would cost a full one
    engine = SpeculativeEngine(target, drafter=get_method("sparse-kv").drafter(target, None))
    result = engine.generate(PROMPTS[2], GenerationConfig(max_new_tokens=12))
    assert sum(step.drafted for step in result.steps) == 0


def test_bad_settings_are_user_errors(tiny_target):
    with pytest.raises(UserError, match="window"):
        CompressedView(HFCausalLM(tiny_target), sinks=2, window=0)
