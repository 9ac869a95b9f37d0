"""The suffix drafter: its index against a slow obviously-correct reference, eviction under the cap,
learning across requests, and greedy equivalence through the engine."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import greedy_runs, random_prompts
from specdecode.bench.replay import replay
from specdecode.drafters.suffix import SuffixDrafter, SuffixIndex, build_suffix
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.methods import DrafterOptions
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.tree import structure
from specdecode.drafters.base import Outcome
from specdecode.types import Draft, SamplingParams, StepStats, Verdict

CURVE = CostCurve.linear(0.05)  # a fixed cost curve: tests time nothing
PROMPTS = random_prompts(6, seed=5)
LENGTHS = [1, 2, 7, 40]


pytestmark = pytest.mark.usefixtures("one_thread")


class SlowIndex:
    """What SuffixIndex stores and finds, by plain lists and loops: every position of every stored
    sequence is a candidate; the cap counts tokens plus one per sequence; eviction is LRU."""

    def __init__(self, capacity: int, max_match: int):
        self.capacity, self.max_match = capacity, max_match
        self.closed: OrderedDict[int, list[int]] = OrderedDict()
        self.open_id: int | None = None
        self.open_tokens: list[int] = []
        self.next_id = 0
        self.size = 0

    def _make_room(self, n: int) -> None:
        while self.size + n > self.capacity and self.closed:
            _, tokens = self.closed.popitem(last=False)
            self.size -= len(tokens) + 1

    def open(self) -> int:
        self.close()
        self._make_room(1)
        self.open_id, self.next_id, self.open_tokens = self.next_id, self.next_id + 1, []
        self.size += 1
        return self.open_id

    def extend(self, tokens: list[int]) -> int:
        self._make_room(len(tokens))
        n = max(min(len(tokens), self.capacity - self.size), 0)
        self.open_tokens += tokens[:n]
        self.size += n
        return n

    def close(self, drop_first: int = 0) -> None:
        if self.open_id is None:
            return
        drop = min(drop_first, len(self.open_tokens))
        kept = self.open_tokens[drop:]
        self.size -= drop
        if kept:
            self.closed[self.open_id] = kept
        else:
            self.size -= 1
        self.open_id = None

    def touch(self, sequence: int) -> None:
        if sequence in self.closed:
            self.closed.move_to_end(sequence)

    def lookup(self, context: list[int], min_match: int, max_tokens: int) -> list[tuple]:
        stored = dict(self.closed)
        if self.open_id is not None:
            stored[self.open_id] = self.open_tokens
        limit = min(self.max_match, len(context))
        found = []
        for sequence, tokens in stored.items():
            for p in range(1, len(tokens)):
                matched = 0
                while matched < limit and p - 1 - matched >= 0 and tokens[p - 1 - matched] == context[-1 - matched]:
                    matched += 1
                if matched >= min_match:
                    found.append((sequence, matched, tuple(tokens[p : p + max_tokens]), p))
        found.sort(key=lambda f: (-f[1], -f[0], -f[3]))  # longest, then most recent
        return [f[:3] for f in found]


def fast_lookup(index: SuffixIndex, context, min_match, max_tokens) -> list[tuple]:
    return [(m.sequence, m.matched, tuple(m.continuation.tolist()))
            for m in index.lookup(np.array(context), min_match, 10**6, max_tokens)]


token_lists = st.lists(st.integers(0, 3), max_size=12)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("open")),
        st.tuples(st.just("extend"), token_lists),
        st.tuples(st.just("close"), st.integers(0, 6)),
        st.tuples(st.just("touch"), st.integers(0, 12)),
        st.tuples(st.just("lookup"), st.lists(st.integers(0, 3), min_size=1, max_size=10), st.integers(1, 3),
                  st.integers(1, 5)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=operations, capacity=st.integers(16, 60), max_match=st.sampled_from([8, 16]))
def test_index_matches_slow_reference(ops, capacity, max_match):
    """Any interleaving of writes, touches and lookups, with eviction and compaction under a small cap:
    with unbounded walks the index finds exactly the reference's candidates, in the same order."""
    fast = SuffixIndex(capacity=capacity, max_match=max_match, max_walk=10**6)
    slow = SlowIndex(capacity, max_match)
    for op in ops:
        if op[0] == "open":
            assert fast.open() == slow.open()
        elif op[0] == "extend":
            if fast.open_id is None:
                assert fast.open() == slow.open()
            assert fast.extend(op[1]) == slow.extend(op[1])
        elif op[0] == "close":
            fast.close(op[1])
            slow.close(op[1])
        elif op[0] == "touch":
            fast.touch(op[1])
            slow.touch(op[1])
        else:
            _, context, min_match, max_tokens = op
            assert fast_lookup(fast, context, min_match, max_tokens) == slow.lookup(context, min_match, max_tokens)
        assert fast.size == slow.size <= capacity
        assert fast.log_slots <= 2 * capacity
        assert fast.sequences() == list(slow.closed) + ([] if slow.open_id is None else [slow.open_id])
        for sequence, tokens in slow.closed.items():
            assert fast.tokens_of(sequence).tolist() == tokens


