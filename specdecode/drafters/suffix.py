"""Suffix decoding: draft from what followed the context's suffix in earlier requests and in this one.

In the spirit of SuffixDecoding (Oliaro et al. 2024) and llama.cpp's n-gram cache: agents, tools and
templated traffic repeat themselves across requests (the same JSON skeleton, the same tool call, a
re-run of yesterday's prompt), which prompt lookup cannot see since it only reads the current context.
One `SuffixIndex` per drafter keeps the token sequences of every request the drafter has handled (the
current one included, indexed as it grows) under a memory cap, and a lookup returns, for the longest
suffix of the context found in it, what followed each occurrence. The drafter merges those
continuations into a trie weighted by how often, how long and where they matched.

Glossary (on top of `specdecode.types`):

- *sequence*: one request's tokens in the index (its prompt and its output, as the target saw them).
- *open* sequence: the current request's, extended each step; *closed*: an earlier request's.
- *match*: an earlier position whose preceding tokens equal the context's last ones; *matched*: how many
  (at most `max_match`); its *continuation*: the tokens that followed it there.
- *own* match: one in the open sequence (prompt lookup, in effect); *shared* match: one in a closed sequence.

Why hash chains over a log rather than a suffix tree. A suffix tree (SuffixDecoding's choice, in C++)
answers "which continuations follow this suffix, and how often" from node counts, but in Python a node
per stored token and depth costs hundreds of bytes, and a few million tokens would take gigabytes. Here
the sequences sit in one flat int32 log separated by a sentinel, and for each key length k (1, 2, 4, 8)
a hash table maps the hash of the k tokens before a position to the newest such position, each position
linking to the previous one with the same hash (the hash chains of zlib's deflate / LZ77). Memory is
4 (1 + number of keys) bytes per log slot in numpy arrays, plus hash tables that grow with the log
(about one slot per log slot, at most 2^20 per key length: an index holding little costs little, so a
server can keep one per tenant); inserting a token is O(1) (vectorised per step); a lookup walks at
most `max_walk` links per key length, longest key first, and checks every candidate against the
context token by token, so hash collisions and stale links cost time, never correctness. What a suffix
tree's counts would give exactly, the trie rebuilds from `max_candidates` occurrences, the longest
matches first and the most recent among equals: frequencies weighted toward recent traffic, which is
what drifts.

Memory and eviction. The cap counts stored tokens plus one sentinel per sequence. Closed sequences
are evicted whole, least recently used first: a sequence is *used* when a shared match into it is
judged right against the output (see SuffixDrafter). Eviction blanks the sequence in the log (its
stale links then fail the token check) and frees its share of the cap at once: O(1) per evicted token.
When the log, twice the cap, is full, the live sequences (at most the cap) are copied to its front and
the chains rebuilt in one vectorised O(n log n) pass, n = twice the cap, which happens at most once per
`capacity` appended tokens: O(log n) amortised per token, in numpy. The current request is never
evicted; one longer than the whole cap is indexed up to the cap.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdecode.drafters.base import Drafter, DrafterOptions
from specdecode.drafters.prompt_lookup import JUDGED, CopyAcceptance
from specdecode.errors import UserError
from specdecode.models.costs import CostCurve
from specdecode.tree import structure
from specdecode.tree.budget import MAX_BUDGET, best_budget, check_budget
from specdecode.types import Draft, SamplingParams, StepStats, Verdict

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM

SEPARATOR = -1  # the log's filler: between sequences, after the last one, and over evicted ones
DEFAULT_CAPACITY = 1 << 21  # about 2 million tokens: some 100 MB of numpy arrays at the log's largest
DEFAULT_KEYS = (1, 2, 4, 8)  # n-gram lengths with a hash chain each
MAX_MATCH = 16  # a longer matched suffix than this is no more telling
MAX_WALK = 64  # chain links followed per key length and lookup
INITIAL_LOG = 1 << 12

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = np.uint64(0x100000001B3)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: spreads the hash into the top bits


def slots(windows: np.ndarray, bits: int) -> np.ndarray:
    """Hash table slots of n-grams (FNV-1a over the ids, then a Fibonacci mix).

    windows: [n, k] token ids >= 0. Returns [n] int64 in [0, 2^bits).
    """
    hashes = np.full(windows.shape[0], _FNV_OFFSET, dtype=np.uint64)  # [n]
    for column in windows.T:  # k columns; uint64 arithmetic wraps, as a hash wants
        hashes = (hashes ^ column.astype(np.uint64)) * _FNV_PRIME
    return ((hashes * _GOLDEN) >> np.uint64(64 - bits)).astype(np.int64)


def link(head: np.ndarray, prev: np.ndarray, slot: np.ndarray, positions: np.ndarray) -> None:
    """Push `positions` onto the hash chains of their slots, in one vectorised pass.

    head: [table] newest position per slot (-1: none); prev: [log] the previous position with the same
    slot. positions: [n] ascending and newer than every position already linked; slot: [n] theirs.
    """
    order = np.argsort(slot, kind="stable")  # grouped by slot, positions ascending within a group
    slot, positions = slot[order], positions[order]
    first = np.ones(slot.shape[0], dtype=bool)  # [n] the oldest new position of its slot
    first[1:] = slot[1:] != slot[:-1]
    prev[positions[first]] = head[slot[first]]
    later = np.flatnonzero(~first)
    prev[positions[later]] = positions[later - 1]
    newest = np.ones(slot.shape[0], dtype=bool)
    newest[:-1] = first[1:]
    head[slot[newest]] = positions[newest]


@dataclass(frozen=True)
class Match:
    sequence: int  # the id of the sequence it was found in
    matched: int  # how many tokens before it equal the context's last ones (1 .. max_match)
    continuation: np.ndarray  # [1 .. max_tokens] int64, the tokens that followed it


class SuffixIndex:
    """Token sequences under a memory cap, searchable by the longest suffix of a context (see the
    module docstring for the data structure). Sequences are written one at a time: `open()`, then
    `extend()` as tokens arrive, then `close()`; lookups see the open sequence too."""

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        keys: Sequence[int] = DEFAULT_KEYS,
        max_match: int = MAX_MATCH,
        max_walk: int = MAX_WALK,
    ):
        keys = tuple(sorted(set(int(k) for k in keys)))
        if not keys or keys[0] < 1 or keys[-1] > max_match:
            raise UserError(f"suffix index keys must be n-gram lengths in 1 .. max_match ({max_match}), got {keys}")
        if not 16 <= capacity <= 1 << 29:
            raise UserError(f"suffix index capacity must be between 16 and 2^29 tokens, got {capacity}")
        if max_walk < 1:
            raise UserError(f"suffix index needs max_walk >= 1, got {max_walk}")
        self.capacity, self.keys, self.max_match, self.max_walk = capacity, keys, max_match, max_walk
        self._max_bits = min(max(capacity.bit_length() - 1, 8), 20)  # hash table: about one slot per token, <= 1M
        self._log_limit = 2 * capacity
        self.clear()

    def _table_bits(self, log_size: int) -> int:
        """Hash table slots (as a power of two) for a log of this size: about one per slot, 2^8 .. 2^20."""
        return min(max(log_size.bit_length() - 1, 8), self._max_bits)

    def clear(self) -> None:
        size = min(INITIAL_LOG, self._log_limit)
        self._tokens = np.full(size, SEPARATOR, dtype=np.int32)  # [log]
        self._prev = {k: np.full(size, -1, dtype=np.int32) for k in self.keys}  # [log] per key length
        self._bits = self._table_bits(size)
        self._head = {k: np.full(1 << self._bits, -1, dtype=np.int32) for k in self.keys}  # [table]
        self._end = 0  # the next free log slot
        self._closed: OrderedDict[int, tuple[int, int]] = OrderedDict()  # id -> (start, length), LRU first
        self._open: int | None = None
        self._open_start = self._open_length = 0
        self._starts: list[int] = []  # every sequence written since the last compaction, by start ...
        self._ids: list[int] = []  # ... and its id
        self._next_id = 0
        self.size = 0  # stored tokens plus one separator per sequence: never above the capacity

    # --- writing ---------------------------------------------------------------------------------

    @property
    def open_id(self) -> int | None:
        return self._open

    def open(self) -> int:
        """Start a sequence (closing the open one, if any); returns its id."""
        self.close()
        self._make_room(1)
        self._reserve(1)
        self._open, self._next_id = self._next_id, self._next_id + 1
        self._open_start, self._open_length = self._end, 0
        self._starts.append(self._end)
        self._ids.append(self._open)
        self.size += 1
        return self._open

    def extend(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Append tokens to the open sequence, evicting closed ones as the cap requires. Returns how many
        were stored: fewer when the open sequence alone would pass the cap."""
        if self._open is None:
            raise ValueError("no open sequence: call open() first")
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size and int(tokens.min()) < 0:
            raise ValueError("token ids must be >= 0")
        self._make_room(tokens.size)
        n = min(tokens.size, self.capacity - self.size)
        if n <= 0:
            return 0
        self._reserve(n)  # may compact the log, moving every sequence
        start = self._end
        self._tokens[start : start + n] = tokens[:n]
        self._end += n
        self._open_length += n
        self.size += n
        self._link(start, start + n)
        return n

    def close(self, drop_first: int = 0) -> None:
        """Close the open sequence, keeping all but its first `drop_first` tokens (say, most of a prompt)."""
        if self._open is None:
            return
        drop = min(drop_first, self._open_length)
        start, length = self._open_start + drop, self._open_length - drop
        self._tokens[self._open_start : start] = SEPARATOR
        self.size -= drop
        if length:
            self._closed[self._open] = (start, length)
        else:
            self.size -= 1  # nothing left: its separator goes too
        self._end += 1  # the separator slot
        self._open = None

    def touch(self, sequence: int) -> None:
        """Mark a closed sequence as just used: it is evicted last."""
        if sequence in self._closed:
            self._closed.move_to_end(sequence)

    def sequences(self) -> list[int]:
        """The ids of the stored sequences, least recently used first (the open one last)."""
        return list(self._closed) + ([] if self._open is None else [self._open])

    def tokens_of(self, sequence: int) -> np.ndarray:
        """A stored sequence's tokens (what is left of it after close's drop). [length] int64"""
        start, length = (self._open_start, self._open_length) if sequence == self._open else self._closed[sequence]
        return self._tokens[start : start + length].astype(np.int64)

    @property
    def log_slots(self) -> int:
        """The log's allocated length: at most twice the capacity."""
        return int(self._tokens.shape[0])

    def _make_room(self, n: int) -> None:
        """Evict least recently used closed sequences until n more tokens fit under the cap (if they can)."""
        while self.size + n > self.capacity and self._closed:
            _, (start, length) = self._closed.popitem(last=False)
            self._tokens[start : start + length] = SEPARATOR  # its links now fail the token check
            self.size -= length + 1

    def _reserve(self, n: int) -> None:
        """Make the log long enough for n more tokens: grow it, or compact it once at its limit."""
        if self._end + n <= self._tokens.shape[0]:
            return
        if self._end + n > self._log_limit:
            self._compact()  # afterwards _end <= size, and size + n <= capacity
        if self._end + n > self._tokens.shape[0]:
            self._resize(min(max(self._end + n, 2 * self._tokens.shape[0]), self._log_limit))

    def _resize(self, size: int) -> None:
        def grown(array: np.ndarray, fill: int) -> np.ndarray:
            out = np.full(size, fill, dtype=array.dtype)
            out[: array.shape[0]] = array
            return out

        self._tokens = grown(self._tokens, SEPARATOR)
        self._prev = {k: grown(prev, -1) for k, prev in self._prev.items()}
        if self._table_bits(size) > self._bits:  # a larger hash table: every position is linked again
            self._bits = self._table_bits(size)
            self._head = {k: np.full(1 << self._bits, -1, dtype=np.int32) for k in self.keys}
            self._relink()

    def _compact(self) -> None:
        """Copy the live sequences to the front of the log, in order, and rebuild the chains."""
        tokens = np.full(self._tokens.shape[0], SEPARATOR, dtype=np.int32)
        starts, ids, end = [], [], 0
        for sequence in self._ids:
            if sequence == self._open:
                start, length = self._open_start, self._open_length
                self._open_start = end
            elif sequence in self._closed:
                start, length = self._closed[sequence]
                self._closed[sequence] = (end, length)  # reassigning keeps the LRU order
            else:
                continue  # evicted
            tokens[end : end + length] = self._tokens[start : start + length]
            starts.append(end)
            ids.append(sequence)
            end += length + 1
        self._tokens, self._starts, self._ids = tokens, starts, ids
        self._end = self._open_start + self._open_length if self._open is not None else end
        self._relink()

    def _relink(self) -> None:
        """Rebuild every hash chain from the log, in one vectorised pass."""
        for k in self.keys:
            self._prev[k].fill(-1)
            self._head[k].fill(-1)
        self._link(0, self._end)

    def _link(self, start: int, end: int) -> None:
        """Index log positions start .. end - 1 (the newest): each under the k tokens before it, for every
        key length k, when those and the position's own token are all in one sequence."""
        positions = np.arange(start, end)
        for k in self.keys:
            p = positions[positions >= k]
            if not p.size:
                continue
            windows = self._tokens[p[:, None] + np.arange(-k, 1)]  # [n, k + 1] the key, then the token
            whole = (windows >= 0).all(axis=1)  # no separator: one sequence
            if whole.any():
                link(self._head[k], self._prev[k], slots(windows[whole, :k], self._bits), p[whole])

    # --- reading ---------------------------------------------------------------------------------

    def sequence_at(self, position: int) -> int:
        return self._ids[bisect.bisect_right(self._starts, position) - 1]

    def lookup(
        self, context: Sequence[int] | np.ndarray, min_match: int, max_candidates: int, max_tokens: int
    ) -> list[Match]:
        """The continuations of earlier occurrences of the context's suffix, longest match first, then
        the most recent: at most `max_candidates`, each matching at least `min_match` tokens.

        Walks the chains of the key lengths from the longest that fits down to the largest not above
        `min_match` (a match of m tokens is on the chain of every key length up to m).
        """
        context = np.asarray(context, dtype=np.int64)
        if min_match < self.keys[0]:
            raise ValueError(f"min_match {min_match} is below the shortest key length {self.keys[0]}")
        limit = min(self.max_match, context.shape[0])
        if limit < min_match or max_candidates < 1 or max_tokens < 1:
            return []
        tail = context[::-1][:limit]  # [limit] the context's last tokens, newest first
        floor = max(k for k in self.keys if k <= min_match)
        checked: set[int] = set()
        found: dict[int, int] = {}  # position -> matched
        for k in reversed(self.keys):
            if k > limit or k < floor or len(found) >= max_candidates:
                continue
            slot = int(slots(context[None, context.shape[0] - k :], self._bits)[0])
            batch, position, prev = [], int(self._head[k][slot]), self._prev[k]
            for _ in range(self.max_walk):
                if position < 0:
                    break
                if position not in checked:
                    checked.add(position)
                    batch.append(position)
                position = int(prev[position])
            if batch:
                lengths = self._match_lengths(np.array(batch), tail)
                # a hash collision on a longer key may still be a real shorter match: keep what is real
                found.update((p, m) for p, m in zip(batch, lengths.tolist()) if m >= min_match)
        best = sorted(found.items(), key=lambda item: (-item[1], -item[0]))[:max_candidates]
        matches = []
        for position, matched in best:
            continuation = self._tokens[position : position + max_tokens].astype(np.int64)
            stop = np.flatnonzero(continuation < 0)
            continuation = continuation[: stop[0]] if stop.size else continuation
            if continuation.size:
                matches.append(Match(self.sequence_at(position), matched, continuation))
        return matches

    def _match_lengths(self, positions: np.ndarray, tail: np.ndarray) -> np.ndarray:
        """How many tokens before each position equal the tail (the context's last tokens, newest first).
        positions: [c]; tail: [limit]. -> [c]"""
        before = positions[:, None] - np.arange(1, tail.shape[0] + 1)  # [c, limit]
        tokens = np.where(before >= 0, self._tokens[np.maximum(before, 0)], SEPARATOR)  # [c, limit]
        return np.cumprod(tokens == tail[None, :], axis=1).sum(axis=1)


