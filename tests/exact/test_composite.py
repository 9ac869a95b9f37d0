"""The composite drafter: merging by hand and against properties, the fallback policy, what each source
learns, greedy equivalence and lossless sampling through the engine."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DRAFT_PRICES, greedy_runs, noisy_copy, random_prompts
from fakes import DRAFT, PROMPT, FakeLM
from specdecode.drafters.base import Drafter, Needs, Outcome
from specdecode.drafters.composite import (
    DROPPED, CompositeDrafter, Source, build_composite, default_scores, merge, select, translate,
)
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupTreeDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.methods import DrafterOptions
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.tree import structure
from specdecode.tree.trie import best_path
from specdecode.types import Draft, SamplingParams, StepStats, Verdict
from specdecode.verify.tree import verify_tree_greedy

CURVE = CostCurve.linear(0.05)  # a fixed cost curve: tests time nothing
FREE = CostCurve.linear(0.0)  # width costs nothing: every node with a positive score pays
PROMPTS = random_prompts(6, seed=7)
LENGTHS = [1, 2, 7, 40]
GREEDY = SamplingParams()
STATS = StepStats(0, 0, 0, 0.0, 0.0, 0)


pytestmark = pytest.mark.usefixtures("one_thread")


def chain(tokens, scores=None) -> Draft:
    return Draft(tokens=torch.tensor(tokens, dtype=torch.long),
                 scores=None if scores is None else torch.tensor(scores, dtype=torch.float32))


def tree(tokens, parents, scores=None) -> Draft:
    return Draft(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                 scores=None if scores is None else torch.tensor(scores, dtype=torch.float32))


class Fixed(Drafter):
    """Proposes the same draft every step; counts calls and keeps what it is told."""

    def __init__(self, draft: Draft, name: str = "fixed"):
        self.draft, self.name = draft, name
        self.calls = self.begun = 0
        self.verdicts: list[Verdict] = []

    def begin(self, prompt_ids, forget=False):
        self.begun += 1

    def propose(self, context, max_tokens, params, generator) -> Draft:
        self.calls += 1
        return self.draft

    def observe(self, outcome):
        self.verdicts.append(outcome.verdict)


# --- merging ---------------------------------------------------------------------------------------


def test_merge_by_hand():
    a = chain([1, 2, 3], [0.9, 0.8, 0.7])
    b = chain([1, 2, 4], [0.6, 0.5, 0.4])
    c = tree([1, 5, 2], [-1, -1, 0], [0.5, 0.3, 0.45])
    merged = merge([a, b, c], [a.scores, b.scores, c.scores])
    structure.check(torch.tensor(merged.parents))
    assert merged.tokens == [1, 2, 3, 4, 5] and merged.parents == [-1, 0, 1, 1, -1]
    assert merged.mappings == [[0, 1, 2], [0, 1, 3], [0, 4, 1]]
    assert merged.scores == pytest.approx([0.9, 0.8, 0.7, 0.4, 0.3])  # max of the proposals
    noisy = merge([a, b, c], [a.scores, b.scores, c.scores], combine="noisy-or")
    assert noisy.scores[0] == pytest.approx(1 - 0.1 * 0.4 * 0.5)
    assert noisy.scores[1] == pytest.approx(1 - 0.2 * 0.5 * 0.55)
    # deeper than allowed: left out, with everything under it
    shallow = merge([a, c], [a.scores, c.scores], max_depth=1)
    assert shallow.tokens == [1, 5] and shallow.mappings == [[0, DROPPED, DROPPED], [0, 1, DROPPED]]


def test_a_sibling_repeated_within_one_draft_is_one_proposal():
    """A sampled tree may draw a token twice under one parent: its score is the best of the two (one proposal), not
    the two combined as separate drafts' would be, nor the later one's."""
    sampled = tree([7, 7, 8], [-1, -1, 0], [0.6, 0.3, 0.2])
    for combine in ("max", "noisy-or"):
        merged = merge([sampled], [sampled.scores], combine=combine)
        assert merged.tokens == [7, 8] and merged.mappings == [[0, 0, 1]]
        assert merged.scores == pytest.approx([0.6, 0.2])
    other = chain([7], [0.5])
    both = merge([sampled, other], [sampled.scores, other.scores], combine="noisy-or")
    assert both.scores[0] == pytest.approx(1 - 0.4 * 0.5)  # across drafts, combined


def test_a_chain_from_a_tree_follows_the_best_child_and_the_earlier_of_equals():
    parents = torch.tensor([-1, -1, 0, 0, 1, 3])
    scores = torch.tensor([0.5, 0.5, 0.2, 0.4, 0.5, 0.3])
    assert best_path(parents, scores).tolist() == [0, 3, 5]  # nodes 0 and 1 tie: the earlier
    assert best_path(parents, torch.tensor([0.5, 0.6, 0.2, 0.4, 0.5, 0.3])).tolist() == [1, 4]


def test_merge_caps_a_child_by_its_parent():
    merged = merge([chain([1, 2], [0.3, 0.9])], [torch.tensor([0.3, 0.9])])
    assert merged.scores == pytest.approx([0.3, 0.3])


def test_default_scores_split_among_siblings():
    assert default_scores(chain([4, 5, 6]), 0.5).tolist() == pytest.approx([0.5, 0.25, 0.125])
    assert default_scores(tree([4, 5, 6], [-1, -1, 0]), 0.5).tolist() == pytest.approx([0.25, 0.25, 0.125])


def test_select_respects_the_budget_and_the_curve():
    merged = merge([chain([1, 2, 3], [0.9, 0.8, 0.7]), tree([1, 5, 6], [-1, 0, -1], [0.5, 0.4, 0.2])],
                   [torch.tensor([0.9, 0.8, 0.7]), torch.tensor([0.5, 0.4, 0.2])])
    parents, scores = torch.tensor(merged.parents), torch.tensor(merged.scores)
    for budget in range(1, 7):
        keep = select(parents, scores, CURVE, budget=budget)
        assert len(keep) == min(budget, len(parents))
        structure.select(parents, keep)  # closed under ancestors, or it raises
    assert [merged.tokens[i] for i in select(parents, scores, CURVE, budget=3)] == [1, 2, 3]
    assert len(select(parents, scores, FREE)) == len(parents)  # free width: every node pays
    assert len(select(parents, scores, CostCurve.linear(1.0))) == 0  # width as dear as depth: none does
    path = select(parents, scores, FREE, tree=False)
    assert [merged.tokens[i] for i in path] == [1, 2, 3]


@st.composite
def drafts(draw):
    n = draw(st.integers(0, 8))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    scores = draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
    is_chain = draw(st.booleans())
    if is_chain:
        return chain(tokens, scores)
    return tree(tokens, parents, scores)


@settings(max_examples=300, deadline=None)
@given(sub=st.lists(drafts(), max_size=4), combine=st.sampled_from(["max", "noisy-or"]),
       max_depth=st.none() | st.integers(1, 4), budget=st.integers(1, 10))
def test_merge_properties(sub, combine, max_depth, budget):
    """A valid trie: parents first, no two siblings alike, every kept node of every draft on a merged
    path with the same tokens, scores never growing downward; pruned to the budget, still a tree."""
    merged = merge(sub, [d.scores.float() for d in sub], combine, max_depth)
    parents = torch.tensor(merged.parents, dtype=torch.long)
    structure.check(parents)
    assert len(set(zip(merged.parents, merged.tokens))) == len(merged.tokens)
    depth = structure.depths(parents).tolist()
    for draft, mapping in zip(sub, merged.mappings):
        draft_parents = draft.parents if draft.is_tree else structure.chain(len(draft))
        draft_depth = structure.depths(draft_parents).tolist()
        for node, (token, parent) in enumerate(zip(draft.tokens.tolist(), draft_parents.tolist())):
            if max_depth is not None and draft_depth[node] > max_depth:
                assert mapping[node] == DROPPED
                continue
            assert merged.tokens[mapping[node]] == token and depth[mapping[node]] == draft_depth[node]
            assert merged.parents[mapping[node]] == (-1 if parent == -1 else mapping[parent])
    for node, parent in enumerate(merged.parents):
        assert 0 <= merged.scores[node] <= 1 and (parent == -1 or merged.scores[node] <= merged.scores[parent])
    keep = select(parents, torch.tensor(merged.scores), CURVE, budget=budget)
    assert len(keep) <= budget
    structure.check(structure.select(parents, keep))


# --- what sources learn ----------------------------------------------------------------------------


def test_translate_by_hand():
    draft = chain([5, 6, 7])
    rejected = translate(draft, (5, 6, 9))
    assert (rejected.num_accepted, rejected.tokens, rejected.bonus) == (2, (5, 6, 9), False)
    whole = translate(draft, (5, 6, 7, 8))
    assert (whole.num_accepted, whole.tokens, whole.bonus) == (3, (5, 6, 7, 8), True)
    foresaw = translate(draft, (5, 6, 7))  # it predicted even the correction: nothing rejected
    assert (foresaw.num_accepted, foresaw.tokens, foresaw.bonus) == (2, (5, 6, 7), True)
    assert translate(draft, (4,)).num_accepted == 0 and not translate(draft, (4,)).bonus
    branchy = tree([5, 8, 6, 9], [-1, -1, 1, 2])
    followed = translate(branchy, (8, 6, 1))
    assert followed.path == (1, 2) and followed.tokens == (8, 6, 1) and not followed.bonus


@settings(max_examples=300, deadline=None)
@given(draft=drafts(), table=st.lists(st.integers(0, 3), min_size=64, max_size=64), length=st.integers(1, 10))
def test_translate_is_what_greedy_verification_would_decide(draft, table, length):
    """A target whose argmax after a path is table[hash(path)]: translating its greedy output (of any
    length) equals verifying the draft alone, up to what that output can tell."""
    def argmax_after(path: tuple[int, ...]) -> int:
        return table[hash(path) % 64]

    parents = draft.parents if draft.is_tree else structure.chain(len(draft))
    mask = structure.ancestor_mask(parents)
    logits = torch.zeros(len(draft) + 1, 4)
    logits[0, argmax_after(())] = 1.0
    for node in range(len(draft)):
        path = tuple(draft.tokens[mask[node]].tolist())
        logits[node + 1, argmax_after(path)] = 1.0
    alone = verify_tree_greedy(logits, draft.tokens, parents)
    output: list[int] = []
    while len(output) < length:
        output.append(argmax_after(tuple(output)))
    told = translate(draft, tuple(output))
    if alone.num_accepted < length:
        assert (told.num_accepted, told.path, told.tokens, told.bonus) == (
            alone.num_accepted, alone.path, alone.tokens, alone.bonus)
    else:  # the output ends before the draft's fate is known: no rejection
        assert told.num_accepted == length - 1 and told.path == alone.path[: length - 1] and told.bonus


def test_each_source_is_told_how_its_own_proposal_fared():
    cheap = Fixed(chain([1, 2, 3], [0.9, 0.8, 0.7]))
    dear = Fixed(chain([1, 2, 9]))
    silent = Fixed(Draft.empty())
    composite = CompositeDrafter([cheap, silent, Source(dear, "expensive")], FREE, fallback_below=float("inf"))
    composite.begin([0])
    assert cheap.begun == dear.begun == silent.begun == 1
    draft = composite.propose([0], 8, GREEDY, None)
    assert draft.tokens.tolist() == [1, 2, 3, 9] and draft.parents.tolist() == [-1, 0, 1, 1]
    # the target accepted 1, 2, 3 and added 7
    verdict = Verdict(num_drafted=4, num_accepted=3, tokens=(1, 2, 3, 7), path=(0, 1, 2), bonus=True)
    composite.observe(Outcome(draft, verdict, STATS))
    told = cheap.verdicts[-1]
    assert (told.num_drafted, told.num_accepted, told.tokens, told.bonus) == (3, 3, (1, 2, 3, 7), True)
    told = dear.verdicts[-1]
    assert (told.num_drafted, told.num_accepted, told.tokens, told.bonus) == (3, 2, (1, 2, 3), False)
    assert silent.verdicts[-1].num_drafted == 0 and silent.verdicts[-1].tokens == (1,)
    assert composite.rate(2) < composite.rate(0)  # the draft model's tokens fared worse


# --- the fallback policy ---------------------------------------------------------------------------


def test_expensive_source_only_when_the_cheap_ones_promise_little():
    dear = Fixed(chain([4, 5]))
    cases = [
        (chain([1, 2, 3, 4], [0.95, 0.9, 0.85, 0.8]), 0),  # a good copy: the draft model is not run
        (Draft.empty(), 1),  # nothing found: it is
        (chain([1], [0.1]), 1),  # a weak guess promising 0.1 tokens: it is too
    ]
    for cheap_draft, calls in cases:
        dear.calls = 0
        cheap = Fixed(cheap_draft)
        composite = CompositeDrafter([Source(cheap, "free"), Source(dear, "expensive")], FREE, fallback_below=1.0)
        composite.begin([0])
        draft = composite.propose([0], 8, GREEDY, None)
        assert cheap.calls == 1 and dear.calls == calls
        if calls == 0:
            assert draft.tokens.tolist() == [1, 2, 3, 4]
            verdict = Verdict(num_drafted=4, num_accepted=4, tokens=(1, 2, 3, 4, 5), bonus=True)
            composite.observe(Outcome(draft, verdict, STATS))
            assert dear.verdicts[-1].num_drafted == 0  # told it drafted nothing
    always = CompositeDrafter([Fixed(chain([1], [0.99])), Source(dear, "expensive")], FREE, fallback_below=float("inf"))
    dear.calls = 0
    always.propose([0], 8, GREEDY, None)
    assert dear.calls == 1
    with pytest.raises(UserError):
        Source(dear, "cheap")


# --- through the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tiny_target):
    engine = SpeculativeEngine(HFCausalLM(tiny_target))
    return [engine.generate(p, GenerationConfig(max_new_tokens=max(LENGTHS))).token_ids for p in PROMPTS]


def kinds(target_model, other_model):
    noisy = lambda seed: HFCausalLM(noisy_copy(target_model, 0.3, seed))  # noqa: E731
    return {
        "tree": lambda: CompositeDrafter(
            [PromptLookupDrafter(), Source(DraftModelDrafter(noisy(1), num_tokens=4, **DRAFT_PRICES), "expensive")],
            CURVE),
        "chain": lambda: CompositeDrafter(
            [PromptLookupDrafter(), Source(DraftModelDrafter(noisy(2), num_tokens=4, **DRAFT_PRICES), "expensive")],
            CURVE, tree=False),
        "budget-noisy-or": lambda: CompositeDrafter(
            [PromptLookupTreeDrafter(CURVE, max_ngram=2, num_tokens=5), SuffixDrafter(),
             Source(DraftModelTreeDrafter(noisy(3), CURVE, draft_cost=0.4, max_depth=4), "expensive")],
            CURVE, budget=6, combine="noisy-or"),
        "always-unrelated": lambda: CompositeDrafter(
            [SuffixDrafter(),
             Source(DraftModelDrafter(HFCausalLM(other_model), num_tokens=3, **DRAFT_PRICES), "expensive")],
            CURVE, fallback_below=float("inf")),
    }


@pytest.mark.parametrize("kind", ["tree", "chain", "budget-noisy-or", "always-unrelated"])
def test_greedy_composite_equals_plain(kind, tiny_target, tiny_drafter, plain):
    drafter = kinds(tiny_target, tiny_drafter)[kind]()
    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=drafter)
    engine.curve = CURVE
    *_, (_, _, result) = greedy_runs(engine, PROMPTS, plain, LENGTHS)  # checked as it runs; the last kept
    if kind == "tree":  # the noisy draft model agrees often: several tokens per forward
        assert result.mean_accepted_tokens > 1.5


class Watcher(Drafter):
    """Wants the target's logits; proposes the chain it is given and records what observe() brings."""

    name = "watcher"
    needs = Needs(logits=True)

    def __init__(self, tokens):
        self.tokens, self.seen = tokens, []

    def propose(self, context, max_tokens, params, generator) -> Draft:
        return chain(self.tokens[:max_tokens])

    def observe(self, outcome):
        if outcome.logits is not None:
            seen = (outcome.draft.tokens.tolist(), outcome.logits.shape[0], outcome.verdict.num_accepted)
            self.seen.append(seen)