def test_a_steps_few_tokens_are_linked_as_the_vectorised_pass_links_them(monkeypatch):
    """A step's few tokens are indexed one by one in Python (`index.SMALL`); forced through the vectorised pass
    instead, the same writes (with eviction and compaction under the cap) give the same log, the same hash chains
    and the same lookups."""
    from specdecode.drafters.suffix import index as index_module

    rng = np.random.default_rng(0)
    for _ in range(20):
        sequences = [rng.integers(0, 30, size=rng.integers(1, 400)).tolist() for _ in range(6)]
        cuts = [sorted(set(rng.integers(1, len(s) + 1, size=8).tolist()) | {len(s)}) for s in sequences]
        built = []
        for small in (index_module.SMALL, 0):
            monkeypatch.setattr(index_module, "SMALL", small)
            index = SuffixIndex(capacity=1024)
            for tokens, ends in zip(sequences, cuts):
                index.open()
                for start, end in zip([0, *ends], ends):
                    index.extend(tokens[start:end])
                index.close(drop_first=2)
            built.append(index)
        one_by_one, vectorised = built
        assert np.array_equal(one_by_one._tokens, vectorised._tokens)
        for k in one_by_one.keys:
            assert np.array_equal(one_by_one._prev[k], vectorised._prev[k])
            assert np.array_equal(one_by_one._head[k], vectorised._head[k])
        context = rng.integers(0, 30, size=40)
        assert ([(m.sequence, m.matched, m.continuation.tolist()) for m in one_by_one.lookup(context, 1, 8, 10)]
                == [(m.sequence, m.matched, m.continuation.tolist()) for m in vectorised.lookup(context, 1, 8, 10)])


@settings(max_examples=100, deadline=None)
@given(stored=st.lists(st.integers(0, 2), min_size=1, max_size=60),
       context=st.lists(st.integers(0, 2), min_size=1, max_size=20))
def test_bounded_lookup_keeps_the_longest_match(stored, context):
    """With a short walk and few candidates, the lookup still returns the longest match first when a
    long match exists on the longest key's chain (here a small store: every chain is short)."""
    index = SuffixIndex(capacity=1000, max_walk=64)
    index.open()
    index.extend(stored)
    slow = SlowIndex(1000, 16)
    slow.open()
    slow.extend(stored)
    fast = fast_lookup(index, context, 1, 4)
    expected = slow.lookup(context, 1, 4)
    bounded = index.lookup(np.array(context), 1, 3, 4)
    assert [m.matched for m in bounded] == [m for _, m, _ in expected[:3]]
    assert fast == expected


def test_eviction_drops_the_least_recently_used_sequence():
    index = SuffixIndex(capacity=30, keys=(1, 2), max_match=4)
    ids = {}
    for name, base in [("a", 10), ("b", 20), ("c", 30)]:
        ids[name] = index.open()
        index.extend(list(range(base, base + 9)))  # 9 tokens + a separator: 10 of the cap each
    index.close()
    assert index.size == 30
    index.touch(ids["a"])  # a was used: b is now the least recently used
    index.open()
    index.extend([7, 8, 9, 7, 8])
    assert index.size <= 30
    found = {name: index.lookup(np.array([base + 3, base + 4]), 2, 4, 3)
             for name, base in [("a", 10), ("b", 20), ("c", 30)]}
    assert [m.continuation.tolist() for m in found["a"]] == [[15, 16, 17]]
    assert found["b"] == []  # evicted
    assert [m.continuation.tolist() for m in found["c"]] == [[35, 36, 37]]
    assert ids["b"] not in index.sequences() and ids["a"] in index.sequences()
    # the current request's own tokens are found too, and never evicted
    assert [m.continuation.tolist() for m in index.lookup(np.array([7, 8]), 2, 4, 3)] == [[9, 7, 8]]


