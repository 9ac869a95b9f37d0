"""Golden and property tests of the parent-index token tree (`specdecode.tree.structure`).

Hand-drawn trees with every expected value written out by hand, then random trees (hypothesis) checked
against slow references that walk the parent pointers one node at a time.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.errors import UserError
from specdecode.tree import structure
from specdecode.tree.trie import build_trie, stack

# ---------------------------------------------------------------------------------------------------
# Tree A: 7 nodes, depth 3, two branches from the context.
#
#   context
#   ├── 0
#   │   ├── 2
#   │   │   └── 5
#   │   └── 3
#   └── 1
#       └── 4
#           └── 6
A = torch.tensor([-1, -1, 0, 0, 1, 2, 4])

# Tree B: 6 nodes, node order is not breadth-first (a depth-3 node comes before a depth-1 node) and the
# last node hangs off the first.
#
#   context
#   ├── 0
#   │   ├── 1
#   │   │   └── 2
#   │   └── 5
#   └── 3
#       └── 4
B = torch.tensor([-1, 0, 1, -1, 3, 0])

# Tree C: a single node.
#
#   context
#   └── 0
C = torch.tensor([-1])


def bools(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def test_depths_by_hand():
    assert structure.depths(A).tolist() == [1, 1, 2, 2, 2, 3, 3]
    assert structure.depths(B).tolist() == [1, 2, 3, 1, 2, 2]
    assert structure.depths(C).tolist() == [1]
    assert structure.depths(torch.empty(0, dtype=torch.long)).tolist() == []


def test_ancestor_mask_by_hand():
    expected_a = bools([
        # 0  1  2  3  4  5  6
        [1, 0, 0, 0, 0, 0, 0],  # 0
        [0, 1, 0, 0, 0, 0, 0],  # 1
        [1, 0, 1, 0, 0, 0, 0],  # 2: 0
        [1, 0, 0, 1, 0, 0, 0],  # 3: 0
        [0, 1, 0, 0, 1, 0, 0],  # 4: 1
        [1, 0, 1, 0, 0, 1, 0],  # 5: 0, 2
        [0, 1, 0, 0, 1, 0, 1],  # 6: 1, 4
    ])
    expected_b = bools([
        # 0  1  2  3  4  5
        [1, 0, 0, 0, 0, 0],  # 0
        [1, 1, 0, 0, 0, 0],  # 1: 0
        [1, 1, 1, 0, 0, 0],  # 2: 0, 1
        [0, 0, 0, 1, 0, 0],  # 3
        [0, 0, 0, 1, 1, 0],  # 4: 3
        [1, 0, 0, 0, 0, 1],  # 5: 0
    ])
    assert torch.equal(structure.ancestor_mask(A), expected_a)
    assert torch.equal(structure.ancestor_mask(B), expected_b)
    assert torch.equal(structure.ancestor_mask(C), bools([[1]]))
    assert structure.ancestor_mask(torch.empty(0, dtype=torch.long)).shape == (0, 0)


def test_children_by_hand():
    # entry 0 is the context, entry i + 1 is node i
    assert structure.children(A) == [[0, 1], [2, 3], [4], [5], [], [6], [], []]
    assert structure.children(B) == [[0, 3], [1, 5], [2], [], [4], [], []]
    assert structure.children(C) == [[0], []]
    assert structure.children(torch.empty(0, dtype=torch.long)) == [[]]


def test_leaf_paths_by_hand():
    # leaves in node order, each path from the shallowest node, padded with -1 to the deepest path
    assert structure.leaf_paths(A).tolist() == [[0, 3, -1], [0, 2, 5], [1, 4, 6]]
    assert structure.leaf_paths(B).tolist() == [[0, 1, 2], [3, 4, -1], [0, 5, -1]]
    assert structure.leaf_paths(C).tolist() == [[0]]
    assert structure.leaf_paths(torch.empty(0, dtype=torch.long)).shape == (0, 0)


def test_verification_inputs_one_pending_by_hand():
    # tree A after a 10-token context whose last token is not in the cache yet: the pending token sits
    # at position 9, depth-d nodes at 9 + d
    positions, mask = structure.verification_inputs(A, num_pending=1, context_length=10)
    assert positions.tolist() == [9, 10, 10, 11, 11, 11, 12, 12]
    expected = bools([
        # p  0  1  2  3  4  5  6
        [1, 0, 0, 0, 0, 0, 0, 0],  # pending
        [1, 1, 0, 0, 0, 0, 0, 0],  # 0
        [1, 0, 1, 0, 0, 0, 0, 0],  # 1
        [1, 1, 0, 1, 0, 0, 0, 0],  # 2
        [1, 1, 0, 0, 1, 0, 0, 0],  # 3
        [1, 0, 1, 0, 0, 1, 0, 0],  # 4
        [1, 1, 0, 1, 0, 0, 1, 0],  # 5
        [1, 0, 1, 0, 0, 1, 0, 1],  # 6
    ])
    assert torch.equal(mask, expected)


def test_verification_inputs_three_pending_by_hand():
    # tree B after a 10-token context whose last 3 tokens are pending (positions 7, 8, 9): they attend
    # causally among themselves; every node sees all three and its own ancestors
    positions, mask = structure.verification_inputs(B, num_pending=3, context_length=10)
    assert positions.tolist() == [7, 8, 9, 10, 11, 12, 10, 11, 11]
    expected = bools([
        # p0 p1 p2 0  1  2  3  4  5
        [1, 0, 0, 0, 0, 0, 0, 0, 0],  # pending 0
        [1, 1, 0, 0, 0, 0, 0, 0, 0],  # pending 1
        [1, 1, 1, 0, 0, 0, 0, 0, 0],  # pending 2
        [1, 1, 1, 1, 0, 0, 0, 0, 0],  # 0
        [1, 1, 1, 1, 1, 0, 0, 0, 0],  # 1
        [1, 1, 1, 1, 1, 1, 0, 0, 0],  # 2
        [1, 1, 1, 0, 0, 0, 1, 0, 0],  # 3
        [1, 1, 1, 0, 0, 0, 1, 1, 0],  # 4
        [1, 1, 1, 1, 0, 0, 0, 0, 1],  # 5
    ])
    assert torch.equal(mask, expected)


def test_from_choices_medusa_style_unsorted_with_duplicates():
    choices = [(0, 1), (2,), (0,), (0, 0, 0), (1, 0), (0,), [1], (0, 0), (0, 1)]
    parents, ranks = structure.from_choices(choices)
    # sorted by depth then ranks: (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0), duplicates dropped
    #
    #   context
    #   ├── 0 (0,)
    #   │   ├── 3 (0,0)
    #   │   │   └── 6 (0,0,0)
    #   │   └── 4 (0,1)
    #   ├── 1 (1,)
    #   │   └── 5 (1,0)
    #   └── 2 (2,)
    assert parents.tolist() == [-1, -1, -1, 0, 0, 1, 3]
    assert ranks.tolist() == [0, 1, 2, 0, 1, 0, 0]
    assert parents.dtype == torch.long and ranks.dtype == torch.long
    structure.check(parents)


def test_from_choices_round_trips_through_paths():
    choices = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1), (1, 0), (2,)]
    parents, ranks = structure.from_choices(choices)
    # every node's choice is the ranks along its root-to-node path
    mask = structure.ancestor_mask(parents)
    rebuilt = {tuple(ranks[mask[i]].tolist()) for i in range(parents.numel())}
    assert rebuilt == set(choices)


@pytest.mark.parametrize(
    "choices",
    [
        [(0,), (1, 0)],  # (1, 0) has no parent (1,)
        [(0,), (0, 0, 1)],  # (0, 0, 1) has no parent (0, 0)
        [(0,), ()],  # an empty tuple
        [],  # no choices at all
        [(0,), (-1,)],  # a negative rank
    ],
)
def test_from_choices_user_errors(choices):
    with pytest.raises(UserError):
        structure.from_choices(choices)


def test_select_reindexes_by_hand():
    assert structure.select(A, torch.tensor([0, 2, 5])).tolist() == [-1, 0, 1]
    assert structure.select(A, torch.tensor([1, 4, 6])).tolist() == [-1, 0, 1]
    #   kept: 0, 1, 3, 4  ->  new 0 (old 0), 1 (old 1), 2 (old 3, child of old 0), 3 (old 4, child of old 1)
    assert structure.select(A, torch.tensor([0, 1, 3, 4])).tolist() == [-1, -1, 0, 1]
    assert structure.select(A, torch.arange(7)).tolist() == A.tolist()
    #   B kept: 0, 3, 4, 5 -> 0, 1, 2 (old 4, child of old 3 = new 1), 3 (old 5, child of old 0)
    assert structure.select(B, torch.tensor([0, 3, 4, 5])).tolist() == [-1, -1, 1, 0]
    assert structure.select(A, torch.empty(0, dtype=torch.long)).tolist() == []


@pytest.mark.parametrize("keep", [[0, 5], [4], [2], [0, 1, 6], [3, 4, 5]])
def test_select_rejects_sets_not_closed_under_ancestors(keep):
    with pytest.raises(ValueError):
        structure.select(A, torch.tensor(keep))


def test_top_nodes_monotone_scores_by_hand():
    # cumulative path probabilities: never grow from parent to child
    scores = torch.tensor([0.6, 0.3, 0.4, 0.15, 0.2, 0.35, 0.05])
    # ranking: 0 (.6), 2 (.4), 5 (.35), 1 (.3), 4 (.2), 3 (.15), 6 (.05)
    assert structure.top_nodes(A, scores, 0).tolist() == []
    assert structure.top_nodes(A, scores, 1).tolist() == [0]
    assert structure.top_nodes(A, scores, 3).tolist() == [0, 2, 5]
    assert structure.top_nodes(A, scores, 4).tolist() == [0, 1, 2, 5]
    assert structure.top_nodes(A, scores, 5).tolist() == [0, 1, 2, 4, 5]
    assert structure.top_nodes(A, scores, 7).tolist() == list(range(7))
    assert structure.top_nodes(A, scores, 100).tolist() == list(range(7))


def test_top_nodes_ties_go_to_the_parent():
    # a chain with equal scores: the budget takes the shallowest nodes
    assert structure.top_nodes(structure.chain(4), torch.full((4,), 0.5), 2).tolist() == [0, 1]
    # B: node 5 ties with its parent 0; budget 1 must keep the parent, not the child
    scores = torch.tensor([0.5, 0.2, 0.1, 0.4, 0.1, 0.5])
    assert structure.top_nodes(B, scores, 1).tolist() == [0]
    assert structure.top_nodes(B, scores, 2).tolist() == [0, 5]
    assert structure.top_nodes(B, scores, 3).tolist() == [0, 3, 5]
    # all equal on A: the two children of the context come first
    assert structure.top_nodes(A, torch.ones(7), 2).tolist() == [0, 1]


def test_top_nodes_closes_under_ancestors_when_scores_grow_down_a_path():
    scores = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.9])  # node 6 deep in the 1 -> 4 branch
    assert structure.top_nodes(A, scores, 1).tolist() == [1, 4, 6]


@pytest.mark.parametrize(
    "bad",
    [
        [0],  # a node its own parent
        [-1, 1],
        [-1, 2, 0],  # a parent after its child
        [-1, -2],  # below -1
        [-1, 0, 7],  # out of range
    ],
)
def test_check_rejects_bad_parents(bad):
    with pytest.raises(ValueError):
        structure.check(torch.tensor(bad))


def test_check_accepts_good_parents():
    for parents in (A, B, C, structure.chain(5), torch.empty(0, dtype=torch.long), torch.full((4,), -1)):
        structure.check(parents)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_chain_is_a_tree_that_decodes_like_a_sequence(n):
    parents = structure.chain(n)
    assert parents.tolist() == list(range(-1, n - 1))
    structure.check(parents)
    assert structure.depths(parents).tolist() == list(range(1, n + 1))
    assert torch.equal(structure.ancestor_mask(parents), torch.ones(n, n, dtype=torch.bool).tril())
    assert structure.children(parents) == [[i] for i in range(n)] + [[]]
    assert structure.leaf_paths(parents).tolist() == [list(range(n))]
    # pending tokens followed by a chain: consecutive positions under a plain causal mask
    for pending in (1, 3):
        positions, mask = structure.verification_inputs(parents, pending, context_length=8)
        assert positions.tolist() == list(range(8 - pending, 8 + n))
        assert torch.equal(mask, torch.ones(pending + n, pending + n, dtype=torch.bool).tril())


def test_chain_of_zero_nodes():
    assert structure.chain(0).numel() == 0


# --- Random trees against slow references ----------------------------------------------------------


@st.composite
def trees(draw, max_nodes: int = 14) -> torch.Tensor:
    n = draw(st.integers(1, max_nodes))
    return torch.tensor([draw(st.integers(-1, i - 1)) for i in range(n)], dtype=torch.long)


def ancestors_of(parents: list[int], i: int) -> list[int]:
    """Node i's strict ancestors, walking up the parent pointers (deepest first)."""
    out = []
    while parents[i] != -1:
        i = parents[i]
        out.append(i)
    return out