def test_observe_gets_the_rows_of_the_verified_nodes(tiny_target, plain):
    target_tokens = plain[0][:3]
    watcher = Watcher(target_tokens + [0, 0, 0])  # right for three tokens, then most likely wrong
    composite = CompositeDrafter([watcher], FREE, budget=4)
    assert composite.needs.logits
    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=composite)
    engine.curve = CURVE
    result = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=10))
    assert result.token_ids == plain[0][:10]
    tokens, rows, accepted = watcher.seen[0]
    assert tokens == target_tokens + [0] and rows == 5  # 4 kept of 6, plus the context's row
    assert accepted == 3 + (plain[0][3] == 0)


def test_a_sampling_source_gives_fixed_nodes():
    """A draft model's sampled chain comes with its distributions; the composite submits its merged tree
    without them (fixed nodes, one-hot to the verifier: lossless, `statistical/test_engine_sampling.py`)."""
    params = SamplingParams(temperature=1.0, top_k=3)
    sampler = DraftModelDrafter(FakeLM(DRAFT), num_tokens=2, adaptive=False, confidence_threshold=0)
    composite = CompositeDrafter(
        [PromptLookupTreeDrafter(FREE, max_ngram=1, num_tokens=2), Source(sampler, "expensive")],
        FREE, fallback_below=float("inf"))
    composite.begin(PROMPT)
    generator = torch.Generator().manual_seed(0)
    assert sampler.propose(PROMPT, 2, params, generator).probs is not None  # the draft model samples ...
    draft = composite.propose(PROMPT, 2, params, generator)
    assert draft.probs is None and draft.is_tree and len(draft) > 2  # ... the composite submits fixed nodes


def test_builder(target_lm, tiny_target, monkeypatch):
    """Prompt lookup, then the draft model when there is one (expensive); no cost curve is measured."""
    draft_lm = HFCausalLM(copy.deepcopy(tiny_target))
    monkeypatch.setattr(target_lm, "cost_curve", lambda: dataclasses.replace(CURVE, seconds=1.0))
    monkeypatch.setattr(draft_lm, "cost_curve", lambda: dataclasses.replace(CURVE, seconds=0.5))
    alone = build_composite(target_lm, None, DrafterOptions())
    assert [type(s.drafter) for s in alone.sources] == [PromptLookupDrafter] and not alone.tree
    both = build_composite(target_lm, draft_lm, DrafterOptions(tree=True, budget=8))
    assert [(type(s.drafter), s.cost) for s in both.sources] == [
        (PromptLookupDrafter, "free"), (DraftModelDrafter, "expensive")]
    assert both.tree and both.budget == 8 and both.sources[1].drafter.draft_cost == pytest.approx(0.5)
