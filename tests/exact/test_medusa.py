"""Medusa heads: shapes, storage, the best-first tree, lossless drafting with random heads, an oracle
that proves the features line up, typical acceptance (lossy), and training."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from conftest import LetterTokenizer, greedy_references, greedy_runs, random_medusa_heads, random_prompts
from specdecode.drafters.medusa import MedusaDrafter, MedusaHeads, best_first
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.methods import METHODS, resolve
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.types import Draft, SamplingParams
from specdecode.verify.tree import verify
from specdecode.verify.typical import typical_thresholds, verify_typical

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.4))


def test_fresh_heads_start_as_the_target_next_token_prediction(tiny_target):
    heads = MedusaHeads(tiny_target.config.hidden_size, 4, torch.arange(tiny_target.config.vocab_size))
    features = torch.randn(5, tiny_target.config.hidden_size)
    out = heads(features)
    assert out.shape == (5, 4, tiny_target.config.hidden_size)
    assert torch.equal(out, features[:, None].expand(-1, 4, -1))  # zero blocks: identity
    with pytest.raises(UserError, match="at least one head"):
        MedusaHeads(8, 0, torch.arange(4))


def test_save_and_load_round_trip(tiny_target, tmp_path):
    heads = random_medusa_heads(tiny_target, num_heads=2, vocab=50)
    heads.save(tmp_path / "heads", {"trained_on": "nothing"})
    loaded, record = MedusaHeads.load(tmp_path / "heads", dtype=torch.float32, device=tiny_target.device)
    assert record["trained_on"] == "nothing" and loaded.num_heads == 2
    assert torch.equal(loaded.vocab_ids, heads.vocab_ids)
    x = torch.randn(3, tiny_target.config.hidden_size, device=tiny_target.device)
    assert torch.allclose(loaded(x), heads.to(torch.bfloat16).float()(x), atol=1e-5)
    with pytest.raises(UserError, match="no Medusa head"):
        MedusaHeads.load(tmp_path / "missing")


def test_best_first_is_the_top_products_closed_under_ancestors():
    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(3, 7) * 2, dim=-1)
    top_k, n = 4, 20
    ids, parents, scores = best_first(probs, top_k, n)
    assert len(ids) == n and scores == sorted(scores, reverse=True)
    assert all(p < i for i, p in enumerate(parents))  # parents first: every prefix is a valid tree
    # brute force: every path through the heads' top-k, scored by the product of its probabilities
    p, index = probs.topk(top_k, dim=-1)
    paths = [ranks for depth in range(1, 4) for ranks in itertools.product(range(top_k), repeat=depth)]
    products = sorted((math.prod(float(p[d, r]) for d, r in enumerate(ranks)) for ranks in paths), reverse=True)
    assert scores == pytest.approx(products[:n], rel=1e-6)
    for node, parent in enumerate(parents):  # each node's token is its head's choice, its score its path's product
        depth, up = 0, parent
        while up >= 0:
            depth, up = depth + 1, parents[up]
        assert ids[node] in index[depth].tolist()
        expected = float(probs[depth, ids[node]]) * (scores[parent] if parent >= 0 else 1.0)
        assert scores[node] == pytest.approx(expected, rel=1e-6)


def medusa_drafter(kind: str, heads: MedusaHeads, target, **options) -> MedusaDrafter:
    if kind == "chain":
        return MedusaDrafter(heads, target, **options)
    return MedusaDrafter(heads, target, FLAT, tree=True, top_k=3, max_nodes=12, draft_cost=0.001, **options)


@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("vocabulary", ["truncated", "full-lm-head"])  # "full": equivalence/test_every_method.py
def test_greedy_medusa_equals_plain_decoding(tiny_target, vocabulary, kind):
    prompts = random_prompts(4, seed=31)
    references = greedy_references(tiny_target, prompts, 24)
    heads = random_medusa_heads(tiny_target, vocab=None if vocabulary == "full" else 60, scale=0.5)
    drafter = medusa_drafter(kind, heads, tiny_target, full_vocabulary=vocabulary == "full-lm-head")
    engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter, gate=False)
    drafted = 0
    for _, _, result in greedy_runs(engine, prompts, references, [1, 9, 24]):
        drafted += sum(s.drafted for s in result.steps)
    assert drafted > 0  # (whether any is accepted is the oracle test's business)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_heads_that_know_the_future_are_accepted(tiny_target, kind):
    """Heads whose head k returns the target's own feature k positions on (an oracle wired in by hand,
    looking the feature up in the sequence) must have whole drafts accepted: proof that the drafter
    reads the feature of the right position after every step."""
    prompt = random_prompts(1, seed=8)[0]
    reference = greedy_references(tiny_target, [prompt], 20)[0]
    full = prompt + reference  # (the oracle looks features up in it: exact match only in float32)
    with torch.inference_mode():
        truth = tiny_target.model(input_ids=torch.tensor([full], device=tiny_target.device)).last_hidden_state[0]

    class Oracle(MedusaHeads):
        def forward(self, features):
            at = int((truth - features).abs().sum(-1).argmin())
            # (scaled: the same argmax, but confident, so the tree's best path is the whole guess)
            return 30 * torch.stack([truth[min(at + k, len(full) - 1)] for k in range(1, self.num_heads + 1)])

    heads = Oracle(tiny_target.config.hidden_size, 3, torch.arange(tiny_target.config.vocab_size)).eval()
    engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), medusa_drafter(kind, heads, tiny_target),
                               gate=False)
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=20))
    assert result.token_ids == reference
    decode_steps = [s for s in result.steps[1:] if s.new_tokens == 4]  # not cut short by the end
    assert decode_steps and all(s.accepted == 3 for s in decode_steps)


def test_a_tree_follows_the_budget_and_the_curve(tiny_target):
    heads = random_medusa_heads(tiny_target, vocab=None, scale=0.5)
    fixed = MedusaDrafter(heads, tiny_target, tree=True, budget=5)
    steep = MedusaDrafter(heads, tiny_target, CostCurve.linear(1.0), tree=True)  # each node costs a forward
    for drafter in (fixed, steep):
        drafter._feature, drafter._valid_for = torch.randn(tiny_target.config.hidden_size).to(tiny_target.device), 7
    draft = fixed.propose(list(range(7)), 10, SamplingParams(), None)
    assert len(draft) == 5 and draft.is_tree
    assert len(steep.propose(list(range(7)), 10, SamplingParams(), None)) == 0  # nothing pays
    assert len(fixed.propose(list(range(6)), 10, SamplingParams(), None)) == 0  # a stale feature drafts nothing


def test_a_tree_prices_the_heads_as_timed(tiny_target):
    """The heads' call is timed (a fake clock) and priced over the target's one-token time (free before the
    first timing): the call is spent whatever the tree, so the dearer it was, the more nodes a verification
    must carry to pay for the step."""
    from dataclasses import replace

    heads = random_medusa_heads(tiny_target, vocab=None, scale=0.5)
    feature = torch.randn(tiny_target.config.hidden_size, generator=torch.Generator().manual_seed(5))
    sizes = {}
    for call_seconds in (1e-4, 0.5):
        ticks = iter(range(10**6))
        # (the clock is called only within this iteration: its `ticks` and `call_seconds` are this one's)
        drafter = MedusaDrafter(heads, tiny_target, replace(FLAT, seconds=0.1), tree=True, max_nodes=64,
                                clock=lambda: next(ticks) * call_seconds)  # noqa: B023
        assert drafter.price() == 0.0  # not timed yet
        for _ in range(2):
            drafter._feature, drafter._valid_for = feature.to(tiny_target.device), 7
            draft = drafter.propose(list(range(7)), 10, SamplingParams(), None)
            sizes.setdefault(call_seconds, []).append(len(draft))
            assert drafter.price() == pytest.approx(call_seconds / 0.1)
    cheap, dear = sizes[1e-4], sizes[0.5]  # each step's call timed before its tree is sized
    assert cheap[0] == cheap[1] > 0 and dear[0] == dear[1], sizes
    assert dear[0] > cheap[0], sizes  # five target forwards spent: more nodes pay
    with pytest.raises(UserError, match="at least 0"):
        MedusaDrafter(heads, tiny_target, FLAT, tree=True, draft_cost=-1.0)


def test_typical_thresholds_follow_the_entropy():
    certain = torch.tensor([[0.97, 0.01, 0.01, 0.01]])
    uniform = torch.full((1, 4), 0.25)
    t_certain, t_uniform = typical_thresholds(certain), typical_thresholds(uniform)
    assert float(t_certain) == pytest.approx(0.09)  # min(epsilon, delta * e^-H) = epsilon when H is small
    assert float(t_uniform) == pytest.approx(0.3 * math.exp(-math.log(4)))  # 0.075


def test_typical_acceptance_keeps_plausible_tokens_and_the_deepest_path():
    # vocab 4; a tree: node 0 (token 1) and node 1 (token 2) follow the context, node 2 (token 3) follows node 1
    parents = torch.tensor([-1, -1, 1])
    draft = Draft(tokens=torch.tensor([1, 2, 3]), parents=parents)
    rows = torch.tensor([[0.5, 0.3, 0.2, 0.0],  # after the context: token 1 and token 2 are both plausible
                         [1.0, 0.0, 0.0, 0.0],  # after node 0
                         [0.0, 0.0, 0.0, 1.0],  # after node 1: token 3 certain
                         [0.0, 1.0, 0.0, 0.0]])  # after node 2
    logits = torch.log(rows.clamp_min(1e-12))
    verdict = verify_typical(logits, draft, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert verdict.path == (1, 2) and verdict.tokens == (2, 3, 1) and verdict.bonus  # deeper than node 0's path
    # a token the target gives 0.01 is not typical where the target is sure: nothing accepted
    rows[0] = torch.tensor([0.97, 0.01, 0.01, 0.01])
    verdict = verify_typical(torch.log(rows), draft, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert verdict.num_accepted == 0 and verdict.path == () and len(verdict.tokens) == 1  # a correction, sampled
    # greedy: exact matching, the same verdict as lossless verification
    chain = Draft(tokens=torch.tensor([0, 3]))
    greedy = SamplingParams()
    assert verify_typical(torch.log(rows), chain, greedy, None) == verify(torch.log(rows), chain, greedy, None)


def test_typical_acceptance_is_registered_as_lossy_and_medusa_as_lossless():
    assert not METHODS["medusa-typical"].lossless and METHODS["medusa"].lossless
    assert METHODS["medusa-typical"].verifier is verify_typical
    method, options = resolve("medusa-tree")
    assert method.name == "medusa" and options.tree


def test_training_lowers_the_losses_and_the_trained_heads_draft_losslessly(tmp_path):
    """Training on a tiny model's own features over repetitive text: every head's loss falls, held-out
    accuracy is measured per head (truncated and full vocabulary), and the saved heads draft exactly."""
    from conftest import tiny_training_features
    from specdecode.training import medusa

    model, sequences, shards = tiny_training_features(tmp_path / "features")
    settings = medusa.TrainingSettings(num_heads=3, vocab_size=64, seconds=60, epochs=30, learning_rate=1e-2,
                                       warmup_steps=5, sequence_tokens=64, batch_windows=2)
    heads, record = medusa.train(model, shards, settings, progress=False, log=lambda *a: None)
    for k in (1, 2, 3):
        assert record.losses[-1][f"head{k}"] < record.losses[0][f"head{k}"]
    assert len(record.held_out_accuracy) == 3 and all(0.0 <= a <= 1.0 for a in record.held_out_accuracy)
    assert len(record.notes["held_out_accuracy_full_vocabulary"]) == 3
    medusa.save(heads, record, tmp_path / "heads", {"target": "tiny"})
    loaded, saved = MedusaHeads.load(tmp_path / "heads", dtype=torch.float32)
    assert saved["record"]["steps"] == record.steps
    prompt = sequences[0].token_ids[:30]
    reference = greedy_references(model, [prompt], 20)[0]
    engine = SpeculativeEngine(HFCausalLM(model), LetterTokenizer(), MedusaDrafter(loaded, model), gate=False)
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=20))
    assert result.token_ids == reference