@settings(max_examples=150, deadline=None)
@given(trees())
def test_structure_functions_match_slow_references(parents):
    p = parents.tolist()
    n = len(p)
    structure.check(parents)
    assert structure.depths(parents).tolist() == [1 + len(ancestors_of(p, i)) for i in range(n)]
    mask = structure.ancestor_mask(parents)
    for i in range(n):
        assert set(mask[i].nonzero().flatten().tolist()) == {i, *ancestors_of(p, i)}
    kids = structure.children(parents)
    assert kids[0] == [i for i in range(n) if p[i] == -1]
    assert all(kids[j + 1] == [i for i in range(n) if p[i] == j] for j in range(n))
    leaves = [i for i in range(n) if i not in p]
    paths = [list(reversed(ancestors_of(p, leaf))) + [leaf] for leaf in leaves]
    width = max(len(path) for path in paths)
    assert structure.leaf_paths(parents).tolist() == [path + [-1] * (width - len(path)) for path in paths]


@settings(max_examples=100, deadline=None)
@given(trees(), st.integers(0, 4), st.integers(4, 20))
def test_verification_inputs_match_slow_reference(parents, pending, context_length):
    p = parents.tolist()
    n = len(p)
    positions, mask = structure.verification_inputs(parents, pending, context_length)
    assert positions.tolist() == list(range(context_length - pending, context_length)) + [
        context_length + len(ancestors_of(p, i)) for i in range(n)
    ]
    for row in range(pending + n):
        for col in range(pending + n):
            if row < pending:
                want = col <= row
            elif col < pending:
                want = True
            else:
                i, j = row - pending, col - pending
                want = j == i or j in ancestors_of(p, i)
            assert bool(mask[row, col]) == want, (row, col)


