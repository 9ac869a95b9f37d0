"""Token trees as pure functions of one tensor: the parent index of every node.

A tree's structure is host data, whatever device its tokens live on: `parents` and everything derived
from it here are CPU tensors (a model's forward moves the positions and mask it needs to its device).

A tree of n nodes is `parents: [n] int64` with parents[i] < i (parents come first) and -1 for the nodes
that follow the context directly. Everything the target needs to verify the tree in one forward is
derived from it:

- the depth of each node (1 for the children of the context), hence its position id;
- the tree attention mask: node i attends to node j iff j is i or an ancestor of i;
- the root-to-leaf paths, as node indices.

The tuple-path "choices" format of Medusa, EAGLE and vLLM (`(0,)`, `(0, 1)`, ... each the ranks of the
tokens along a path) converts to parents with `from_choices`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specdecode.errors import UserError

ROOT = -1  # the parent of the nodes that follow the context


def check(parents: torch.Tensor) -> None:
    """Raise ValueError unless every parent index is -1 or an earlier node."""
    n = parents.numel()
    if n and not bool(((parents >= ROOT) & (parents < torch.arange(n, device=parents.device))).all()):
        raise ValueError(f"a tree needs -1 <= parents[i] < i for every node, got {parents.tolist()}")


def chain(n: int) -> torch.Tensor:
    """The parents of a chain of n nodes. -> [n]"""
    return torch.arange(n, device="cpu") - 1


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Distance of each node from the context (children of the context: 1). [n] -> [n]"""
    depth: list[int] = []  # (on the host in Python: a step builds several, and an element of a tensor costs more)
    for parent in parents.tolist():
        depth.append(1 if parent == ROOT else depth[parent] + 1)
    return torch.tensor(depth, dtype=torch.long, device="cpu")


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """mask[i, j] is True iff node j is node i or one of its ancestors. [n] -> [n, n] bool"""
    n = parents.numel()
    mask = np.eye(n, dtype=bool)  # (numpy rows: a tensor's row operations cost several times more)
    for i, parent in enumerate(parents.tolist()):
        if parent != ROOT:
            mask[i] |= mask[parent]  # the parent's row is complete: parents come first
    return torch.from_numpy(mask)


def children(parents: torch.Tensor) -> list[list[int]]:
    """children(parents)[i + 1] lists node i's children in order; [0] lists the context's."""
    kids: list[list[int]] = [[] for _ in range(parents.numel() + 1)]
    for i, parent in enumerate(parents.tolist()):
        kids[parent + 1].append(i)
    return kids


def leaf_paths(parents: torch.Tensor) -> torch.Tensor:
    """Node indices of every root-to-leaf path, shallowest first, padded with -1.

    [n] -> [num_leaves, max_depth] int64, leaves in node order.
    """
    n = parents.numel()
    if n == 0:
        return torch.empty(0, 0, dtype=torch.long, device="cpu")
    has_child = torch.zeros(n, dtype=torch.bool, device="cpu")
    has_child[parents[parents != ROOT]] = True
    leaves = (~has_child).nonzero().flatten().tolist()
    mask = ancestor_mask(parents)
    depth = depths(parents)
    paths = torch.full((len(leaves), int(depth.max())), -1, dtype=torch.long, device="cpu")
    for row, leaf in enumerate(leaves):
        nodes = mask[leaf].nonzero().flatten()  # ancestors and the leaf, in node order = by depth
        paths[row, : nodes.numel()] = nodes
    return paths


