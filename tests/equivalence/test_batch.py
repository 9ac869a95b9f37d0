"""The batch engine: several sequences per target forward, each its own accepted length, joining and
leaving at any step; every output as the single-sequence engine's."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    DRAFT_PRICES, FLAT, VOCAB, LetterTokenizer, auto_prototype, greedy_references, random_medusa_heads, tiny_qwen2,
    watching_head, wrong_device_trap,
)
from fakes import DRAFT, PROMPT, TARGET, FakeLM, IndependentTreeDrafter
from goodness_of_fit import Outcomes, assert_follows, continuations, model_logits
from specdecode.drafters.base import Drafter, Memory
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.jacobi import JacobiDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupTreeDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine import batch as batch_module
from specdecode.engine.batch import BatchEngine
from specdecode.errors import UserError
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.models.static import StaticCausalLM
from specdecode.tree.budget import Interpolated, cut_batch, cut_chain
from specdecode.types import Draft, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")



def repetitive_prompts(count: int, seed: int = 3) -> list[list[int]]:
    """Prompts that repeat a random stretch, so prompt lookup finds something to copy."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        stretch = torch.randint(0, VOCAB, (int(torch.randint(3, 8, (), generator=g)),), generator=g).tolist()
        prompts.append((stretch * (2 + i % 3))[: 6 + 3 * i])
    return prompts


def drafter(kind: str):
    return {"ar": None, "pld": PromptLookupDrafter(num_tokens=6),
            "pld-tree": PromptLookupTreeDrafter(FLAT, budget=6)}[kind]


def run_all(engine: BatchEngine, jobs: list[tuple[int, list[int], GenerationConfig, str]]) -> dict[int, object]:
    """Add each job at its step (job: (step to join at, prompt, config, drafter kind)); step until all end.
    Returns results by job index, checking that the events add up to each result."""
    results, events, ids = {}, {}, {}
    step = 0
    while len(results) < len(jobs):
        for index, (join, prompt, config, kind) in enumerate(jobs):
            if join == step:
                ids[engine.add(prompt, config, drafter(kind), kind)] = index
        for ident, event, result in engine.step():
            events.setdefault(ids[ident], []).append(event)
            if result is not None:
                results[ids[ident]] = result
        step += 1
        assert step < 500
    for index, result in results.items():
        assert [t for e in events[index] for t in e.token_ids] == result.token_ids
        assert "".join(e.text for e in events[index]) == result.text
    return results


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("garbage_share", [0.0, 0.25, 10.0])  # compact every step, by default, never
def test_greedy_batch_equals_plain_decoding(tiny_target, monkeypatch, garbage_share, static):
    """Several sequences, joining at different steps, chains and trees, the cache compacted at every step, by
    default or never; on the dynamic path and on the static one (a GPU's: masks over other sequences' slots run
    its step at their own width, a lone sequence its buckets)."""
    monkeypatch.setattr(batch_module, "GARBAGE_SHARE", garbage_share)
    prompts = repetitive_prompts(6)
    references = greedy_references(tiny_target, prompts, 30)
    target = StaticCausalLM(tiny_target, capacity=256) if static else HFCausalLM(tiny_target)
    engine = BatchEngine(target, LetterTokenizer())
    engine.curve = FLAT  # speculation pays: the gate lets drafts through
    kinds = ["pld", "ar", "pld-tree", "pld", "pld", "ar"]
    lengths = [30, 12, 25, 1, 30, 20]
    jobs = [(join, p, GenerationConfig(max_new_tokens=n), kind)
            for join, p, n, kind in zip([0, 0, 0, 3, 5, 5], prompts, lengths, kinds)]
    results = run_all(engine, jobs)
    for index, result in results.items():
        assert result.token_ids == references[index][: lengths[index]], f"sequence {index} ({kinds[index]})"
        assert result.method == kinds[index]
    assert sum(s.accepted for i in (0, 2, 4) for s in results[i].steps) > 0  # prompt lookup did draft
    assert len(engine) == 0 and target.cache_length == 0  # everyone left: the cache is free


