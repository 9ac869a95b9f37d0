"""The pure part of a composite drafter (`drafters.composite`): the scores of a draft sent without any, the merge
of several drafts into one trie by shared prefixes, the choice of the nodes to submit, and the verdict a draft
would have had verified alone (the composite's docstring says why each is what it is)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdecode.devices import to_device
from specdecode.models.costs import CostCurve
from specdecode.tree import structure
from specdecode.tree.budget import best_budget, prune
from specdecode.tree.trie import best_path
from specdecode.types import DeviceLayout, Draft, Verdict

DROPPED = -2  # a sub-draft node the merge left out (deeper than allowed, or under such a node)

COMBINE: dict[str, Callable[[float, float], float]] = {
    "max": max,
    "noisy-or": lambda a, b: 1.0 - (1.0 - a) * (1.0 - b),
}


# --- Pure functions: scores, merging, selection, translation ------------------------------------


def parents_of(draft: Draft) -> torch.Tensor:
    """A draft's parents, a chain's included. -> [n]"""
    return draft.parents if draft.parents is not None else structure.chain(len(draft))


def default_scores(draft: Draft, rate: float) -> torch.Tensor:
    """Scores for a draft that came without any: each token right with chance `rate` given its path,
    siblings sharing their parent's chance evenly. -> [n] float32 (a chain: rate, rate^2, ...)"""
    parents = parents_of(draft).tolist()
    siblings = [0] * (len(parents) + 1)  # [node + 1]: how many children node has; [0]: the context's
    for parent in parents:
        siblings[parent + 1] += 1
    scores: list[float] = []
    for parent in parents:
        above = 1.0 if parent == structure.ROOT else scores[parent]
        scores.append(above * rate / siblings[parent + 1])
    return torch.tensor(scores, dtype=torch.float32, device="cpu")


