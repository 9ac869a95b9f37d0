"""A dynamic token tree grown on the device: every round queued, the whole tree read on the host once.

EAGLE-2's growth (`drafters.draft_model_tree`) reads each round's top tokens on the host and decides there
whether another round pays. On a CPU that read is free; on a GPU each one waits for everything queued, so a
tree of ten rounds waited ten times a step. Here the rounds' choices stay on the device: which nodes of the
newest layer to expand (the `width` best by score, `torch.topk`), their tokens, the rows of the mask that let
each see its ancestors among the nodes already fed, and their children (the top-k of each expanded node's
distribution, scored by the product of the probabilities along the path). How many rounds to grow is the
host's, chosen before the tree starts (the drafter decides it from the trees before: `DraftModelTreeDrafter`),
so no shape depends on a value read from the device.

Node numbering is the host growth's: the root's children first, then each round's children in the order of
the nodes expanded (by score, best first) and of their ranks; parents always come before their children.

The tree can be pruned on the device too (`select`: its best nodes, their ancestor mask and depths), and then
verified there (`verify.tree.verify_tree_on_device`, its forward's inputs from `structure.inputs_of`), so that the
step's one read is its verdict's.
"""

from __future__ import annotations

import torch

from specdecode import devices


class DeviceTree:
    """The tree while it grows on the device: its nodes' tokens, parents and scores, a round's tensors each.

    `values` and `tokens` [k]: the root's children (their scores are their probabilities). Each round then
    `expand`s and `add`s the children of the nodes it expanded."""

    def __init__(self, values: torch.Tensor, tokens: torch.Tensor, width: int, rounds: int):
        self.top_k, self.width = values.numel(), width
        device = values.device
        self.tokens, self.scores = [tokens], [values]
        self.parents = [torch.full((values.numel(),), -1, dtype=torch.long, device=device)]
        self.count = values.numel()  # nodes so far
        self.layer = 0  # the first node of the newest layer
        self.picked: torch.Tensor | None = None  # the newest layer's nodes expanded last, by their index in it
        # which fed node sees which (itself and its ancestors), over the nodes fed so far in the order fed
        self.seen = torch.zeros(rounds * width, rounds * width, dtype=torch.bool, device=device)
        self.fed = 0
        self.last_width = 0  # nodes the last round fed

    def expand(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The next round's nodes: the `width` best of the newest layer. Returns (their tokens [w], the row of
        each one's parent among the nodes the last round fed (None in the first round: the root's), the mask
        [w, fed + w] bool over the nodes fed before and these: each sees its ancestors and itself), all on
        the device."""
        newest = self.scores[-1]
        w = min(self.width, newest.numel())
        self.picked = torch.topk(newest, w).indices  # [w], best first
        eye = torch.eye(w, dtype=torch.bool, device=newest.device)
        if self.last_width:  # a parent is a node the last round fed: its row says what it sees
            parent_rows = torch.div(self.picked, self.top_k, rounding_mode="floor")  # [w]
            above = self.seen[self.fed - self.last_width + parent_rows, : self.fed]  # [w, fed]
        else:  # the root's children: nothing fed before them
            parent_rows, above = None, torch.zeros(w, self.fed, dtype=torch.bool, device=newest.device)
        mask = torch.cat([above, eye], dim=1)  # [w, fed + w]
        self.seen[self.fed : self.fed + w, : self.fed + w] = mask
        return self.tokens[-1][self.picked], parent_rows, mask

    def add(self, values: torch.Tensor, tokens: torch.Tensor) -> None:
        """The expanded nodes' children: values and tokens [w, k], each row the top-k of one node's distribution."""
        assert self.picked is not None, "add follows expand"
        w, k = values.shape
        scores = (self.scores[-1][self.picked][:, None] * values).reshape(-1)  # [w * k]
        parents = (self.layer + self.picked).repeat_interleave(k)
        self.tokens.append(tokens.reshape(-1))
        self.scores.append(scores)
        self.parents.append(parents)
        self.layer, self.count = self.count, self.count + w * k
        self.fed, self.last_width, self.top_k = self.fed + w, w, k

    def nodes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, parents, scores) [nodes] of the tree so far, on the device."""
        return torch.cat(self.tokens), torch.cat(self.parents), torch.cat(self.scores)


