"""The EAGLE head: shapes, storage, features from the engine, and lossless drafting with a random head."""

from __future__ import annotations

import pytest
import torch

from conftest import Dispatched, LetterTokenizer, greedy_references, greedy_runs, oracle_eagle_head, random_prompts
from conftest import random_eagle_head as random_head
from specdecode.drafters.eagle import EagleDrafter, EagleTreeDrafter
from specdecode.drafters.eagle_head import EagleHead, HeadState
from specdecode.drafters.static_heads import StaticHeadState
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.models.static import BACK, BUCKETS
from specdecode.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.4))


def test_head_shapes_and_config(tiny_target):
    head = random_head(tiny_target, vocab=40)
    d, device = tiny_target.config.hidden_size, tiny_target.device
    out = head(torch.randn(2, 5, d, device=device), torch.randn(2, 5, d, device=device),
               torch.arange(5, device=device).repeat(2, 1))
    assert out.shape == (2, 5, d)
    assert head.config.num_hidden_layers == 1 and head.config.intermediate_size == 32
    assert head.vocab_ids.shape == (40,)


def test_save_and_load_round_trip(tiny_target, tmp_path):
    head = random_head(tiny_target, vocab=50)
    head.save(tmp_path / "head", {"trained_on": "nothing"})
    device = tiny_target.device
    loaded, record = EagleHead.load(tmp_path / "head", dtype=torch.float32, device=device)
    assert record["trained_on"] == "nothing"
    assert torch.equal(loaded.vocab_ids, head.vocab_ids)
    d = tiny_target.config.hidden_size
    x, e = torch.randn(1, 4, d, device=device), torch.randn(1, 4, d, device=device)
    p = torch.arange(4, device=device)[None]
    assert torch.allclose(loaded(x, e, p), head.to(torch.bfloat16).float()(x, e, p), atol=1e-5)
    with pytest.raises(UserError, match="no EAGLE head"):
        EagleHead.load(tmp_path / "missing")


def test_the_engine_hands_over_final_hidden_states(tiny_target):
    target = HFCausalLM(tiny_target)
    ids = random_prompts(1, seed=4)[0]
    out = target.forward(torch.tensor(ids), output_hidden=True)
    assert out.hidden.shape == (len(ids), tiny_target.config.hidden_size)
    with torch.inference_mode():  # what the LM head reads: after the final norm
        assert torch.allclose(tiny_target.lm_head(out.hidden), out.logits, atol=1e-5)


def eagle_drafter(kind: str, head: EagleHead, target):
    if kind == "chain":
        return EagleDrafter(head, target, max_tokens=5, min_confidence=0.0)
    return EagleTreeDrafter(head, target, FLAT, draft_cost=0.001, top_k=2, width=2, max_depth=4)


@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("vocab", [60])  # a truncated vocabulary (the full one: equivalence/test_every_method.py)
def test_greedy_eagle_equals_plain_decoding(tiny_target, vocab, kind):
    prompts = random_prompts(4, seed=21)
    references = greedy_references(tiny_target, prompts, 24)
    drafter = eagle_drafter(kind, random_head(tiny_target, vocab), tiny_target)
    engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter, gate=False)
    drafted = 0
    for _, _, result in greedy_runs(engine, prompts, references, [1, 9, 24]):
        drafted += sum(s.drafted for s in result.steps)
    assert drafted > 0


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_a_head_that_knows_the_target_is_accepted(tiny_target, kind):
    """A head whose 'prediction' is the target's own next feature (an oracle wired in by hand) must have
    its drafts accepted: proof that features, pairs and positions line up."""
    target = HFCausalLM(tiny_target)
    prompt = random_prompts(1, seed=8)[0]
    head, reference = oracle_eagle_head(tiny_target, prompt, 20)
    engine = SpeculativeEngine(target, LetterTokenizer(), eagle_drafter(kind, head, tiny_target), gate=False)
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=20))
    assert result.token_ids == reference
    decode_steps = result.steps[1:]
    if kind == "chain":  # every draft token is the target's
        assert sum(s.accepted for s in decode_steps) == sum(s.drafted for s in decode_steps) > 0
    else:  # the tree's best path is the target's, whole (up to what is left to generate)
        assert all(s.accepted == min(s.draft_depth or 0, 4) or s.new_tokens < 5 for s in decode_steps)
        assert sum(s.accepted for s in decode_steps) > 0