class Recorded(HFCausalLM):
    """Records what every forward was given: the tokens, whether positions came with them, and the columns of
    its mask over the cache (None: no mask, causal attention; 0: a tree's mask over the fed tokens alone)."""

    def __init__(self, model):
        super().__init__(model)
        self.calls: list[tuple[list[int], bool, int | None]] = []

    def forward(self, token_ids, *, positions=None, tree_mask=None, **kwargs):
        over_cache = None if tree_mask is None else tree_mask.shape[1] - tree_mask.shape[0]
        self.calls.append((token_ids.tolist(), positions is not None, over_cache))
        return super().forward(token_ids, positions=positions, tree_mask=tree_mask, **kwargs)


@pytest.mark.parametrize("kind", ["ar", "pld", "pld-tree"])
def test_a_lone_sequence_runs_the_single_engines_forwards(tiny_target, kind):
    """A batch of one (a lone request on the server) feeds the target what `SpeculativeEngine` feeds it, forward for
    forward: the same tokens, chains with no mask (plain causal attention), no garbage left in the cache; and a
    sequence left alone by the others goes back to that once they leave."""
    prompt, config = repetitive_prompts(3)[2], GenerationConfig(max_new_tokens=24)
    single = Recorded(tiny_target)
    expected = SpeculativeEngine(single, LetterTokenizer(), drafter(kind), gate=False).generate(prompt, config)
    alone = Recorded(tiny_target)
    results = run_all(BatchEngine(alone, LetterTokenizer(), gate=False), [(0, prompt, config, kind)])
    assert results[0].token_ids == expected.token_ids
    assert alone.calls == single.calls
    if kind != "ar":
        assert any(len(tokens) > 1 for tokens, _, _ in alone.calls[1:])  # it did draft
    assert all(mask is None for _, _, mask in single.calls) == (kind != "pld-tree")
    # two sequences share forwards (masked over the cache); once the short one ends, the other's are not
    shared = Recorded(tiny_target)
    run_all(BatchEngine(shared, LetterTokenizer(), gate=False),
            [(0, prompt, config, kind), (0, repetitive_prompts(2)[0], GenerationConfig(max_new_tokens=3), "ar")])
    assert shared.calls[1][2] and not shared.calls[-1][2]


def test_no_tensor_of_the_batch_lands_on_the_wrong_device(tiny_target):
    """The batch engine, greedy and sampled, chains and trees, with every tensor it and its drafters create
    without naming a device sent to `meta` (`conftest.wrong_device_trap`); greedy output stays plain decoding's."""
    prompts = repetitive_prompts(3)
    references = greedy_references(tiny_target, prompts, 12)
    engine = BatchEngine(HFCausalLM(tiny_target), LetterTokenizer())
    engine.curve = FLAT
    sampled = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=0.9), seed=2)
    jobs = [(0, prompts[0], GenerationConfig(max_new_tokens=12), "pld"), (0, prompts[1], sampled, "pld-tree"),
            (1, prompts[2], GenerationConfig(max_new_tokens=12), "pld-tree")]
    with wrong_device_trap():
        results = run_all(engine, jobs)
    assert results[0].token_ids == references[0] and results[2].token_ids == references[2]


def test_sampled_batch_equals_single_sequence_sampling(tiny_target):
    """Seeded sampling with the gate off: a batched sequence draws exactly what the single-sequence
    engine draws (same drafts, same generator), so it inherits that engine's proven distribution."""
    prompts = repetitive_prompts(4, seed=5)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    configs = [GenerationConfig(max_new_tokens=24, sampling=params, seed=100 + i) for i in range(4)]
    single = [SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter("pld"), gate=False)
              .generate(p, c).token_ids for p, c in zip(prompts, configs)]
    engine = BatchEngine(HFCausalLM(tiny_target), LetterTokenizer(), gate=False)
    results = run_all(engine, [(i, p, c, "pld") for i, (p, c) in enumerate(zip(prompts, configs))])
    assert [results[i].token_ids for i in range(4)] == single


