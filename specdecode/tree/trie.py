"""Tries of weighted continuations: token sequences merged by shared prefixes.

Prompt lookup, suffix decoding, lookahead decoding and retrieval all draft the same way: several
continuations of the context (earlier occurrences of its last tokens, n-grams from a pool, a datastore's
matches), each with a weight (how likely it is the right one, per token or as a whole), merged into one
token tree whose node weighs what the continuations through it bring. `build_trie` is that merge, and
`best_path` the chain a trie drafts when trees cannot be verified.

Continuations come as the rows of one array, each padded past its end with PAD. Nodes are numbered in
the order a reader going through the rows one by one, each from its first token, would first meet them
(`by_depth=False`), or depth by depth and in that order within a depth (`by_depth=True`); either way
parents come before their children.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.tree.structure import ROOT, children

PAD = -1  # fills a continuation's row past its end (no token id is negative)


@dataclass(frozen=True)
class Trie:
    """Continuations merged by shared prefixes: parallel arrays, one entry per node, parents first."""

    tokens: np.ndarray  # [n] int64
    parents: np.ndarray  # [n] int64, ROOT (-1): follows the context
    # [n] the continuations' weights at the node's depth, summed (in row order) over those through it;
    # int64 counts of the continuations through it when no weights were given
    weights: np.ndarray
    total: int  # continuations merged (empty ones included)


def stack(sequences: Sequence[Sequence[int] | np.ndarray], fill: float = PAD, dtype=np.int64) -> np.ndarray:
    """Sequences of different lengths as the rows of one array, padded with `fill`. -> [m, longest]"""
    longest = max((len(s) for s in sequences), default=0)
    rows = np.full((len(sequences), longest), fill, dtype=dtype)
    for row, sequence in zip(rows, sequences):
        row[: len(sequence)] = sequence
    return rows


def _sorted(rows: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """The order that sorts the rows lexicographically, equal rows as they came (None: they are sorted
    already, as a datastore's continuations are), and where each sorted row differs from the one above
    ([m - 1, depth] bool)."""
    differ = rows[1:] != rows[:-1]  # [m - 1, depth]
    first = differ.argmax(axis=1)  # [m - 1] the first column where a row differs from the one above (0: none)
    steps = np.arange(rows.shape[0] - 1)
    if bool((rows[1:][steps, first] >= rows[:-1][steps, first]).all()):
        return None, differ
    order = np.lexsort(rows.T[::-1])  # the last key is the primary one
    ranked = rows[order]
    return order, ranked[1:] != ranked[:-1]


def build_trie(rows: np.ndarray, weights: np.ndarray | None = None, by_depth: bool = False) -> Trie:
    """Merge continuations into a trie. rows: [m, depth] int64, each continuation padded past its end
    with PAD (`stack`); weights: [m, depth] float, the weight each continuation brings to its node at
    each depth (None: 1, so a node's weight counts the continuations through it).

    Sorted lexicographically, the rows sharing a prefix are consecutive, so every node is found at once:
    it starts wherever a row's prefix differs from the row above. Weights are summed in row order.
    """
    m, depth = rows.shape
    if not m or not depth:
        empty = np.empty(0, dtype=np.int64)
        return Trie(empty, empty, empty if weights is None else np.empty(0), m)
    order, differ = _sorted(rows)
    ranked = rows if order is None else rows[order]  # [m, depth]
    real = ranked != PAD  # [m, depth] the cells of a continuation
    changed = np.ones((m, depth), dtype=bool)  # [m, depth] the prefix up to the column differs from the row above
    changed[1:] = np.logical_or.accumulate(differ, axis=1)
    group = np.cumsum(changed, axis=0) - 1  # [m, depth] each row's block of equal prefixes, per column
    start_row, start_depth = np.nonzero(changed & real)  # one node per block of a real token
    count = start_row.size
    node_of_block = np.full(depth * m, ROOT, dtype=np.int64)
    node_of_block[start_depth * m + group[start_row, start_depth]] = np.arange(count)
    cell_node = node_of_block[np.arange(depth) * m + group]  # [m, depth] each real cell's node
    parents = np.where(start_depth > 0, cell_node[start_row, np.maximum(start_depth - 1, 0)], ROOT)
    # the first row (as given) through each node decides where it is numbered
    if order is None:  # a node's first row is where its block starts
        first, given_real, given_node = start_row, real, cell_node
    else:
        first = np.full(count, m, dtype=np.int64)
        np.minimum.at(first, cell_node[real], np.broadcast_to(order[:, None], (m, depth))[real])
        restore = np.empty(m, dtype=np.int64)  # [row as given] -> its sorted position
        restore[order] = np.arange(m)
        given_real, given_node = real[restore], cell_node[restore]  # [m, depth] in the rows' given order
    numbering = np.lexsort((first, start_depth) if by_depth else (start_depth, first))  # [n] old node by new index
    new_index = np.empty(count + 1, dtype=np.int64)  # [old node + 1] -> new index; [0]: the context
    new_index[0] = ROOT
    new_index[numbering + 1] = np.arange(count)
    cells = given_node[given_real]  # [cells] each real cell's node, row by row
    summed = np.bincount(cells, minlength=count) if weights is None else np.bincount(
        cells, weights=np.asarray(weights, dtype=np.float64)[given_real], minlength=count)
    tokens = ranked[start_row, start_depth].astype(np.int64)
    return Trie(tokens[numbering], new_index[parents[numbering] + 1], summed[numbering], m)


def best_path(parents: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """From the context down, the highest-scoring child each time (ties: the earlier node). -> [depth]"""
    kids = children(parents)
    values = scores.tolist()
    node, path = ROOT, []
    while kids[node + 1]:
        node = max(kids[node + 1], key=lambda child: (values[child], -child))
        path.append(node)
    return torch.tensor(path, dtype=torch.long, device="cpu")