@dataclass
class Merged:
    """Drafts merged into one trie. Parallel lists, one entry per node, parents before children."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    mappings: list[list[int]]  # per draft: its node i -> the merged node (DROPPED: left out)


def merge(
    drafts: Sequence[Draft],
    scores: Sequence[torch.Tensor],  # [len(draft)] each, the chance each node's path is accepted
    combine: str = "max",
    max_depth: int | None = None,
) -> Merged:
    """Merge chains and trees into one trie by shared prefixes.

    A node proposed by several drafts combines their scores with `combine` (within one draft, where a
    sampled tree may repeat a sibling, always by max: it is one proposal). Nodes deeper than `max_depth`
    are left out. Finally each node's score is capped by its parent's: a path is accepted no more often
    than its prefix.
    """
    join = COMBINE[combine]
    merged = Merged([], [], [], [])
    depths: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for draft, draft_scores in zip(drafts, scores):
        mapping: list[int] = []
        best: dict[int, float] = {}  # merged node -> this draft's score for it
        for token, parent, score in zip(draft.tokens.tolist(), parents_of(draft).tolist(), draft_scores.tolist()):
            above = structure.ROOT if parent == structure.ROOT else mapping[parent]
            depth = 1 if above == structure.ROOT else depths[above] + 1 if above != DROPPED else None
            if depth is None or (max_depth is not None and depth > max_depth):
                mapping.append(DROPPED)
                continue
            node = index.get((above, token))
            if node is None:
                node = index[(above, token)] = len(merged.tokens)
                merged.tokens.append(token)
                merged.parents.append(above)
                merged.scores.append(0.0)
                depths.append(depth)
            best[node] = max(best.get(node, 0.0), min(max(float(score), 0.0), 1.0))
            mapping.append(node)
        for node, score in best.items():
            merged.scores[node] = join(merged.scores[node], score)  # join(0, s) == s for both rules
        merged.mappings.append(mapping)
    for node, parent in enumerate(merged.parents):  # parents come first
        if parent != structure.ROOT:
            merged.scores[node] = min(merged.scores[node], merged.scores[parent])
    return merged


def select(
    parents: torch.Tensor,  # [n]
    scores: torch.Tensor,  # [n] acceptance estimates, never growing from a parent to its child
    curve: CostCurve,
    budget: int | None = None,
    tree: bool = True,
) -> torch.Tensor:
    """The nodes to submit, ascending and closed under ancestors. A tree: the `budget` best, or as many
    as pay on the cost curve (at most MAX_BUDGET). A chain: the best path, cut to the prefix that pays.
    -> [kept]"""
    if not parents.numel():
        return torch.empty(0, dtype=torch.long, device="cpu")
    if tree:
        return prune(parents, scores, curve, budget)
    path = best_path(parents, scores)
    return path[: best_budget(scores[path].tolist(), curve, 0.0)]


def translate(draft: Draft, output: Sequence[int]) -> Verdict:
    """The verdict `draft` would have had, verified alone, in a step whose output (accepted tokens, then
    the correction or bonus token) was `output` (see the module docstring)."""
    tokens = draft.tokens.tolist()
    kids = structure.children(parents_of(draft))
    node, path = structure.ROOT, []
    for token in output:
        child = next((c for c in kids[node + 1] if tokens[c] == token), None)
        if child is None:
            break
        path.append(child)
        node = child
    if output and len(path) == len(output):  # it foresaw even the last token: nothing rejected, the rest unknown
        path.pop()
        bonus = True
    else:
        bonus = not kids[node + 1]
    return Verdict(num_drafted=len(tokens), num_accepted=len(path), tokens=tuple(output[: len(path) + 1]),
                   path=tuple(path), bonus=bonus)


def surviving(submitted: Draft, verified: Draft) -> dict[int, int]:
    """Where each node of a submitted tree that a pruning kept is in the tree verified (its nodes, ancestors first,
    a subtree of the submitted one: a batch's gate cut it, `tree.budget.cut_batch`): submitted -> verified index."""
    assert submitted.parents is not None and verified.parents is not None
    index = {(parent, token): i for i, (parent, token)
             in enumerate(zip(submitted.parents.tolist(), submitted.tokens.tolist()))}
    back: dict[int, int | None] = {structure.ROOT: structure.ROOT}
    where: dict[int, int] = {}
    for k, (parent, token) in enumerate(zip(verified.parents.tolist(), verified.tokens.tolist())):
        above = back[parent]
        node = back[k] = index.get((above, token)) if above is not None else None  # (None: not submitted)
        if node is not None:
            where[node] = k
    return where


def beside(tree: Draft, nodes: Draft) -> Draft:
    """A tree made on the device (`Draft.layout`) and host-made nodes (a tree or a chain) side by side as one
    forest on the device: the tree's nodes first, then the others, each part under the context as it was. Nothing
    is read: where both parts propose the same path it is verified twice, which a wide forward costs little of
    where such trees are made (off the CPU). The forest's riders are the tree's, then the forest's tokens, so that
    its verdict's one transfer brings what the tree's drafter and the caller learn from."""
    layout = tree.layout
    assert layout is not None and tree.parents is not None and tree.scores is not None
    device, first = tree.tokens.device, len(tree)
    parents = parents_of(nodes)
    shifted = torch.where(parents == structure.ROOT, parents, parents + first)
    ancestors = torch.zeros(first + len(nodes), first + len(nodes), dtype=torch.bool, device=device)
    ancestors[:first, :first] = layout.ancestors
    ancestors[first:, first:] = to_device(structure.ancestor_mask(parents), device)
    scores = nodes.scores if nodes.scores is not None else torch.ones(len(nodes), device="cpu")
    tokens = torch.cat([tree.tokens, to_device(nodes.tokens, device)])
    return Draft(tokens=tokens, parents=torch.cat([tree.parents, to_device(shifted, device)]),
                 scores=torch.cat([tree.scores, to_device(scores, device).to(tree.scores.dtype)]),
                 auxiliary=nodes.auxiliary, layout=DeviceLayout(ancestors, torch.cat(
                     [layout.depths, to_device(structure.depths(parents), device)])), riders=(*tree.riders, tokens))