def test_sampled_batch_follows_target_distribution():
    """Sampling in the batch engine, with token trees and top-k: 5,700 sequences of one prompt join two
    at a time (their prefills share forwards with the others' steps), each with its own drafter in turn:
    a tree sampled i.i.d. with its probs, a prompt-lookup trie, a prompt-lookup chain, none. The first
    three tokens of each follow the target's exact distribution, with depth-2 drafts, bonus tokens after
    them and corrections all exercised. Fake models of 4 tokens (fakes.py), top-k 3: 27 cells, chi-square
    at 1e-4, power 0.91 against any 5% total-variation error (goodness_of_fit)."""
    params, runs = SamplingParams(temperature=0.9, top_k=3), 5700
    kinds = [lambda: IndependentTreeDrafter(DRAFT, widths=(2, 2)),
             lambda: PromptLookupTreeDrafter(FLAT, max_ngram=1, num_tokens=2),
             lambda: PromptLookupDrafter(max_ngram=1, num_tokens=2), lambda: None]
    engine = BatchEngine(FakeLM(TARGET))
    engine.curve = FLAT
    outcomes, events, added = Outcomes(vocab=TARGET.vocab, length=3), {}, 0
    while outcomes.runs < runs:
        for _ in range(min(2, runs - added)):
            config = GenerationConfig(max_new_tokens=3, sampling=params, seed=added)
            events[engine.add(PROMPT, config, kinds[added % len(kinds)](), method=str(added % len(kinds)))] = []
            added += 1
        for ident, event, result in engine.step():
            events[ident].append(event)
            if result is not None:
                outcomes.add(result.token_ids, events.pop(ident))
    outcomes.assert_exercised()
    assert_follows(outcomes.counts, continuations(TARGET, PROMPT, 3, params), "batch")


def test_removed_sequence_leaves_the_others_intact(tiny_target):
    prompts = repetitive_prompts(3, seed=9)
    references = greedy_references(tiny_target, prompts, 20)
    target = HFCausalLM(tiny_target)
    engine = BatchEngine(target, LetterTokenizer())
    engine.curve = FLAT
    ids = [engine.add(p, GenerationConfig(max_new_tokens=20), drafter("pld")) for p in prompts]
    outputs = {i: [] for i in ids}
    for step in range(40):
        if step == 2:
            engine.remove(ids[1])  # its client went away
        for ident, event, _ in engine.step():
            outputs[ident] += event.token_ids
    assert outputs[ids[0]] == references[0] and outputs[ids[2]] == references[2]
    assert target.cache_length == 0


class Faulty(PromptLookupDrafter):
    """Prompt lookup whose `after`-th draft raises a fault (no UserError): a bug, or a request no check foresaw."""

    def __init__(self, after: int):
        super().__init__(num_tokens=6)
        self.after = after

    def propose(self, *args, **kwargs):
        self.after -= 1
        if self.after < 0:
            raise RuntimeError("a fault of this sequence's own")
        return super().propose(*args, **kwargs)


def test_a_sequences_fault_ends_it_alone(tiny_target):
    """A fault in one sequence's drafting (or verification) ends that sequence, in `failures`, and the others go on
    to plain decoding's answers: one request of a served batch cannot fail the others'. (A penalty of 1e-300
    overflowed a row to NaN and failed every request beside it; now refused, and isolated were it not.)"""
    prompts = repetitive_prompts(3, seed=5)
    references = greedy_references(tiny_target, prompts, 20)
    target = HFCausalLM(tiny_target)
    engine = BatchEngine(target, LetterTokenizer())
    engine.curve = FLAT
    ids = [engine.add(p, GenerationConfig(max_new_tokens=20), Faulty(3) if i == 1 else drafter("pld"))
           for i, p in enumerate(prompts)]
    outputs, failed = {i: [] for i in ids}, []
    while engine.members:
        for ident, event, _ in engine.step():
            outputs[ident] += event.token_ids
        failed += engine.failures
    assert [(ident, str(error)) for ident, error in failed] == [(ids[1], "a fault of this sequence's own")]
    assert outputs[ids[0]] == references[0] and outputs[ids[2]] == references[2]
    assert target.cache_length == 0


