"""The suffix index: every request's tokens in one log, hash chains to find what followed a suffix.

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

import numpy as np

from specdecode.errors import UserError

SEPARATOR = -1  # the log's filler: between sequences, after the last one, and over evicted ones
DEFAULT_CAPACITY = 1 << 21  # about 2 million tokens: some 100 MB of numpy arrays at the log's largest
DEFAULT_KEYS = (1, 2, 4, 8)  # n-gram lengths with a hash chain each
MAX_MATCH = 16  # a longer matched suffix than this is no more telling
MAX_WALK = 64  # chain links followed per key length and lookup
INITIAL_LOG = 1 << 12

_FNV_OFFSET = 0xCBF29CE484222325
_PRIME, _MIX = 0x100000001B3, 0x9E3779B97F4A7C15  # FNV's prime; 2^64 / golden ratio: spreads the hash into the top bits
_FNV_PRIME, _GOLDEN = np.uint64(_PRIME), np.uint64(_MIX)


def slots(windows: np.ndarray, bits: int) -> np.ndarray:
    """Hash table slots of n-grams (FNV-1a over the ids, then a Fibonacci mix).

    windows: [n, k] token ids >= 0. Returns [n] int64 in [0, 2^bits).
    """
    hashes = np.full(windows.shape[0], _FNV_OFFSET, dtype=np.uint64)  # [n]
    for column in windows.T:  # k columns; uint64 arithmetic wraps, as a hash wants
        hashes = (hashes ^ column.astype(np.uint64)) * _FNV_PRIME
    return ((hashes * _GOLDEN) >> np.uint64(64 - bits)).astype(np.int64)


_MASK = (1 << 64) - 1
SMALL = 32  # positions indexed one by one in Python below this many (a step's few tokens), vectorised above


def slot_of(key: Sequence[int], bits: int) -> int:
    """`slots` of one n-gram in Python integers (a step's few lookups and insertions: numpy's per-call cost is
    more than the arithmetic), the same slot."""
    value = _FNV_OFFSET
    for token in key:
        value = ((value ^ token) * _PRIME) & _MASK
    return ((value * _MIX) & _MASK) >> (64 - bits)


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
    def nbytes(self) -> int:
        """What its arrays hold, in bytes."""
        arrays = [self._tokens, *self._prev.values(), *self._head.values()]
        return sum(int(array.nbytes) for array in arrays)

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
        if end - start < SMALL:  # a step's tokens: one by one, as `link` would push them
            base = max(start - self.keys[-1], 0)
            log = self._tokens[base:end].tolist()
            for k in self.keys:
                head, prev = self._head[k], self._prev[k]
                for position in range(max(start, k), end):
                    window = log[position - k - base : position + 1 - base]  # the key, then the token
                    if min(window) >= 0:
                        slot = slot_of(window[:k], self._bits)
                        prev[position], head[slot] = head[slot], position
            return
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
            slot = slot_of(context[context.shape[0] - k :].tolist(), self._bits)
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