@dataclass
class _Judgment:
    """A proposal's leading match, to be compared with the output as it arrives."""

    own: bool  # found in the current request (else in an earlier one)
    bucket: int  # CopyAcceptance's kind of match
    tokens: list[int]  # [<= JUDGED] its continuation
    at: int  # the context length it was proposed after
    sequence: int


class SuffixDrafter(Drafter):
    """Drafts from a `SuffixIndex` of this request and the earlier ones this drafter handled.

    Each step the context's new tokens are appended to the open sequence (the request is indexed as it
    grows; the next `begin()` closes it, keeping its output and, unless `include_prompts`, only the last
    `max_match` tokens of its prompt, which key the output's start). Then the lookup's matches are
    merged into a trie by shared prefixes, and a node scores the chance that its path is accepted under
    a mixture: match i is the right source with probability w_i / sum(w), and then its continuation's
    first token is right with chance f and each later one with chance r, (f, r) being CopyAcceptance's
    rates for its match length. So score(node) = sum over the matches through the node of
    w_i / sum(w) * f_i * r_i^(depth - 1), which never grows from a parent to its child, is a match's own
    copy chance when it is alone, and splits it by frequency when earlier occurrences disagree.

    How the two sources are weighted: w_i = 2^matched_i, times `own_weight` (2) for a match in the
    current request. A longer match is the likelier source (each matched token halves the odds of a
    coincidence); at equal length the current request's own text is the likelier one (outputs quote
    their own prompt more than they repeat another request), and among earlier requests frequency
    decides. Shared matches also need `min_shared_match` (2) tokens: a single token matches almost
    anywhere in millions. The rates are learnt separately: for own matches per request, as prompt
    lookup does; for shared ones over the drafter's lifetime, since whether traffic repeats is a
    property of the workload, not of one request.

    Learning needs no verdict: as in PromptLookupDrafter, each proposal's leading own and shared match
    is judged against the output as it arrives (what greedy verification would accept), so the
    drafter learns the same way whether the engine verified its draft, cut it, or a composite drafter
    merged it with others. A shared match judged right marks its sequence used (evicted last). The
    output arrives through the contexts of propose() and through update(), whose verdict's tokens (as
    many as the step kept, `stats.new_tokens`) must be a prefix of what the step appended to the
    context: so the last step of a request, which no propose() follows, is indexed and judged too.

    `tree=False` proposes the trie's best path as a scored chain (the engine's gate cuts it on the cost
    curve); `tree=True` the trie's best nodes: `budget` of them, or as many as pay on `curve`.
    """

    name = "suffix"

    def __init__(
        self,
        curve: CostCurve | None = None,
        tree: bool = False,
        budget: int | None = None,
        index: SuffixIndex | None = None,  # owned by this drafter; default: SuffixIndex()
        num_tokens: int = 32,
        min_match: int = 1,
        min_shared_match: int = 2,
        max_candidates: int = 16,
        include_prompts: bool = False,
        own_weight: float = 2.0,
    ):
        check_budget(budget)
        if tree and curve is None and budget is None:
            raise UserError("a suffix tree draft needs the target's cost curve or a fixed budget")
        if budget is not None and not tree:
            raise UserError("a budget applies to token trees")
        self.index = index if index is not None else SuffixIndex()
        shortest, longest = min(min_match, min_shared_match), max(min_match, min_shared_match)
        if not self.index.keys[0] <= shortest <= longest <= self.index.max_match:
            raise UserError(f"suffix matches need {self.index.keys[0]} <= min_match <= {self.index.max_match}, "
                            f"got {min_match} and {min_shared_match}")
        if num_tokens < 1 or max_candidates < 1 or not own_weight > 0:
            raise UserError("suffix drafting needs num_tokens >= 1, max_candidates >= 1 and own_weight > 0")
        self.curve, self.tree, self.budget = curve, tree, budget
        self.num_tokens, self.max_candidates = num_tokens, max_candidates
        self.min_match, self.min_shared_match = min_match, min_shared_match
        self.include_prompts, self.own_weight = include_prompts, own_weight
        self._shared = CopyAcceptance()  # matches into earlier requests: learnt over the drafter's lifetime
        self._own = CopyAcceptance()  # matches into this request: learnt per request
        self._judgments: list[_Judgment] = []
        self._prompt_length = 0
        self._seen: list[int] = []  # the current request's tokens so far (the index may hold fewer: the cap)

    def begin(self, prompt_ids: list[int]) -> None:
        """Close the previous request's sequence and open this one's, indexing the prompt at once."""
        if self.index.open_id is not None:
            keep = self.include_prompts
            self.index.close(drop_first=0 if keep else max(self._prompt_length - self.index.max_match, 0))
        self.index.open()
        self.index.extend(prompt_ids)
        self._prompt_length = len(prompt_ids)
        self._seen = list(prompt_ids)
        self._own = CopyAcceptance()
        self._judgments = []

    def forget(self) -> None:
        """Drop everything learnt from earlier requests (the index and the shared rates), e.g. between a
        benchmark's repeats, so that a prompt is not drafted from its own earlier run."""
        self.index.clear()
        self._shared, self._own = CopyAcceptance(), CopyAcceptance()
        self._seen, self._judgments, self._prompt_length = [], [], 0

    def _sync(self, context: list[int]) -> None:
        """Take in the context's new tokens; a context that does not extend the request begun is
        indexed as a new request."""
        known = len(self._seen)
        if self.index.open_id is None or len(context) < known or context[:known] != self._seen:
            self.begin(list(context))
        else:
            self._absorb(context[known:])

    def _absorb(self, tokens: list[int]) -> None:
        self._seen.extend(tokens)
        self.index.extend(tokens)
        self._judge()

    def update(self, verdict: Verdict, stats: StepStats) -> None:
        """Take in the step's tokens (see the class docstring)."""
        if self.index.open_id is not None:
            self._absorb(list(verdict.tokens[: stats.new_tokens]))

    def _judge(self) -> None:
        """Compare the open judgments with the output so far; record those decided."""
        seen, waiting = self._seen, []
        for judgment in self._judgments:
            judged = min(len(judgment.tokens), len(seen) - judgment.at)
            right = 0
            while right < judged and judgment.tokens[right] == seen[judgment.at + right]:
                right += 1
            if right < judged or judged == len(judgment.tokens):
                (self._own if judgment.own else self._shared).record(judgment.bucket, right, judged)
                if right and not judgment.own:
                    self.index.touch(judgment.sequence)
            else:
                waiting.append(judgment)
        self._judgments = waiting

    def propose(self, context, max_tokens, params: SamplingParams, generator) -> Draft:
        self._sync(list(context))
        ids = np.asarray(context, dtype=np.int64)
        limit = min(self.num_tokens, max_tokens)
        if limit <= 0 or not ids.size:
            return Draft.empty()
        own_sequence = self.index.open_id
        found = self.index.lookup(ids, min(self.min_match, self.min_shared_match), self.max_candidates, limit)
        matches = [m for m in found
                   if m.matched >= (self.min_match if m.sequence == own_sequence else self.min_shared_match)]
        if not matches:
            return Draft.empty()
        # 1. Each match's chance of being the right source, and of its continuation's tokens being right.
        own = [m.sequence == own_sequence for m in matches]
        weights = np.array([(self.own_weight if o else 1.0) * 2.0 ** m.matched for m, o in zip(matches, own)])
        weights /= weights.sum()
        chances = []
        for match, is_own, weight in zip(matches, own, weights.tolist()):
            first, run = (self._own if is_own else self._shared).rates(CopyAcceptance.bucket(match.matched))
            chances.append(weight * first * run ** np.arange(match.continuation.shape[0]))  # [len]
        # 2. The continuations merged into a trie; a node's score sums the chances through it.
        tokens, parents, scores = weighted_trie([m.continuation for m in matches], chances)
        # 3. Judge the leading own and shared match once the output is known.
        for source in (True, False):
            leading = next((m for m, o in zip(matches, own) if o == source), None)
            if leading is not None:
                self._judgments.append(_Judgment(source, CopyAcceptance.bucket(leading.matched),
                                                 leading.continuation[:JUDGED].tolist(), ids.shape[0],
                                                 leading.sequence))
        # 4. The best path as a scored chain, or the best nodes as a tree.
        if not self.tree:
            path = best_path(parents, scores)
            return Draft(tokens=tokens[path], scores=scores[path])
        budget = self.budget or best_budget(sorted(scores.tolist(), reverse=True), self.curve, 0.0, cap=MAX_BUDGET)
        if budget == 0:  # no node pays on this cost curve: a plain step
            return Draft.empty()
        keep = structure.top_nodes(parents, scores, budget)
        return Draft(tokens=tokens[keep], parents=structure.select(parents, keep), scores=scores[keep])