def test_memory_stays_under_the_cap_over_many_requests():
    rng = np.random.default_rng(0)
    capacity = 500
    index = SuffixIndex(capacity=capacity)
    last = None
    for _ in range(200):
        index.open()
        last = rng.integers(0, 50, int(rng.integers(1, 80))).tolist()
        index.extend(last)
        assert index.size <= capacity and index.log_slots <= 2 * capacity
        index.close()
    # the newest request is still there, whole
    assert index.tokens_of(index.sequences()[-1]).tolist() == last
    assert sum(index.tokens_of(s).size + 1 for s in index.sequences()) == index.size


def test_a_request_longer_than_the_cap_is_indexed_up_to_it():
    index = SuffixIndex(capacity=20)
    index.open()
    assert index.extend(list(range(50))) == 19  # 19 tokens + the separator
    assert index.size == 20
    assert [m.continuation.tolist() for m in index.lookup(np.array([3, 4]), 2, 4, 2)] == [[5, 6]]


def test_drafter_proposes_a_scored_chain_and_a_tree():
    drafter = SuffixDrafter()
    earlier = [1, 2, 3, 4, 5, 6, 7, 8]
    drafter.begin(earlier)
    drafter.propose(earlier, 8, SamplingParams(), None)
    drafter.begin([9, 1, 2, 3])  # a new request whose end matches the earlier one
    draft = drafter.propose([9, 1, 2, 3], 8, SamplingParams(), None)
    assert draft.tokens.tolist() == [4, 5, 6, 7, 8] and not draft.is_tree
    assert bool((draft.scores[1:] <= draft.scores[:-1]).all()) and 0 < float(draft.scores[0]) < 1
    # a tree: two earlier requests disagree after the match; the likelier branch scores higher
    tree = SuffixDrafter(CURVE, tree=True, min_shared_match=1)
    for prompt in ([5, 1, 2, 3, 4, 4], [6, 1, 2, 3, 7], [7, 1, 2, 3, 4, 4]):
        tree.begin(prompt)
        tree.propose(prompt, 8, SamplingParams(), None)
    tree.begin([1, 2, 3])
    draft = tree.propose([1, 2, 3], 8, SamplingParams(), None)
    structure.check(draft.parents)
    roots = {int(draft.tokens[i]): float(draft.scores[i]) for i in (draft.parents == -1).nonzero().flatten()}
    assert set(roots) == {4, 7} and roots[4] > roots[7]
    assert len(SuffixDrafter().propose([1, 2, 3], 8, SamplingParams(), None)) == 0  # nothing seen before
    tree.begin([1, 2, 3], forget=True)  # as between a benchmark's repeats: earlier requests are gone
    assert len(tree.propose([1, 2, 3], 8, SamplingParams(), None)) == 0 and tree.index.size == 4


@pytest.mark.parametrize("own_weight", [1.0, 2.0, 4.0])
def test_at_equal_length_the_own_match_outweighs_a_shared_one_by_own_weight(own_weight):
    """An earlier request and this one both hold the context's last three tokens, each followed by something else:
    the two continuations' first tokens score in the ratio `own_weight` (their rates are the same priors)."""
    drafter = SuffixDrafter(CURVE, tree=True, min_shared_match=1, own_weight=own_weight)
    earlier = [5, 1, 2, 3, 4, 4]
    drafter.begin(earlier)
    drafter.propose(earlier, 8, SamplingParams(), None)
    current = [1, 2, 3, 7, 7, 6, 1, 2, 3]
    drafter.begin(current)
    draft = drafter.propose(current, 8, SamplingParams(), None)
    roots = {int(draft.tokens[i]): float(draft.scores[i]) for i in (draft.parents == -1).nonzero().flatten()}
    assert set(roots) == {4, 7} and roots[7] / roots[4] == pytest.approx(own_weight)