def test_bad_input(tiny_target):
    from specdecode.drafters.draft_model import DraftModelDrafter

    engine = BatchEngine(HFCausalLM(tiny_target))
    with pytest.raises(UserError, match="empty"):
        engine.add([], GenerationConfig())
    with pytest.raises(UserError, match="cannot join a batch"):
        engine.add([1, 2], GenerationConfig(), DraftModelDrafter(HFCausalLM(tiny_qwen2(1)), **DRAFT_PRICES))
    with pytest.raises(UserError, match="does not score prompts"):  # (was accepted, and no prompt scored)
        engine.add([1, 2], GenerationConfig(echo=True, logprobs=1))
    assert engine.step() == []


def scored(tokens: int, score: float) -> Draft:
    """A chain whose j-th token is accepted with probability score ** (j + 1)."""
    return Draft(tokens=torch.arange(tokens), scores=score ** torch.arange(1, tokens + 1, dtype=torch.float32))


def test_a_sequences_slots_grow_and_read_as_a_list_would():
    """`Slots` keeps a sequence's cache slots in a growing tensor (the mask reads them every step): past its first
    capacity, from ranges and lists alike, it holds what a list extended the same way holds."""
    from specdecode.engine.slots import Slots

    slots, reference = Slots(), []
    for step in range(40):
        more = list(range(3 * step, 3 * step + step % 5)) if step % 2 else range(200 + step, 203 + step)
        slots.extend(more)
        reference += list(more)
        assert len(slots) == len(reference) and slots.tensor.tolist() == reference
    assert Slots(torch.tensor(reference[:5])).tensor.tolist() == reference[:5]


def test_the_batch_gate_shares_the_forward():
    # cheap up to a few tokens, then linear (compute-bound)
    steep = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.3, 2.0, 3.5, 7.0, 14.0, 28.0))
    # one sequence with a good draft: a few tokens pay
    assert 0 < len(cut_batch([scored(8, 0.95)], steep, pending=1)[0]) < 8
    # eight sequences: each forward already carries eight tokens, and drafting is off
    assert [len(d) for d in cut_batch([scored(8, 0.6)] * 8, steep, pending=8)] == [0] * 8
    # on a flat curve every sequence drafts, the better-scored ones more
    cut = cut_batch([scored(8, 0.9), scored(8, 0.3)], FLAT, pending=2)
    assert len(cut[0]) >= len(cut[1]) and len(cut[0]) > 0
    # unscored drafts go whole, their tokens counted in the forward's cost
    tree = Draft(tokens=torch.arange(3), parents=torch.tensor([-1, 0, 0]))
    assert cut_batch([tree, scored(4, 0.9)], FLAT, pending=2)[0] is tree


@pytest.mark.parametrize("scores", [(0.2, 0.95, 0.1), (0.9, 0.9, 0.1)], ids=["child-above-parent", "tied"])
def test_the_batch_gate_keeps_every_kept_nodes_parent(scores):
    """Whatever a drafter's scores say (a child above its parent, a parent and child tied), the cut keeps a tree
    closed under ancestors, at every batch size: a child kept without its parent made the step's tree selection
    refuse, and the step failed every sequence in the batch."""
    steep = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.3, 2.0, 3.5, 7.0, 14.0, 28.0))
    tree = Draft(tokens=torch.arange(3), parents=torch.tensor([-1, 0, -1]), scores=torch.tensor(scores))
    for others in range(1, 8):
        kept = cut_batch([tree] + [scored(2, 0.3)] * others, steep, pending=1 + others)[0]
        tokens = kept.tokens.tolist()
        assert 1 not in tokens or 0 in tokens, (others, tokens)
        if kept.parents is not None:
            assert all(parent < index for index, parent in enumerate(kept.parents.tolist())), (others, tokens)