def from_choices(choices: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Parents and token ranks of a tree given as Medusa/EAGLE "choices".

    Each choice is the path of ranks from the context to a node: (0,) is the likeliest token after the
    context, (0, 1) the second likeliest after that. Every prefix of a choice must be a choice too.
    Returns (parents [n], ranks [n]), nodes sorted by depth then ranks.
    """
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    if not paths or any(len(c) == 0 or min(c) < 0 for c in paths):
        raise UserError("tree choices must be non-empty tuples of ranks >= 0, e.g. [(0,), (1,), (0, 0)]")
    index = {c: i for i, c in enumerate(paths)}
    parents, ranks = [], []
    for c in paths:
        if len(c) > 1 and c[:-1] not in index:
            raise UserError(f"tree choice {c} has no parent {c[:-1]} in the choices")
        parents.append(index[c[:-1]] if len(c) > 1 else ROOT)
        ranks.append(c[-1])
    return torch.tensor(parents, device="cpu"), torch.tensor(ranks, device="cpu")


def select(parents: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The parents of the subtree made of the nodes `keep` (sorted, and closed under ancestors).

    parents: [n]; keep: [m] node indices, ascending. -> [m], indexed within the subtree.
    """
    # in lists: a step selects a few small subtrees, where each tensor operation's fixed cost is most of the work
    kept, of = keep.tolist(), parents.tolist()
    new_index = {ROOT: ROOT} | {node: i for i, node in enumerate(kept)}
    try:
        sub = [new_index[of[node]] for node in kept]
    except KeyError:
        raise ValueError("the kept nodes are not closed under ancestors") from None
    return torch.tensor(sub, dtype=torch.long, device="cpu")


def top_nodes(parents: torch.Tensor, scores: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` highest-scoring nodes, closed under ancestors, ascending. -> [about budget]

    With scores that never grow from a parent to its child (cumulative probabilities, match counts),
    the top nodes are already closed under ancestors; ties go to the earlier node, i.e. the parent.
    """
    n = parents.numel()
    if budget >= n:
        return torch.arange(n, device="cpu")
    of, score = parents.tolist(), scores.tolist()  # (lists: a step's trees are small, see `select`)
    chosen = sorted(range(n), key=lambda node: -score[node])[:budget]  # a stable sort: ties, the earlier node first
    keep = set(chosen)
    for node in chosen:  # close under ancestors all the same, should a score ever grow down a path
        parent = of[node]
        while parent != ROOT and parent not in keep:
            keep.add(parent)
            parent = of[parent]
    return torch.tensor(sorted(keep), dtype=torch.long, device="cpu")


def verification_inputs(
    parents: torch.Tensor, num_pending: int, context_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and attention mask for one target forward over the pending context tokens followed
    by the tree's nodes.

    The last `num_pending` context tokens are not in the cache yet; they attend causally to each other,
    and every node attends to all of them and to its own ancestors. Node i sits at position
    context_length - 1 + depth(i). Returns (positions [p + n], mask [p + n, p + n] bool).
    """
    return inputs_of(ancestor_mask(parents), depths(parents), num_pending, context_length)


def inputs_of(above: torch.Tensor, depth: torch.Tensor, num_pending: int, context_length: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`verification_inputs` from the tree's ancestor mask [n, n] and depths [n], made where they are (a tree grown
    on the device: `tree.growth`)."""
    n, p, device = depth.numel(), num_pending, depth.device
    positions = torch.cat([
        torch.arange(context_length - p, context_length, device=device),
        context_length - 1 + depth,
    ])  # [p + n]
    mask = torch.zeros(p + n, p + n, dtype=torch.bool, device=device)
    mask[:p, :p] = torch.ones(p, p, dtype=torch.bool, device=device).tril()
    mask[p:, :p] = True
    mask[p:, p:] = above
    return positions, mask


def chain_inputs(num_tokens: int, num_pending: int, context_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and attention mask for one target forward over the pending context tokens followed by
    a chain draft, `num_tokens` in all: consecutive positions after the cache, each token attending to
    those before it. Returns (positions [num_tokens], mask [num_tokens, num_tokens] bool)."""
    start = context_length - num_pending  # the cache's length
    return (torch.arange(start, start + num_tokens, device="cpu"),
            torch.ones(num_tokens, num_tokens, dtype=torch.bool, device="cpu").tril())