def weighted_trie(
    continuations: Sequence[np.ndarray], chances: Sequence[np.ndarray]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge token sequences into a trie by shared prefixes; a node's score is the sum of the chances of
    the sequences through it at its depth. continuations[i], chances[i]: [len_i].

    Returns (tokens [n] int64, parents [n] int64, scores [n] float32), parents before children.
    """
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for continuation, chance in zip(continuations, chances):
        parent = structure.ROOT
        for token, c in zip(continuation.tolist(), chance.tolist()):
            node = index.get((parent, token))
            if node is None:
                node = index[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                scores.append(0.0)
            scores[node] += c
            parent = node
    return (torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
            torch.tensor(scores, dtype=torch.float32))


def best_path(parents: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """From the context down, the highest-scoring child each time (ties: the earlier node). -> [depth]"""
    kids = structure.children(parents)
    values = scores.tolist()
    node, path = structure.ROOT, []
    while kids[node + 1]:
        node = max(kids[node + 1], key=lambda child: (values[child], -child))
        path.append(node)
    return torch.tensor(path, dtype=torch.long)


def build_suffix(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> Drafter:
    """The `suffix` method: no draft model; a chain gated by the engine, or (options.tree) a tree sized
    on the target's cost curve. Its index lives as long as the drafter, so reuse one drafter across
    requests (a benchmark's prompts, one owner's requests to a server) to learn across them; a server
    keeps one per owner (`Method.remembers`), never one for all its clients."""
    if not options.tree:
        return SuffixDrafter()
    return SuffixDrafter(target.cost_curve(), tree=True, budget=options.budget)