def top_paths(values: torch.Tensor, indices: torch.Tensor, max_nodes: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Medusa's tree on the device: the paths through each depth's top-k choices (values and indices [depth, k],
    the heads' probabilities and draft indices), a node's score the product of its path's probabilities, each
    depth kept to its `max_nodes` best before the next is grown (a node among the tree's best keeps its ancestors
    among them: scores never grow down a path). (draft indices, parents, scores) [nodes], a depth after another,
    parents first; `drafters.medusa.best_first` finds the same best nodes on the host."""
    device, k = values.device, values.shape[1]
    above_scores = torch.ones(1, device=device)  # the previous depth's kept nodes (first: the context)
    above_nodes = torch.full((1,), -1, dtype=torch.long, device=device)
    tokens, parents, scores, count = [], [], [], 0
    for depth in range(values.shape[0]):
        candidates = (above_scores[:, None] * values[depth][None, :]).reshape(-1)  # [above * k]
        m = min(max_nodes, candidates.numel())
        kept = torch.topk(candidates, m).indices.sort().values  # [m], in the candidates' order
        tokens.append(indices[depth].repeat(above_scores.numel())[kept])
        parents.append(above_nodes.repeat_interleave(k)[kept])
        scores.append(candidates[kept])
        above_scores, above_nodes = scores[-1], count + torch.arange(m, device=device)
        count += m
    return torch.cat(tokens), torch.cat(parents), torch.cat(scores)


def ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """Which node sees which, [n, n] bool (itself and its ancestors), of a tree at most `depth` deep, on the device of
    its `parents` [n]: `structure.ancestor_mask` without a read."""
    n = parents.numel()
    nodes = torch.arange(n, device=parents.device)
    above = nodes[:, None] == nodes[None, :]
    hop = parents
    for _ in range(depth - 1):  # each step adds every node's ancestor one level higher
        above = above | ((hop[:, None] == nodes[None, :]) & (hop >= 0)[:, None])
        hop = torch.where(hop >= 0, parents[hop.clamp(min=0)], hop)
    return above


def select(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, budget: int, depth: int
           ) -> tuple[torch.Tensor, ...]:
    """The `budget` best nodes by score of a tree at most `depth` deep, on the device, in their order (closed under
    ancestors: a score never grows from a parent to its child, and a tie goes to the earlier node, the parent):
    (tokens, parents renumbered among them, scores, which sees which [b, b] bool, depths [b]),
    b = min(budget, nodes)."""
    b = min(budget, tokens.numel())
    kept = torch.sort(scores, descending=True, stable=True).indices[:b].sort().values  # [b]
    renumbered = torch.full((tokens.numel() + 1,), -1, dtype=torch.long, device=tokens.device)
    renumbered[kept + 1] = torch.arange(b, device=tokens.device)  # slot 0: the context
    kept_parents = renumbered[parents[kept] + 1]
    above = ancestors(kept_parents, depth)
    return tokens[kept], kept_parents, scores[kept], above, above.sum(1)


def best_paths(probs: torch.Tensor, top_k: int, max_nodes: int, budget: int) -> tuple[torch.Tensor, ...]:
    """Medusa's tree from the heads' distributions probs [depth, V'] (`top_paths` over each head's `top_k` best, at
    most `max_nodes` a depth), its `budget` best nodes kept (`select`): (draft indices, parents, scores, which sees
    which, depths) of the kept nodes, and the tree's best scores, best first (at most `max_nodes`). One step function
    of fixed shapes for a depth and budget: on a GPU, one CUDA graph (`drafters.medusa`)."""
    top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)  # [depth, k]
    ids, parents, scores = top_paths(top.values, top.indices, max_nodes)
    kept = select(ids, parents, scores, budget, probs.shape[0])
    return (*kept, torch.topk(scores, min(max_nodes, scores.numel())).values)


def layer_sizes(first: int, top_k: int, width: int, rounds: int) -> list[int]:
    """The number of nodes in each layer of a tree `DeviceTree` grows: `first` children of the root, then each
    round's top_k children of the (at most) `width` nodes it expands."""
    sizes = [first]
    for _ in range(rounds):
        sizes.append(min(width, sizes[-1]) * top_k)
    return sizes


def read_tree(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, sizes: list[int]
              ) -> tuple[list[int], list[int], list[float], list[int]]:
    """A tree grown on the device ([nodes] each, its layers `sizes` long) read on the host in one transfer: (tokens,
    parents, scores, the first node of each layer), without the nodes the processed distribution excluded (score 0:
    never accepted), whose children score 0 too."""
    tokens_, parents_, scores_ = devices.to_host(tokens, parents, scores)
    kept = [node for node, score in enumerate(scores_) if score > 0]  # closed under ancestors (scores shrink)
    index = {node: i for i, node in enumerate(kept)}
    return ([tokens_[node] for node in kept], [index.get(parents_[node], -1) for node in kept],
            [scores_[node] for node in kept], _starts(kept, sizes))


def positive(scores: list[float], sizes: list[int]) -> tuple[list[float], list[int]]:
    """`read_tree`'s scores and layer starts from the scores alone, as read."""
    kept = [node for node, score in enumerate(scores) if score > 0]
    return [scores[node] for node in kept], _starts(kept, sizes)


def _starts(kept: list[int], sizes: list[int]) -> list[int]:
    """Where each layer (`sizes` long) begins among the `kept` nodes (ascending)."""
    starts, first = [], 0
    for size in sizes:
        starts.append(sum(1 for node in kept if node < first))
        first += size
    return starts