scores_strategy = st.one_of(
    st.floats(0.0, 1.0, allow_nan=False),
    st.sampled_from([0.0, 0.25, 0.5, 1.0]),  # coarse values: plenty of ties
)


@settings(max_examples=200, deadline=None)
@given(trees(), st.data(), st.integers(0, 16))
def test_top_nodes_is_ancestor_closed_and_keeps_the_best(parents, data, budget):
    p = parents.tolist()
    n = len(p)
    scores = torch.tensor(data.draw(st.lists(scores_strategy, min_size=n, max_size=n)), dtype=torch.float64)
    keep = structure.top_nodes(parents, scores, budget).tolist()
    assert keep == sorted(set(keep))  # ascending, no repeats
    kept = set(keep)
    assert all(set(ancestors_of(p, i)) <= kept for i in keep)  # closed under ancestors
    # the `budget` best nodes (ties to the earlier node) are kept, and anything more is an ancestor of one
    best = sorted(range(n), key=lambda i: (-float(scores[i]), i))[: min(budget, n)]
    assert set(best) <= kept
    needed = set(best).union(*(ancestors_of(p, i) for i in best)) if best else set()
    assert kept == needed
    # the kept nodes form a valid tree whose parent links are the original ones
    sub = structure.select(parents, torch.tensor(keep, dtype=torch.long))
    structure.check(sub)
    assert [keep[j] if j != -1 else -1 for j in sub.tolist()] == [p[i] for i in keep]


