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


def find_starts(context: np.ndarray, ngram: int, max_matches: int) -> np.ndarray:
    """Where the last `ngram` tokens occurred earlier, most recent first (at most `max_matches`)."""
    length = context.shape[0]
    if length <= ngram or max_matches <= 0:
        return np.empty(0, dtype=np.int64)
    tail = context[length - ngram :]
    # windows[i] = context[i : i + ngram] for every start i whose window ends before the tail begins
    windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], ngram)  # [length - ngram, ngram]
    return np.flatnonzero((windows == tail).all(axis=1))[::-1][:max_matches]


def find_continuations(context: np.ndarray, ngram: int, max_tokens: int, max_matches: int) -> list[np.ndarray]:
    """What followed each earlier occurrence of the last `ngram` tokens, most recent first (at most
    `max_matches`, each at most `max_tokens` long and non-empty)."""
    return [context[s + ngram : s + ngram + max_tokens] for s in find_starts(context, ngram, max_matches)]


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


def match_length(context: np.ndarray, end: int, limit: int) -> int:
    """How many tokens before position `end` equal the last tokens of `context` (at most `limit`)."""
    length = 0
    while length < limit and length < end and context[end - 1 - length] == context[-1 - length]:
        length += 1
    return length


MAX_MATCH = 64  # a longer match than this is no more telling
# Per-token acceptance of a copied continuation, by how long the match behind it is (bucket b holds
# matches of 2^b .. 2^(b+1) - 1 tokens): the prior each request starts from, then learnt from verdicts.
# The longer the text the output already shares with the earlier occurrence, the likelier it goes on
# copying it. The priors are what the 1.5B accepted on the benchmark's code-edit, rag and multi-turn
# prompts under greedy decoding (`benchmarks/copy_acceptance.py` measures them again).
PRIOR_ACCEPTANCE = (0.35, 0.5, 0.65, 0.8, 0.88, 0.92, 0.95)
PRIOR_WEIGHT = 4.0  # the prior counts as this many observed tokens


class CopyAcceptance:
    """Running per-token acceptance of copied continuations, one estimate per match-length bucket."""

    def __init__(self):
        self.accepted = [PRIOR_WEIGHT * q for q in PRIOR_ACCEPTANCE]
        self.rejected = [PRIOR_WEIGHT * (1 - q) for q in PRIOR_ACCEPTANCE]

    @staticmethod
    def bucket(matched: int) -> int:
        return min(max(matched, 1).bit_length() - 1, len(PRIOR_ACCEPTANCE) - 1)

    def estimate(self, bucket: int) -> float:
        return self.accepted[bucket] / (self.accepted[bucket] + self.rejected[bucket])

    def record(self, bucket: int, accepted: int, rejected: bool) -> None:
        self.accepted[bucket] = DECAY * self.accepted[bucket] + accepted
        self.rejected[bucket] = DECAY * self.rejected[bucket] + rejected


class PromptLookupDrafter(Drafter):
    """Drafts by n-gram matching over the prompt and the output so far: the continuation of the most
    recent earlier occurrence of the longest matching n-gram.

    Each draft carries acceptance estimates (a^i for its i-th token, a learnt per length of the match
    behind it, see CopyAcceptance), so the engine verifies only as much of it as pays on the target's
    cost curve: on a backend where verification width is dear, only long, well-matched copies.
    """

    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 32):
        _check_lookup(max_ngram, min_ngram, num_tokens)
        self.max_ngram, self.min_ngram, self.num_tokens = max_ngram, min_ngram, num_tokens
        self._acceptance = CopyAcceptance()
        self._bucket: int | None = None

    def begin(self, prompt_ids: list[int]) -> None:
        self._acceptance = CopyAcceptance()

    def propose(self, context, max_tokens, params, generator) -> Draft:
        self._bucket = None
        limit = min(self.num_tokens, max_tokens)
        if limit <= 0:
            return Draft.empty()
        ids = np.asarray(context, dtype=np.int64)
        for ngram in range(self.max_ngram, self.min_ngram - 1, -1):
            starts = find_starts(ids, ngram, max_matches=1)  # the most recent: the likeliest
            if starts.size:
                end = int(starts[0]) + ngram
                self._bucket = self._acceptance.bucket(match_length(ids, end, MAX_MATCH))
                tokens = torch.from_numpy(ids[end : end + limit].copy())
                rate = self._acceptance.estimate(self._bucket)
                scores = rate ** torch.arange(1, len(tokens) + 1, dtype=torch.float32)
                return Draft(tokens=tokens, scores=scores)
        return Draft.empty()

    def update(self, verdict: Verdict, stats: StepStats) -> None:
        if verdict.num_drafted and self._bucket is not None:
            self._acceptance.record(self._bucket, verdict.num_accepted, not verdict.bonus)


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
        budget = self.budget or best_budget(sorted(scores.tolist(), reverse=True), self.curve, 0.0, cap=MAX_BUDGET)
        if budget == 0:  # no node pays on this cost curve: a plain step
            return Draft.empty()
        keep = structure.top_nodes(parents_t, scores, budget)
        return Draft(tokens=torch.tensor(tokens)[keep], parents=structure.select(parents_t, keep))

    def update(self, verdict: Verdict, stats: StepStats) -> None:
        if verdict.num_drafted:
            self._accepted = DECAY * self._accepted + verdict.num_accepted
            self._rejected = DECAY * self._rejected + (0 if verdict.bonus else 1)