def test_sampled_eagle_is_seeded(tiny_target):
    drafter = EagleDrafter(random_head(tiny_target, seed=3), tiny_target, max_tokens=4, min_confidence=0.0)
    engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter, gate=False)
    config = GenerationConfig(max_new_tokens=16, sampling=SamplingParams(temperature=0.8), seed=5)
    prompt = random_prompts(1, seed=2)[0]
    assert engine.generate(prompt, config).token_ids == engine.generate(prompt, config).token_ids


def test_training_lowers_the_losses_and_the_trained_head_drafts_losslessly(tmp_path):
    """A few hundred steps on a tiny model's own features over repetitive text: the losses fall, the
    held-out accuracy is measured per draft position, and the saved head drafts exact greedy output."""
    from conftest import TOKENS, tiny_training_features
    from specdecode.training import eagle

    model, sequences, shards = tiny_training_features(tmp_path / "features")
    settings = eagle.TrainingSettings(intermediate_size=32, vocab_size=64, seconds=60, epochs=30,
                                      learning_rate=3e-3, warmup_steps=5, sequence_tokens=64, batch_windows=2,
                                      eval_positions=3)
    head, record = eagle.train(model, shards, settings, progress=False, log=lambda *a: None)
    assert record.losses[-1]["regression"] < record.losses[0]["regression"]
    assert record.losses[-1]["classification"] < record.losses[0]["classification"]
    assert len(record.held_out_accuracy) == 3 and all(0.0 <= a <= 1.0 for a in record.held_out_accuracy)
    assert len(head.vocab_ids) <= 64 + 1 and TOKENS.index("<|im_end|>") in head.vocab_ids.tolist()
    eagle.save(head, record, tmp_path / "head", {"target": "tiny"})
    loaded, saved = EagleHead.load(tmp_path / "head", dtype=torch.float32)
    assert saved["record"]["steps"] == record.steps
    prompt = sequences[0].token_ids[:30]
    reference = greedy_references(model, [prompt], 20)[0]
    engine = SpeculativeEngine(HFCausalLM(model), LetterTokenizer(), EagleDrafter(loaded, model, min_confidence=0.0),
                               gate=False)
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=20))
    assert result.token_ids == reference