def test_prompt_tokens_fed_beside_the_decoding_do_not_make_drafts_look_cheap():
    """A step that also feeds prompt tokens (a long prompt's chunk, a short prompt whole) prices the drafts as the
    decoding sequences' own forward plus what the drafts add: counted in the whole forward, the prompt's tokens
    made the step so dear per token that poorly scored drafts seemed to pay and widened the step for everyone."""
    steep = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.3, 2.0, 3.5, 7.0, 14.0, 28.0))  # compute-bound
    poor = [scored(3, 0.4)] * 4  # four decoding sequences, beside 40 prompt tokens of a fifth
    assert sum(len(d) for d in cut_batch(poor, steep, pending=44)) > 0  # the prompt counted as decoding's cost
    assert sum(len(d) for d in cut_batch(poor, steep, pending=44, feeding=40)) == 0
    assert sum(len(d) for d in cut_batch(poor, steep, pending=4)) == 0  # as without the prompt
    # a draft that pays alone still pays beside a prompt, as far as it pays alone
    good = [scored(4, 0.99)] + [scored(3, 0.4)] * 3
    alone, beside = cut_batch(good, steep, pending=4), cut_batch(good, steep, pending=44, feeding=40)
    assert [len(d) for d in beside] == [len(d) for d in alone] and len(beside[0]) > 0
    # nothing fed beside: the cut is the plain one
    assert [len(d) for d in cut_batch(good, steep, pending=4, feeding=0)] == [len(d) for d in alone]
    # beside a chunk as wide as the curve or wider, the same: the cap bounds the decoding, not the prompt's tokens
    wide = cut_batch(good, steep, pending=4 + 200, feeding=200)
    assert [len(d) for d in wide] == [len(d) for d in alone]
    # a lone sequence's first step, its prompt fed with its chain (`cut_chain`): the prompt is not the chain's cost
    linear = CostCurve.linear(0.5, sizes=tuple(range(1, 65)))
    assert len(cut_chain(scored(8, 0.5), linear, pending=40)) == len(cut_chain(scored(8, 0.5), linear, pending=1))


def test_a_shared_forward_is_priced_between_measured_sizes():
    """In the batch the curve is read on the line between measured sizes: one node more than a measured size
    costs a little more, not the next measured size's price, which made the weak nodes that fill a forward up to
    that size look free once a good one had crossed it."""
    coarse = CostCurve((1, 8, 16), (1.0, 1.5, 1.6))
    assert Interpolated(coarse)(8) == 1.5 and Interpolated(coarse)(16) == 1.6 and Interpolated(coarse)(12) == 1.55
    drafts = [scored(1, 0.9)] + [scored(1, 0.05)] * 7  # eight sequences, 8 pending tokens: one good node
    assert [len(d) for d in cut_batch(drafts, coarse, pending=8, shared=False)] == [1] * 8
    assert [len(d) for d in cut_batch(drafts, coarse, pending=8)] == [1] + [0] * 7


def scored_tree() -> Draft:
    """Two branches under the context, the second's scores higher below than its root's (capped by it)."""
    return Draft(tokens=torch.arange(6), parents=torch.tensor([-1, 0, 1, -1, 3, 3]),
                 scores=torch.tensor([0.9, 0.8, 0.7, 0.3, 0.6, 0.1]))