def test_steps_it_hears_only_in_part_are_taken_from_the_next_context():
    """A composite tells a source it did not ask only the step's first token: two such steps in a row must not index
    a text with the second step's first token glued to the first's, and the next draft's context completes the
    request, as one sequence."""
    drafter = SuffixDrafter()
    drafter.begin([1, 2, 3])

    def step(tokens, new):
        stats = StepStats(drafted=0, accepted=0, new_tokens=new, draft_seconds=0.0, verify_seconds=0.0,
                          forward_tokens=1)
        drafter.observe(Outcome(Draft.empty(), Verdict(num_drafted=0, num_accepted=0, tokens=tokens), stats))

    step((4,), 3)  # the step added 4, 5, 6
    step((7,), 2)  # and this one 7, 8
    assert drafter._seen == [1, 2, 3, 4]  # a prefix of the request, never [1, 2, 3, 4, 7]
    context = [1, 2, 3, 4, 5, 6, 7, 8]
    drafter.propose(context, 4, SamplingParams(), None)
    assert drafter._seen == context and len(drafter.index.sequences()) == 1
    step((9, 10), 2)  # heard whole again: taken in
    assert drafter._seen == context + [9, 10]


def test_a_used_sequence_outlives_unused_ones():
    """A shared match judged right marks its sequence used, so eviction passes it over."""
    index = SuffixIndex(capacity=64, keys=(1, 2, 4))
    drafter = SuffixDrafter(index=index, include_prompts=True)
    first, second = list(range(10, 30)), list(range(40, 60))
    curve = CostCurve.linear(0.0)
    replay(drafter, first[:2], first[2:], curve)
    replay(drafter, second[:2], second[2:], curve)
    replay(drafter, first[:2], first[2:], curve)  # repeats the first request: its sequence is used
    sequences = index.sequences()
    assert sequences[-2] == 0  # the first request's sequence: now the most recently used closed one
    drafter.begin(list(range(70, 90)))  # needs room: the second request's sequence goes, not the first
    assert 1 not in index.sequences() and 0 in index.sequences()


@pytest.fixture(scope="module")
def plain(tiny_target):
    engine = SpeculativeEngine(HFCausalLM(tiny_target))
    return [engine.generate(p, GenerationConfig(max_new_tokens=max(LENGTHS))).token_ids for p in PROMPTS]


KINDS = {  # beyond the defaults (`suffix`, `suffix-tree`), which equivalence/test_every_method.py runs
    "chain-prompts-small-cap": lambda: SuffixDrafter(index=SuffixIndex(capacity=64), include_prompts=True),
    "tree-budget": lambda: SuffixDrafter(CURVE, tree=True, budget=5, num_tokens=6),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_suffix_equals_plain(kind, tiny_target, plain):
    """One drafter across every prompt and length, as a server would keep it: repeats of a prompt draft
    from the earlier runs, and the output is plain greedy decoding's all the same."""
    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=KINDS[kind]())
    engine.curve = CURVE
    list(greedy_runs(engine, PROMPTS, plain, LENGTHS))  # each run is checked as it comes


def test_second_identical_request_drafts_from_the_first(tiny_target, plain):
    drafter = SuffixDrafter()
    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=drafter)
    engine.curve = CURVE
    config = GenerationConfig(max_new_tokens=40)
    first = engine.generate(PROMPTS[2], config)
    second = engine.generate(PROMPTS[2], config)
    assert first.token_ids == second.token_ids == plain[2]
    assert second.mean_accepted_tokens > first.mean_accepted_tokens
    assert second.mean_accepted_tokens >= 5  # long drafts accepted whole
    assert max(s.accepted for s in second.steps) >= 10


def test_builder(target_lm, monkeypatch):
    monkeypatch.setattr(target_lm, "cost_curve", lambda: CURVE)  # measuring one would take seconds
    drafter = build_suffix(target_lm, None, DrafterOptions())
    assert isinstance(drafter, SuffixDrafter) and not drafter.tree
    tree = build_suffix(target_lm, None, DrafterOptions(tree=True, budget=7))
    assert tree.tree and tree.budget == 7
