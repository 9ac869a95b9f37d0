"""How many tree nodes to verify: the budget that maximises expected tokens per unit of time.

A node is accepted with (about) its score: the product of the draft probabilities along its path for a
draft model (EAGLE-2's observation that draft confidence tracks acceptance), a match frequency for
prompt lookup. Verifying the N best nodes then yields 1 + (sum of their scores) tokens in expectation
(the 1 is the correction or bonus token) and costs the drafting already spent plus one target forward
over N + pending tokens, read off the measured cost curve. The drafter's scores are rescaled by how
many nodes verification actually accepted compared with how many the scores predicted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from specdecode.tree import structure
from specdecode.types import Draft, Verdict

if TYPE_CHECKING:
    from specdecode.models.costs import Curve

DECAY = 0.9  # weight of the past in the running calibration
MAX_BUDGET = 64  # nodes a chosen budget verifies at most per step (the measured cost curve ends at 64)


def best_budget(
    scores: Sequence[float],  # descending: the nodes' acceptance estimates
    curve: Curve,
    sunk_cost: float,  # drafting already spent this step, in single-token target forwards
    pending: int = 1,  # context tokens the target forward also carries
    cap: int | None = None,
    base: float = 1.0,  # tokens the forward yields with no draft at all (one per sequence it serves)
) -> int:
    """The N in [0, min(cap, len(scores))] maximising (base + sum(scores[:N])) / (sunk + curve(pending + N))."""
    limit = len(scores) if cap is None else min(cap, len(scores))
    best, best_rate, expected = 0, base / (sunk_cost + curve(pending)), base
    for n in range(1, limit + 1):
        expected += scores[n - 1]
        rate = expected / (sunk_cost + curve(pending + n))
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def prune(
    parents: torch.Tensor,  # [n] a token tree
    scores: torch.Tensor,  # [n] acceptance estimates, never growing from a parent to its child
    curve: Curve | None,  # None: `budget` says how many
    budget: int | None = None,
    cap: int = MAX_BUDGET,
) -> torch.Tensor:
    """The nodes of a scored tree to verify, ascending and closed under ancestors: the `budget` best, or
    (None) as many of the best as maximise expected tokens per unit of time on the cost curve (at most
    `cap`, drafting taken as sunk); [] when none pays. -> [kept]"""
    if budget is None:
        if curve is None:
            raise ValueError("a tree is pruned to what pays on the cost curve, or to a budget: neither was given")
        ranked = torch.sort(scores, descending=True).values[:cap]  # [<= cap]
        budget = best_budget(ranked.tolist(), curve, 0.0, cap=cap)
    if not budget:
        return torch.empty(0, dtype=torch.long, device="cpu")
    return structure.top_nodes(parents, scores, budget)


def cut_chain(draft: Draft, curve: Curve, pending: int = 1) -> Draft:
    """A scored chain cut to the prefix that pays on the cost curve (maybe none of it); other drafts as
    they are. `pending`: context tokens the same target forward carries (more than one where a step feeds
    a prompt, or its last chunk, with the first draft: all but the last are the prompt's cost, `cut_batch`)."""
    # (a lone tree is sized by its drafter's own budget)
    return cut_batch([draft], curve, pending, shared=False, feeding=max(pending - 1, 0))[0]


class Interpolated:
    """A cost curve read between its measured sizes on the line through the two around (beyond the last, as the
    curve says): what a torch forward costs, about linear in its tokens once it is wide, where a step up to the
    next measured size (`CostCurve.__call__`, for llama.cpp's kernels) would make the last few nodes that fill a
    batch's forward up to that size look free."""

    def __init__(self, curve: Curve):
        self.curve, self.sizes = curve, curve.sizes

    def __call__(self, n: int) -> float:
        sizes = self.sizes
        above = next((i for i, size in enumerate(sizes) if size >= n), None)
        if above is None or above == 0 or sizes[above] == n:
            return self.curve(n)
        low, high = sizes[above - 1], sizes[above]
        start, end = self.curve(low), self.curve(high)
        return start + (end - start) * (n - low) / (high - low)


def cut_batch(drafts: list[Draft], curve: Curve, pending: int, shared: bool = True, feeding: int = 0,
              probe: Callable[[int], int | None] | None = None) -> list[Draft]:
    """The drafts of sequences that share one target forward, cut together: every scored token of every scored
    chain, and where the forward is `shared` by several sequences (the batch engine's) of every scored tree
    (sent without distributions), competes for the forward, the best-scored first (a node's score capped by its
    parent's, ties to the shallower, so each keeps a prefix, or a subtree closed under ancestors), as many as
    maximise expected tokens (one per sequence plus the scores) per cost of the whole forward (of a `shared` one
    read `Interpolated`: the batch engine runs on torch). So the larger the batch, the less each sequence drafts,
    down to nothing where the curve says a wider forward no longer pays. `pending`: the context tokens of all
    sequences the forward carries. Other drafts go as they are, their tokens counted.

    `feeding`: how many of the pending tokens are prompt tokens fed beside the decoding (a prompt's chunk, or
    the prefix of a prompt fed whole with its first draft), which yield no token this step. Their cost is the
    prompt's, not speculation's: the drafts are priced as if the decoding sequences ran alone, plus what the
    drafts add to the wider forward (`Beside`). Counted in the whole forward instead, a prompt's chunk makes
    the step look so dear per token that every draft node seems to pay, however poor its score: the chunk's
    step then grows by every sequence's drafts, and every sequence waits for it.

    `probe`: told the forward's width as cut, it may name a wider one to time again (`LiveCurve.probe`): the next
    best nodes then fill the forward up to that width, if there are as many. Without it a width the gate stopped
    letting through would keep the price it was last timed at, however wrong."""
    scored = {i: d for i, d in enumerate(drafts)  # the drafts cut, by index
              if d.scores is not None and len(d) and (not d.is_tree or (shared and d.probs is None))}
    fixed = pending + sum(len(d) for i, d in enumerate(drafts) if i not in scored)
    ranked = sorted(((score, depth, i, node) for i, d in scored.items() for node, (score, depth)
                     in enumerate(_capped(d))), key=lambda c: (-c[0], c[1]))
    # no wider than the largest measured forward: beyond it the curve is a guess (on llama.cpp a 65-token
    # forward costs far more than the line through 48 and 64 says: docs/results/code-choices.md). A `shared`
    # forward runs on torch, about linear once wide: there the cap bounds the decoding alone, and drafts beside
    # a prompt's chunk cost what they add to it (else a chunk of 64 tokens or more would leave every sequence
    # decoding beside it without a draft)
    cap = max(curve.sizes[-1] - (fixed - feeding if shared else fixed), 0)
    cost: Curve = Interpolated(curve) if shared else curve
    if feeding:
        cost = Beside(cost, fixed - feeding, feeding)
    count = best_budget([c[0] for c in ranked], cost, 0.0, pending=fixed - feeding, cap=cap,
                        base=float(len(drafts)))
    wider = None if probe is None else probe(fixed + count)  # (`LiveCurve.probe`: a width to time again)
    if wider is not None:  # the next best nodes fill the forward up to it (any prefix of `ranked` is closed)
        count = min(len(ranked), max(count, wider - fixed))
    keep: dict[int, list[int]] = {i: [] for i in scored}
    for _, _, i, node in ranked[:count]:
        keep[i].append(node)
    return [d if i not in keep else _subtree(d, keep[i]) if d.is_tree else d.prefix(len(keep[i]))
            for i, d in enumerate(drafts)]


class Beside:
    """The cost of a forward's decoding when prompt tokens ride in it (`cut_batch`'s `feeding`): n decoding tokens
    (pending and drafted) cost what they would alone up to the `decoding` the step carries anyway, and each one
    beyond, what it adds to the forward that also feeds the prompt tokens."""

    def __init__(self, curve: Curve, decoding: int, feeding: int):
        self.curve, self.decoding, self.feeding = curve, decoding, feeding
        self.sizes = curve.sizes
        self._base, self._whole = curve(decoding), curve(decoding + feeding)

    def __call__(self, n: int) -> float:
        if n <= self.decoding:
            return self.curve(n)
        return self._base + self.curve(n + self.feeding) - self._whole


def _capped(draft: Draft) -> list[tuple[float, int]]:
    """(score, depth) of each node: a chain's as they are, a tree's capped by its parent's."""
    scores = draft.scores.tolist() if draft.scores is not None else []
    if draft.parents is None:
        return [(float(s), j + 1) for j, s in enumerate(scores)]
    out: list[tuple[float, int]] = []
    for score, parent in zip(scores, draft.parents.tolist()):
        above = (1.0, 0) if parent == structure.ROOT else out[parent]
        out.append((min(float(score), above[0]), above[1] + 1))
    return out


def _subtree(draft: Draft, keep: list[int]) -> Draft:
    """A tree draft's nodes `keep` (closed under ancestors), in their order."""
    if len(keep) == len(draft):
        return draft
    assert draft.parents is not None and draft.scores is not None
    index = torch.tensor(sorted(keep), dtype=torch.long, device="cpu")
    return Draft(tokens=draft.tokens[index], parents=structure.select(draft.parents, index),
                 scores=draft.scores[index], auxiliary=draft.auxiliary, forced=min(draft.forced, len(keep)),
                 prepended=min(draft.prepended, len(keep)))


class Calibration:
    """The running ratio of accepted draft tokens to the number the drafter's scores predicted."""

    def __init__(self, low: float = 0.25, high: float = 1.5):
        self.low, self.high = low, high
        self.observed = self.predicted = 0.0

    def reset(self) -> None:
        self.observed = self.predicted = 0.0

    def record(self, predicted: float, observed: int) -> None:
        self.predicted = DECAY * self.predicted + predicted
        self.observed = DECAY * self.observed + observed

    def record_verdict(self, scores, verdict: Verdict) -> None:
        """Learn from a step whose draft carried `scores` (one per node, tensor or array): the first
        `num_drafted` nodes were verified (all of a tree, the prefix of a chain the engine kept)."""
        if verdict.num_drafted:
            self.record(float(scores[: verdict.num_drafted].sum()), verdict.num_accepted)

    @property
    def factor(self) -> float:
        """Multiply a score by this to estimate its acceptance (1 before any evidence)."""
        return min(max((self.observed + 1) / (self.predicted + 1), self.low), self.high)