def test_the_batch_gate_cuts_scored_trees_to_subtrees():
    steep = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.3, 2.0, 3.5, 7.0, 14.0, 28.0))
    # alone (shared=False): a tree goes as its drafter sized it
    assert cut_batch([scored_tree()], steep, pending=1, shared=False)[0].tokens.tolist() == list(range(6))
    # among several sequences its nodes compete: a subtree closed under ancestors, best first; none at eight
    two = cut_batch([scored_tree(), scored(4, 0.5)], steep, pending=2)
    kept = two[0]
    assert 0 < len(kept) < 6 and kept.parents is not None
    assert kept.tokens.tolist()[: min(3, len(kept))] == [0, 1, 2][: min(3, len(kept))]
    assert all(p < i for i, p in enumerate(kept.parents.tolist()))
    assert not {4, 5} & set(kept.tokens.tolist()) or 3 in kept.tokens.tolist()  # never a child without its parent
    assert [len(d) for d in cut_batch([scored_tree()] * 8, steep, pending=8)] == [0] * 8
    # on a flat curve every node pays; a tree sent with the distributions its nodes were drawn from goes whole
    assert len(cut_batch([scored_tree()] * 2, FLAT, pending=2)[0]) == 6
    sampled = Draft(tokens=torch.arange(2), parents=torch.tensor([-1, -1]), scores=torch.tensor([0.5, 0.1]),
                    probs=torch.full((2, 4), 0.25), drawn_independently=True)
    assert cut_batch([sampled] * 8, steep, pending=8)[0] is sampled


# --- Every method that joins the batch: auto, suffix, Medusa, Jacobi -------------------------------------------


def prototypes(model) -> dict[str, Drafter]:
    """A drafter of each batched method, each sequence's made from it (`Drafter.for_sequence`), as a server does."""
    return {"auto": auto_prototype(model), "suffix-tree": SuffixDrafter(FLAT, tree=True), "suffix": SuffixDrafter(),
            "medusa-tree": MedusaDrafter(random_medusa_heads(model, seed=1), model, FLAT, tree=True, top_k=2),
            "jacobi": JacobiDrafter(), "pld": PromptLookupDrafter()}


class CountedHeads(torch.nn.Module):
    """A head's blocks that count the feature rows of each call."""

    def __init__(self, heads):
        super().__init__()
        self.heads, self.calls = heads, []
        self.num_heads = heads.num_heads

    def forward(self, features):
        self.calls.append(1 if features.dim() == 1 else features.shape[0])
        return self.heads(features)


def test_greedy_batch_of_every_batched_method_equals_plain_decoding(tiny_target, tiny_drafter):
    """auto (its draft model left out of the batch), suffix (chain and tree), Medusa's tree, Jacobi and prompt
    lookup in one batch, joining at several steps; two auto sequences and two suffix ones of one owner run side by
    side, each reading what the owner's earlier sequences left; every output is plain greedy decoding's. The
    Medusa heads of the auto sequences draft in calls over several sequences' features at once."""
    prompts = repetitive_prompts(8, seed=4)
    prompts[6], prompts[7] = prompts[0], prompts[3]  # an owner's repeated request: its memory drafts it
    references = greedy_references(tiny_target, prompts, 24)
    made = prototypes(tiny_target)
    made["auto"] = auto_prototype(tiny_target, tiny_drafter)
    assert not made["auto"].batchable
    medusa = next(s.drafter for s in made["auto"].sources if isinstance(s.drafter, MedusaDrafter))
    medusa.heads = counted = CountedHeads(medusa.heads)
    owner = {"auto": Memory(), "suffix": Memory()}  # one owner's, for the auto and suffix sequences
    kinds = ["auto", "suffix-tree", "medusa-tree", "auto", "jacobi", "pld", "auto", "suffix"]
    target = HFCausalLM(tiny_target)
    engine = BatchEngine(target, LetterTokenizer())
    engine.curve = FLAT
    outputs: dict[int, list[int]] = {}
    ids: dict[int, int] = {}
    for step in range(200):
        for index, join in enumerate([0, 0, 0, 1, 2, 2, 30, 30]):
            if join == step:
                drafter = made[kinds[index]].for_sequence(owner.get(kinds[index].removesuffix("-tree")))
                assert drafter.batchable and not any(isinstance(s.drafter, DraftModelDrafter)
                                                     for s in getattr(drafter, "sources", []))
                ids[engine.add(prompts[index], GenerationConfig(max_new_tokens=24), drafter, kinds[index])] = index
        for ident, _event, result in engine.step():
            if result is not None:
                outputs[ids[ident]] = result.token_ids
                assert result.method == kinds[ids[ident]]
        if len(outputs) == len(prompts):
            break
    assert outputs == dict(enumerate(references))
    assert max(counted.calls) > 1  # several auto sequences' features in one call
    assert len(engine) == 0 and target.cache_length == 0