@pytest.mark.parametrize("round_seconds, deeper", [(1e-4, True), (1.0, False)])
def test_a_head_tree_prices_its_rounds_as_timed(tiny_target, round_seconds, deeper):
    """The tree grows another round only if it pays at what the head's rounds took (a fake clock), over the
    target's one-token time: a round costing 25 target steps stops the trees at the root's children once
    one has been timed; one costing almost nothing lets them grow. Exact either way. (An oracle head, so
    that drafts are accepted and worth growing.)"""
    from dataclasses import replace

    prompt = random_prompts(1, seed=8)[0]
    head, reference = oracle_eagle_head(tiny_target, prompt, 30)
    ticks = iter(range(10**6))
    drafter = EagleTreeDrafter(head, tiny_target, replace(FLAT, seconds=0.04), top_k=2, width=2, max_depth=4,
                               clock=lambda: next(ticks) * round_seconds)
    engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter, gate=False, step_aside=False)
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=30))
    assert result.token_ids == reference
    assert all(abs(drafter._round_cost(width) - round_seconds / 0.04) < 1e-9 for width in drafter._rounds)
    depths = [s.draft_depth for s in result.steps if s.drafted]
    grown = sum(depth > 1 for depth in depths)  # expensive: only until the first round has been timed
    assert (grown >= len(depths) // 2 if deeper else grown <= 1), depths


def dynamic_and_static(tiny_target, monkeypatch, kind: str, seed: int, capacity: int) -> tuple:
    """A random head of `kind` ("eagle", "eagle3") as its dynamic state and its static one over `capacity` positions,
    both float32 (the dynamic state's layers left unquantized, as the static one's always are)."""
    from conftest import random_eagle3_head
    from specdecode.drafters.eagle3 import Eagle3State, StaticEagle3State

    if kind == "eagle":
        monkeypatch.setattr(HeadState, "quantize", False)
        head = random_head(tiny_target, seed=seed)
        return HeadState(head, tiny_target), StaticHeadState(head, tiny_target, capacity=capacity)
    monkeypatch.setattr(Eagle3State, "quantize", False)
    head = random_eagle3_head(tiny_target, seed=seed)
    return Eagle3State(head, tiny_target), StaticEagle3State(head, tiny_target, capacity=capacity)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_static_heads_cache_grows_as_the_targets(tiny_target, monkeypatch, kind):
    """A head's static cache, sized as the target's was when the head was built (4,096 positions at first), doubles
    when a sequence needs more, what it holds kept, as the target's does: it raised a UserError instead, mid-answer,
    for every sequence past 4,096 tokens with eagle and eagle3 on a GPU. The outputs stay the dynamic state's, and
    the chain runner, made afresh over the new cache, drafts past the old capacity."""
    states = dynamic_and_static(tiny_target, monkeypatch, kind, seed=6, capacity=8)
    d, vocab = tiny_target.config.hidden_size, tiny_target.config.vocab_size
    generator = torch.Generator(device="cpu").manual_seed(1)
    with torch.inference_mode():
        start = 0
        for n in (5, 6, 30, 1, 40):  # past 8, 16, 32 and 64 positions
            features = torch.randn(n, d, generator=generator)
            tokens = torch.randint(0, vocab, (n,), generator=generator)
            dynamic, static = (state.run(features, tokens, torch.arange(start, start + n)) for state in states)
            assert torch.allclose(static, dynamic, atol=1e-5), (static - dynamic).abs().max()
            start += n
        assert states[1].capacity - BUCKETS[-1] == 128 and states[1].cached == start
        tokens, probs = states[1].chain(static[-1], 4, start)
        assert tokens.shape == probs.shape == (4,) and states[1].cached == start + 3


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_static_state_runs_the_head_as_the_dynamic_one(tiny_target, monkeypatch, kind):
    """`StaticHeadState.run` and `StaticEagle3State.run` (the head's layer written out over a cache of fixed capacity
    in few kernels, feeds padded to a bucket and masked on the device) give the dynamic states' outputs (the head's
    module), float32 both (the dynamic state's layers unquantized here, as the static one's always are): a prompt's
    pairs wider than every bucket (run eagerly), a few more (a bucket), a tree's rounds under their masks (the last
    one's reaching past the window: eagerly again), then the speculative entries cropped and the context's next
    pairs fed over them."""
    states = dynamic_and_static(tiny_target, monkeypatch, kind, seed=5, capacity=256)
    assert states[1].kv.dtype == torch.float32
    d, device, vocab = tiny_target.config.hidden_size, tiny_target.device, tiny_target.config.vocab_size
    generator = torch.Generator(device="cpu").manual_seed(0)

    def feed(n: int, positions: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        features = torch.randn(n, d, generator=generator).to(device)
        tokens = torch.randint(0, vocab, (n,), generator=generator)
        dynamic, static = (state.run(features, tokens, positions.to(device), mask) for state in states)
        assert static.shape == (n, d) and torch.allclose(static, dynamic, atol=1e-5), (static - dynamic).abs().max()
        assert states[0].cached == states[1].cached

    def tree_round(n: int, depth: int) -> None:
        """n nodes at one depth, each seeing the context's pairs, every other earlier node and itself."""
        fed, cached = states[0].fed, states[0].cached
        mask = torch.zeros(n, cached + n, dtype=torch.bool)
        mask[:, :fed] = True
        mask[:, fed:cached:2] = True
        mask[:, cached:] = torch.eye(n, dtype=torch.bool)
        feed(n, torch.full((n,), fed + depth), mask)

    with torch.inference_mode():
        prompt = BUCKETS[-1] + 6
        feed(prompt, torch.arange(prompt))
        feed(3, torch.arange(prompt, prompt + 3))
        for state in states:
            state.fed = prompt + 3  # the context's pairs (`sync`)
        for depth, width in enumerate([3, 2, BACK, 1]):
            tree_round(width, depth)
        for state in states:
            state.crop()
        assert states[1].cached == prompt + 3
        feed(4, torch.arange(prompt + 3, prompt + 7))


def test_the_static_eagle3_feed_runs_few_operations(tiny_target):
    """At batch one a GPU runs a head's step in about its number of kernels, whatever their size. EAGLE-3's static
    feed (one decoder layer) counts 36 computing operations in float32 (at most 40 allowed here), where the head's
    module's pieces, through which the static state ran it before, counted 68; a chain's top token from a feature, 5
    (13)."""
    from conftest import random_eagle3_head
    from specdecode.drafters.eagle3 import StaticEagle3State

    state = StaticEagle3State(random_eagle3_head(tiny_target, seed=2), tiny_target, capacity=256)
    feature = torch.randn(tiny_target.config.hidden_size)
    counts = {}
    with torch.inference_mode():
        for k in (1, 5):
            with Dispatched() as dispatched:
                state.chain_step(torch.tensor([8, 40]), feature, k)
            counts[k] = dispatched.count
    assert counts[1] <= 8 and (counts[5] - counts[1]) / 4 <= 40, counts  # a feed and a top token a depth


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_static_chain_drafts_as_the_loop_of_feeds_does(tiny_target, kind):
    """`StaticFeeds.chain` (a whole chain in one step function: one CUDA graph per length on a GPU) against the
    per-token loop it replaces in `EagleDrafter.propose` (the head's top token, fed back one feed at a time), over
    two states of the same head: the same tokens, the same probabilities, the same cache entries after it, for chains
    of several lengths with the context synced between them."""
    from conftest import random_eagle3_head
    from specdecode.drafters.eagle3 import StaticEagle3State

    if kind == "eagle":
        head = random_head(tiny_target, seed=6)
        states = [StaticHeadState(head, tiny_target, capacity=256) for _ in range(2)]
    else:
        head = random_eagle3_head(tiny_target, seed=6)
        states = [StaticEagle3State(head, tiny_target, capacity=256) for _ in range(2)]
    layers = len(head.config.aux_layers) if kind == "eagle3" else 1
    width = tiny_target.config.hidden_size * layers
    generator = torch.Generator().manual_seed(1)
    context = torch.randint(0, tiny_target.config.vocab_size, (40,), generator=generator).tolist()
    features = list(torch.randn(len(context), width, generator=generator))

    def loop(state, feature, k, end):
        tokens, probs = [], []
        for depth in range(k):
            p, index = state.probs(feature).max(dim=-1, keepdim=True)
            tokens.append(state.vocab_ids[index])
            probs.append(p)
            if depth + 1 < k:
                feature = state.run(feature[None], tokens[-1], torch.full((1,), end + depth))[-1]
        return torch.cat(tokens), torch.cat(probs)

    with torch.inference_mode():
        for length, k in ((20, 4), (23, 1), (30, 6), (31, 2)):
            outs = []
            for state, draft in zip(states, (lambda *a: a[0].chain(*a[1:]), loop)):
                state.features = features[: length - 1]
                feature = state.sync(context[:length])
                outs.append(draft(state, feature, k, length - 1))
            assert states[0].cached == states[1].cached == length - 1 + k - 1
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
            assert outs[0][0].shape == (k,)
            assert torch.equal(states[0].kv, states[1].kv)
