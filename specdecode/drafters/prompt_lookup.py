"""Prompt lookup: copy what followed an earlier occurrence of the context's last n-gram.

No model, no cost to speak of: when the output repeats the prompt (code edits, quoting, summaries of a
given text) whole spans are accepted at once; when nothing matches, the step is plain decoding.
"""

from __future__ import annotations

import numpy as np
import torch

from specdecode.drafters.base import Drafter
from specdecode.errors import UserError
from specdecode.models.costs import CostCurve
from specdecode.tree import structure
from specdecode.tree.budget import DECAY, MAX_BUDGET, best_budget, check_budget
from specdecode.types import Draft, SamplingParams, StepStats, Verdict


def find_continuations(context: np.ndarray, ngram: int, max_tokens: int, max_matches: int) -> list[np.ndarray]:
    """What followed each earlier occurrence of the last `ngram` tokens, most recent first (at most
    `max_matches`, each at most `max_tokens` long and non-empty)."""
    length = context.shape[0]
    if length <= ngram or max_matches <= 0:
        return []
    tail = context[length - ngram :]
    # windows[i] = context[i : i + ngram] for every start i whose window ends before the tail begins
    windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], ngram)  # [length - ngram, ngram]
    starts = np.flatnonzero((windows == tail).all(axis=1))[::-1][:max_matches]
    return [context[s + ngram : s + ngram + max_tokens] for s in starts]


def find_continuation(context: np.ndarray, ngram: int, max_tokens: int) -> np.ndarray | None:
    """Tokens that followed the most recent earlier occurrence of the last `ngram` tokens of `context`.

    context: [length] int64. Returns at most max_tokens ids, or None when the n-gram never occurred before.
    """
    found = find_continuations(context, ngram, max_tokens, max_matches=1)  # the most recent: the likeliest
    return found[0] if found else None


def _check_lookup(max_ngram: int, min_ngram: int, num_tokens: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise UserError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    if num_tokens < 1:
        raise UserError(f"prompt lookup needs num_tokens >= 1, got {num_tokens}")


class PromptLookupDrafter(Drafter):
    """Drafts by n-gram matching over the prompt and the output so far (longest n-gram first)."""

    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 10):
        _check_lookup(max_ngram, min_ngram, num_tokens)
        self.max_ngram, self.min_ngram, self.num_tokens = max_ngram, min_ngram, num_tokens

    def propose(self, context, max_tokens, params, generator) -> Draft:
        limit = min(self.num_tokens, max_tokens)
        if limit > 0:
            ids = np.asarray(context, dtype=np.int64)
            for ngram in range(self.max_ngram, self.min_ngram - 1, -1):
                found = find_continuation(ids, ngram, limit)
                if found is not None and found.size:
                    return Draft(tokens=torch.from_numpy(found.copy()))
        return Draft.empty()


class PromptLookupTreeDrafter(Drafter):
    """Prompt lookup with every match at once: the continuations of up to `max_matches` earlier
    occurrences (longest n-grams first) merged into a trie by shared prefixes.

    A node scores the weighted share of the continuations through it (a match of a longer n-gram weighs
    more) times a^depth, where a is the running per-token acceptance; the budget keeps the best nodes,
    a fixed number or the number that maximises expected tokens per unit of time on the cost curve.
    """

    name = "pld-tree"

    def __init__(
        self,
        curve: CostCurve,
        max_ngram: int = 3,
        min_ngram: int = 1,
        num_tokens: int = 10,
        max_matches: int = 8,
        budget: int | None = None,
    ):
        _check_lookup(max_ngram, min_ngram, num_tokens)
        if max_matches < 1:
            raise UserError(f"prompt lookup needs max_matches >= 1, got {max_matches}")
        check_budget(budget)
        self.curve, self.budget = curve, budget
        self.max_ngram, self.min_ngram, self.num_tokens, self.max_matches = max_ngram, min_ngram, num_tokens, max_matches
        self._accepted = self._rejected = 0.0

    def begin(self, prompt_ids: list[int]) -> None:
        self._accepted = self._rejected = 0.0

    @property
    def acceptance(self) -> float:
        """Running chance that the next token of an accepted continuation is accepted (prior 2/3)."""
        return (self._accepted + 2) / (self._accepted + self._rejected + 3)

    def propose(self, context, max_tokens, params, generator) -> Draft:
        limit = min(self.num_tokens, max_tokens)
        if limit <= 0:
            return Draft.empty()
        ids = np.asarray(context, dtype=np.int64)
        # 1. Continuations, longest n-gram first; a shorter n-gram's matches weigh 1/4 as much per level.
        weighted: list[tuple[np.ndarray, float]] = []
        for ngram in range(self.max_ngram, self.min_ngram - 1, -1):
            found = find_continuations(ids, ngram, limit, self.max_matches - len(weighted))
            weighted += [(c, 4.0 ** (ngram - self.max_ngram)) for c in found if c.size]
        if not weighted:
            return Draft.empty()
        # 2. Merge them into a trie; parents are created before their children.
        tokens: list[int] = []
        parents: list[int] = []
        mass: list[float] = []
        index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for continuation, weight in weighted:
            parent = -1
            for token in continuation.tolist():
                node = index.get((parent, token))
                if node is None:
                    node = index[(parent, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                    mass.append(0.0)
                mass[node] += weight
                parent = node
        parents_t = torch.tensor(parents)
        total = sum(w for _, w in weighted)
        scores = torch.tensor(mass) / total * self.acceptance ** structure.depths(parents_t).float()  # [n]
        # 3. Keep the best nodes.
        budget = self.budget or max(best_budget(sorted(scores.tolist(), reverse=True), self.curve, 0.0, cap=MAX_BUDGET), 1)
        keep = structure.top_nodes(parents_t, scores, budget)
        return Draft(tokens=torch.tensor(tokens)[keep], parents=structure.select(parents_t, keep))

    def update(self, verdict: Verdict, stats: StepStats) -> None:
        if verdict.num_drafted:
            self._accepted = DECAY * self._accepted + verdict.num_accepted
            self._rejected = DECAY * self._rejected + (0 if verdict.bonus else 1)