def test_a_seed_gives_every_batched_sequence_plain_decodings_sampled_answer(tiny_target):
    """Under sampling, with the gate on (the batch's drafts cut together on the curve): every batched method's
    sequence outputs what plain decoding alone samples under its seed, token for token, whatever the others in its
    forwards (each output position's uniform decides its token: `sampling`)."""
    prompts = repetitive_prompts(6, seed=7)
    kinds = ["auto", "suffix-tree", "medusa-tree", "jacobi", "pld", "auto"]
    params = SamplingParams(temperature=0.8, top_p=0.9)
    configs = [GenerationConfig(max_new_tokens=24, sampling=params, seed=50 + i) for i in range(len(prompts))]
    alone = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer())
    answers = [alone.generate(prompt, config).token_ids for prompt, config in zip(prompts, configs)]
    made = prototypes(tiny_target)
    engine = BatchEngine(HFCausalLM(tiny_target), LetterTokenizer())
    engine.curve = FLAT
    ids = {engine.add(prompt, config, made[kind].for_sequence(None), kind): index
           for index, (prompt, config, kind) in enumerate(zip(prompts, configs, kinds))}
    outputs, drafted = {}, 0
    while len(outputs) < len(prompts):
        for ident, event, result in engine.step():
            drafted += event.stats.drafted
            if result is not None:
                outputs[ids[ident]] = result.token_ids
    assert outputs == dict(enumerate(answers)) and drafted > 0


def test_a_lone_auto_sequence_runs_the_single_engines_forwards(tiny_target):
    """A batch of one `auto` sequence (a lone request on the server) feeds the target what `SpeculativeEngine`
    feeds it, forward for forward, the hidden states its head reads included."""
    prompt, config = repetitive_prompts(3)[2], GenerationConfig(max_new_tokens=24)
    single = Recorded(tiny_target)
    expected = SpeculativeEngine(single, LetterTokenizer(), auto_prototype(tiny_target), gate=False).generate(
        prompt, config)
    alone = Recorded(tiny_target)
    engine = BatchEngine(alone, LetterTokenizer(), gate=False)
    engine.add(prompt, config, auto_prototype(tiny_target).for_sequence(), "auto")
    while len(engine):
        results = [r for _, _, r in engine.step() if r is not None]
    assert results[0].token_ids == expected.token_ids
    assert alone.calls == single.calls
    assert any(len(tokens) > 1 for tokens, _, _ in alone.calls[1:])  # it did draft


def test_a_long_prompt_fed_in_chunks_reaches_the_head_whole(tiny_target):
    """A prompt fed over several steps (the batch's chunked prefill): the sequence's first step hands its drafter
    the hidden states of the whole prompt, as the single engine does (`after_prefill`), and its output is
    plain decoding's."""
    prompt = repetitive_prompts(8, seed=6)[7] * 3  # 81 tokens
    references = greedy_references(tiny_target, [prompt], 12)
    seen: list[tuple[int, int]] = []
    head = watching_head(tiny_target, seen)
    engine = BatchEngine(HFCausalLM(tiny_target), LetterTokenizer())
    engine.curve, engine.prefill_chunk = FLAT, 16
    engine.add(prompt, GenerationConfig(max_new_tokens=12), head.for_sequence())
    result = next(r for _ in range(100) for _, _, r in engine.step() if r is not None)
    assert result.token_ids == references[0]
    assert seen[0][0] == len(prompt) and seen[0][1] >= len(prompt)


