"""Prompt lookup: copy what followed an earlier occurrence of the context's last n-gram.

No model, no cost to speak of: when the output repeats the prompt (code edits, quoting, summaries of a
given text) whole spans are accepted at once; when nothing matches, the step is plain decoding.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from specdecode.drafters.base import Drafter, Memory, Outcome, RunningAcceptance
from specdecode.drafters.options import DrafterOptions, check_budget
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.models.costs import CostCurve
from specdecode.tree import structure
from specdecode.tree.budget import DECAY, prune
from specdecode.tree.trie import build_trie, stack
from specdecode.types import Draft


def find_starts(context: np.ndarray, ngram: int, max_matches: int) -> np.ndarray:
    """Where the last `ngram` tokens occurred earlier, most recent first (at most `max_matches`)."""
    length = context.shape[0]
    if length <= ngram or max_matches <= 0:
        return np.empty(0, dtype=np.int64)
    tail, count = context[length - ngram :], length - ngram
    # window i = context[i : i + ngram], for every start i whose window ends before the context's last token; compared
    # a column at a time over contiguous slices (a strided view of the windows compared whole took several times more)
    matches = context[:count] == tail[0]  # [count]
    for j in range(1, ngram):
        matches &= context[j : count + j] == tail[j]
    return np.flatnonzero(matches)[::-1][:max_matches]


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
RESUME_WINDOW = 16  # how far past the point where a copy stopped a match still counts as resuming it
JUDGED = 16  # tokens of each proposal judged against the output
RUNNING = 4  # a copy this many tokens long was a real one: where it stops, the output may resume it
# How a copied continuation fares, by the kind of match behind it: bucket b holds matches of
# 2^b .. 2^(b+1) - 1 tokens, the last bucket short matches that resume a copy just past where it
# stopped (an edit: the output left its source for a few new tokens and returns). Per bucket, the
# chance that the first copied token is right, and the chance that each further one is, given the
# ones before it were: a copy either starts or it does not, and once started it mostly runs on. These
# priors are what the 1.5B's greedy outputs gave on the benchmark's prompts, pooled over categories
# (40 prompts, 8 categories, `benchmarks/copy_acceptance.py`; sparse buckets interpolated). Each
# request then learns its own from every proposal, verified or not (see PromptLookupDrafter).
PRIOR_FIRST = (0.22, 0.48, 0.72, 0.82, 0.9, 0.99, 0.99, 0.46)
PRIOR_RUN = (0.63, 0.78, 0.85, 0.9, 0.98, 0.98, 0.99, 0.85)
RESUME = len(PRIOR_FIRST) - 1
PRIOR_WEIGHT = 4.0  # the priors count as this many observations
# A copy is offered at most twice as long as the longest draft this request has had accepted, and at
# least this long: the estimates above are judged on 16-token windows, so past the longest run seen they
# extrapolate, and an answer that quotes its source ends where the source goes on (a RAG answer, an
# edit's last line). Where width is dear (llama.cpp: docs/results/code-choices.md) a long copy's decode costs many
# single-token ones, and
# the replay of the benchmark's outputs (`benchmarks/copy_acceptance.py`) gains on code-edit and rag;
# where it is cheap (PyTorch) the cap doubles away within a few steps.
FIRST_CAP = 16
CHECKED = 8  # the last tokens of the context seen before that must match for the array kept to be extended


class CopyAcceptance:
    """Estimates, per kind of match, of the chance that a copy's first token is accepted and that each
    later token is (given the earlier ones were): the priors, scaled by two factors learnt per request
    from every judged proposal. A request that copies (an edit, a quote) beats the priors everywhere,
    one that does not falls short of them everywhere, so one factor for all kinds of match learns
    from a handful of proposals what separate estimates per kind would need dozens for."""

    def __init__(self):
        # decayed sums: first tokens right and predicted right; later tokens wrong and predicted wrong
        self.first_right = self.first_predicted = self.run_wrong = self.run_predicted = PRIOR_WEIGHT

    @staticmethod
    def bucket(matched: int, resumes: bool = False) -> int:
        if resumes and matched < 8:
            return RESUME
        return min(max(matched, 1).bit_length() - 1, RESUME - 1)

    def rates(self, bucket: int) -> tuple[float, float]:
        """(first token right, each later one right) for a kind of match, in this request so far."""
        first = PRIOR_FIRST[bucket] * self.first_right / self.first_predicted
        run = 1 - (1 - PRIOR_RUN[bucket]) * self.run_wrong / self.run_predicted
        return min(max(first, 0.01), 0.99), min(max(run, 0.01), 0.995)

    def scores(self, bucket: int, n: int) -> torch.Tensor:
        """[n]: the chance that the first 1, 2, ..., n tokens of a copy are all accepted."""
        first, run = self.rates(bucket)
        return first * run ** torch.arange(n, dtype=torch.float32, device="cpu")

    def record(self, bucket: int, right: int, judged: int) -> None:
        """A proposal's first `right` tokens were right, of `judged` compared with the output (a wrong
        token ends the comparison, so right == judged means none was wrong)."""
        self.first_right = DECAY * self.first_right + (right > 0)
        self.first_predicted = DECAY * self.first_predicted + PRIOR_FIRST[bucket]
        if right:
            at_risk = right - 1 + (right < judged)
            self.run_wrong = DECAY * self.run_wrong + (right < judged)
            self.run_predicted = DECAY * self.run_predicted + at_risk * (1 - PRIOR_RUN[bucket])


class PromptLookupDrafter(Drafter):
    """Drafts by n-gram matching over the prompt and the output so far (and a reference document, when
    given): the continuation of an earlier
    occurrence of the longest matching n-gram, the one just past where the last copy stopped if there
    is one (an edit resuming its source), else the most recent.

    Each draft carries acceptance estimates (see CopyAcceptance), so the engine verifies only as much
    of it as pays on the target's cost curve: on a backend where verification width is dear, only
    copies that are likely to run long. The estimates are learnt from every proposal, verified or
    not: prompt lookup costs nothing, so each step's proposal is kept and judged against the output
    as it arrives (the tokens greedy verification would have accepted), which tells a copy-heavy
    request from one that only echoes a word now and then before paying for a single bad draft.
    """

    batchable = True  # no model: one instance per sequence serves a batch
    catches_up = False

    name = "pld"

    def __init__(
        self,
        max_ngram: int = 3,
        min_ngram: int = 1,
        num_tokens: int = 64,
        max_matches: int = 16,
        reference_ids: list[int] | tuple[int, ...] | None = None,
        ramp_up: bool = True,  # offer copies of at most twice the longest accepted run (FIRST_CAP at first)
    ):
        _check_lookup(max_ngram, min_ngram, num_tokens)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_tokens, self.max_matches = num_tokens, max_matches
        self.ramp_up = ramp_up
        # Reference copying (LLMA): a document the caller passes (retrieved passages, a file being edited)
        # is searched as if it preceded the context, behind a separator no n-gram can match across.
        reference = np.asarray(reference_ids or [], dtype=np.int64)
        self._reference = np.concatenate([reference, [-1]]) if reference.size else reference
        self.begin([])

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self._acceptance = CopyAcceptance()
        self._open: list[tuple[int, int, int]] = []  # proposals not yet judged: (bucket, source, context length)
        self._stopped: int | None = None  # where in its source the last real copy stopped being right
        self._longest = 0  # the most draft tokens a step of this request has had accepted
        self._ids = self._reference.astype(np.int64)  # the reference, then the context as far as seen (`_ids_of`)

    def observe(self, outcome: Outcome) -> None:
        self._longest = max(self._longest, outcome.verdict.num_accepted)

    def for_sequence(self, memory: Memory | None = None) -> PromptLookupDrafter:
        twin = copy.copy(self)  # the reference document shared; `begin` makes the rest anew
        twin.begin([])
        return twin

    def _ids_of(self, context) -> np.ndarray:
        """The reference, then `context`, as int64 ids: the array of the last step extended by what the context
        gained since (within a request a context only grows, and converting a long one whole took most of a
        step's lookup), made anew where its last tokens seen no longer match (another context)."""
        seen = self._ids.shape[0] - self._reference.shape[0]
        tail = min(seen, CHECKED)
        if seen > len(context) or (tail and list(context[seen - tail : seen]) != self._ids[-tail:].tolist()):
            self._ids, seen = self._reference.astype(np.int64), 0
        if len(context) > seen:
            self._ids = np.concatenate([self._ids, np.asarray(context[seen:], dtype=np.int64)])
        return self._ids

    def _judge(self, ids: np.ndarray) -> None:
        """Compare the open proposals with what the output turned out to be."""
        still_open = []
        for bucket, source, at in self._open:
            # a copy from `source` could offer no more than the `at - source` tokens that stood after it
            window = min(JUDGED, at - source)
            judged = min(window, ids.shape[0] - at)
            right = match_length_forward(ids, source, at, judged)
            if right < judged or judged == window:
                self._acceptance.record(bucket, right, judged)
                if right < judged and right >= RUNNING:
                    self._stopped = source + right
            else:
                still_open.append((bucket, source, at))
        self._open = still_open

    def propose(self, context, max_tokens, params, generator) -> Draft:
        ids = self._ids_of(context)
        self._judge(ids)
        limit = min(self.num_tokens, max_tokens)
        if self.ramp_up:
            limit = min(limit, max(FIRST_CAP, 2 * self._longest))
        if limit <= 0:
            return Draft.empty()
        for ngram in range(self.max_ngram, self.min_ngram - 1, -1):
            ends = find_starts(ids, ngram, self.max_matches) + ngram  # continuation starts, most recent first
            if not ends.size:
                continue
            # the occurrence sharing the longest stretch with the context's end (the most recent of
            # those), unless the match is short and one resumes where the last copy stopped
            lengths = [match_length(ids, e, MAX_MATCH) for e in ends.tolist()]
            best = int(np.argmax(lengths))
            end, matched = int(ends[best]), lengths[best]
            stopped = self._stopped
            resuming = [] if stopped is None else [e for e in ends.tolist() if stopped <= e <= stopped + RESUME_WINDOW]
            if resuming and matched < 8:
                end = min(resuming)
                matched = match_length(ids, end, MAX_MATCH)
            bucket = self._acceptance.bucket(matched, bool(resuming) and matched < 8)
            tokens = ids[end : end + limit]
            tokens = tokens[: int(np.argmax(tokens < 0))] if (tokens < 0).any() else tokens  # up to the separator
            if not tokens.size:
                continue
            self._open.append((bucket, end, ids.shape[0]))
            return Draft(tokens=torch.from_numpy(tokens.copy()), scores=self._acceptance.scores(bucket, len(tokens)))
        return Draft.empty()


def match_length_forward(ids: np.ndarray, source: int, at: int, limit: int) -> int:
    """How many tokens from `at` on equal those from `source` on (at most `limit`)."""
    length = 0
    while length < limit and ids[source + length] == ids[at + length]:
        length += 1
    return length


class PromptLookupTreeDrafter(Drafter):
    """Prompt lookup with every match at once: the continuations of up to `max_matches` earlier
    occurrences (longest n-grams first) merged into a trie by shared prefixes.

    A node scores the weighted share of the continuations through it (a match of a longer n-gram weighs
    more) times a^depth, where a is the running per-token acceptance; the budget keeps the best nodes,
    a fixed number or the number that maximises expected tokens per unit of time on the cost curve.
    """

    batchable = True  # no model: one instance per sequence serves a batch
    catches_up = False

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
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_tokens, self.max_matches = num_tokens, max_matches
        self._acceptance = RunningAcceptance()

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self._acceptance.reset()

    def for_sequence(self, memory: Memory | None = None) -> PromptLookupTreeDrafter:
        twin = copy.copy(self)
        twin._acceptance = RunningAcceptance()
        return twin

    @property
    def acceptance(self) -> float:
        """Running chance that the next token of an accepted continuation is accepted (prior 2/3)."""
        return self._acceptance.value

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
        # 2. Merge them into a trie; a node weighs the continuations through it.
        rows = stack([c for c, _ in weighted])  # [matches, longest]
        trie = build_trie(rows, np.repeat([[w] for _, w in weighted], rows.shape[1], axis=1))
        parents = torch.from_numpy(trie.parents)
        total = sum(w for _, w in weighted)
        depths = structure.depths(parents).float()  # [n]
        scores = torch.from_numpy(trie.weights).float() / total * self.acceptance ** depths  # [n]
        # 3. Keep the best nodes (none: no node pays on this cost curve, a plain step).
        keep = prune(parents, scores, self.curve, self.budget)
        if not keep.numel():
            return Draft.empty()
        return Draft(tokens=torch.from_numpy(trie.tokens)[keep], parents=structure.select(parents, keep))

    def observe(self, outcome: Outcome) -> None:
        if outcome.verdict.num_drafted:
            self._acceptance.record(outcome.verdict)


def build_prompt_lookup(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> Drafter:
    """The `pld` method: a chain (from a reference document too) or a tree of every match."""
    if not options.tree:
        return PromptLookupDrafter(reference_ids=options.reference_ids)
    if options.reference_ids:
        raise UserError("a reference document is searched by the chain form of pld; drop --tree")
    return PromptLookupTreeDrafter(target.cost_curve(), budget=options.budget)