@settings(max_examples=150, deadline=None)
@given(trees(), st.data(), st.integers(0, 16))
def test_top_nodes_with_monotone_scores_takes_exactly_the_budget(parents, data, budget):
    """Scores that never grow down a path (cumulative products, possibly with ties): the top `budget`
    nodes are closed under ancestors by themselves, so no extra node comes in."""
    p = parents.tolist()
    n = len(p)
    factors = data.draw(st.lists(st.sampled_from([1.0, 0.5, 0.9, 0.3, 1.0]), min_size=n, max_size=n))
    scores = []
    for i in range(n):
        scores.append(factors[i] * (scores[p[i]] if p[i] != -1 else 1.0))
    keep = structure.top_nodes(parents, torch.tensor(scores, dtype=torch.float64), budget).tolist()
    assert len(keep) == min(budget, n)
    assert all(set(ancestors_of(p, i)) <= set(keep) for i in keep)


# --- Tries of weighted continuations (tree.trie) -----------------------------------------------------


def slow_weighted_trie(sequences, weights):
    """The obvious trie: each sequence in turn, token by token, a node at first sight of its prefix, its
    weight summed in sequence order. -> (tokens, parents, weights)"""
    tokens, parents, summed, index = [], [], [], {}
    for sequence, row in zip(sequences, weights):
        parent = structure.ROOT
        for token, weight in zip(sequence, row):
            node = index.get((parent, token))
            if node is None:
                node = index[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                summed.append(0.0)
            summed[node] += weight
            parent = node
    return tokens, parents, summed


def test_trie_by_hand():
    trie = build_trie(stack([(4, 5), (4, 6), (7, 5), (4, 5), ()]))
    assert trie.tokens.tolist() == [4, 5, 6, 7, 5] and trie.parents.tolist() == [-1, 0, 0, -1, 3]
    assert trie.weights.tolist() == [3, 2, 1, 1, 1] and trie.total == 5
    by_depth = build_trie(stack([(4, 5), (4, 6), (7, 5), (4, 5)]), by_depth=True)
    assert by_depth.tokens.tolist() == [4, 7, 5, 6, 5] and by_depth.parents.tolist() == [-1, -1, 0, 0, 1]
    weighted = build_trie(stack([(1, 2), (1, 3)]), stack([(0.5, 0.25), (0.125, 0.0625)], 0.0, float))
    assert weighted.weights.tolist() == [0.625, 0.25, 0.0625]


@settings(max_examples=300, deadline=None)
@given(sequences=st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=12), data=st.data())
def test_trie_matches_slow_reference(sequences, data):
    weights = [data.draw(st.lists(st.floats(0, 1), min_size=len(s), max_size=len(s))) for s in sequences]
    trie = build_trie(stack(sequences), stack(weights, 0.0, float))
    tokens, parents, summed = slow_weighted_trie(sequences, weights)
    assert trie.tokens.tolist() == tokens and trie.parents.tolist() == parents
    assert trie.weights.tolist() == summed  # bit for bit: summed in the same order
    counted = build_trie(stack(sequences))
    assert counted.weights.tolist() == slow_weighted_trie(sequences, [[1] * len(s) for s in sequences])[2]
    # by depth: the same nodes, depth by depth, in first-seen order within a depth
    by_depth = build_trie(stack(sequences), by_depth=True)
    order = sorted(range(len(tokens)), key=lambda node: (int(structure.depths(torch.tensor(parents))[node]), node))
    new = {old: i for i, old in enumerate(order)}
    assert by_depth.tokens.tolist() == [tokens[i] for i in order]
    assert by_depth.parents.tolist() == [new.get(parents[i], -1) for i in order]