def test_one_owners_memory_reaches_only_its_own_sequences(tiny_target):
    """Suffix memory in the batch: a sequence of the owner who sent a text before drafts it from the owner's
    memory; another owner's sequence, side by side with it, drafts exactly what it drafts with a memory of its
    own, and the auto composite's statistics start afresh for it."""
    prompts = repetitive_prompts(3, seed=8)
    config = GenerationConfig(max_new_tokens=30)
    made = auto_prototype(tiny_target)

    def run(memories: list[Memory], order: list[int]) -> list:
        engine = BatchEngine(HFCausalLM(tiny_target), LetterTokenizer())
        engine.curve = FLAT
        results = {}
        for memory, index in zip(memories, order):  # one after the other: each leaves its memory its text
            ident = engine.add(prompts[index], config, made.for_sequence(memory), "auto")
            while ident not in results:
                results.update({i: r for i, _, r in engine.step() if r is not None})
        return [results[i] for i in sorted(results)]

    alice, bob = Memory(), Memory()
    first, again, bobs = run([alice, alice, bob], [0, 0, 0])
    [fresh] = run([Memory()], [0])
    assert first.token_ids == again.token_ids == bobs.token_ids == fresh.token_ids
    assert again.mean_accepted_tokens > first.mean_accepted_tokens  # alice's memory drafted her repeat
    assert [s.accepted for s in bobs.steps] == [s.accepted for s in fresh.steps]  # nothing of alice's
    assert alice.memory_bytes() > 0 and bob.memory_bytes() > 0


def test_sampled_batch_of_auto_follows_target_distribution():
    """Sampling in the batch engine with `auto`'s sources (prompt lookup, the suffix cache, Medusa's tree), each
    sequence's composite made from one prototype and their heads drafting in one call: the first two tokens of
    1,200 sequences that join two at a time follow the target's exact distribution (the tiny Qwen2 over 3 tokens,
    flattened: 9 cells, chi-square at 1e-4, power 0.97 against a 10% total-variation error)."""
    model = tiny_qwen2(seed=21, layers=3, hidden=32, vocab=3)
    with torch.no_grad():  # flatten the distributions so every pair has mass
        model.lm_head.weight.mul_(0.15)
    prompt, params, runs = [1, 0, 2, 1, 0, 2, 2, 0, 2], SamplingParams(temperature=1.0), 1200
    made = auto_prototype(model)
    engine = BatchEngine(HFCausalLM(model))
    engine.curve = CostCurve.linear(0.0)
    outcomes, events, added = Outcomes(vocab=3, length=2), {}, 0
    deep = 0
    while outcomes.runs < runs:
        for _ in range(min(2, runs - added)):
            config = GenerationConfig(max_new_tokens=4, sampling=params, seed=added)
            events[engine.add(prompt, config, made.for_sequence(), "auto")] = []
            added += 1
        for ident, event, result in engine.step():
            events[ident].append(event)
            if result is not None:
                steps = events.pop(ident)
                deep += any(e.stats.accepted > 0 for e in steps)
                outcomes.add(result.token_ids[:2], steps)
    assert deep > runs // 4  # drafts were accepted
    assert_follows(outcomes.counts, continuations(model_logits(model), prompt, 2, params), "batched auto", tv=0.1)


def test_the_servers_batch_runs_on_the_targets_own_path(tiny_target):
    """The server's batch runs on a view of the target with a cache of its own (`serve.worker.own_cache`): on the
    target's own path, so a static (GPU) target's batch is static too, its cache and captured forwards apart."""
    from specdecode.serve.worker import own_cache

    static = StaticCausalLM(tiny_target, capacity=256)
    view = own_cache(static)
    assert isinstance(view, StaticCausalLM) and view.model is static.model
    assert view.decoder.kv.data_ptr() != static.decoder.kv.data_ptr()
    dynamic = own_cache(HFCausalLM(tiny_target))
    assert type(dynamic) is HFCausalLM
