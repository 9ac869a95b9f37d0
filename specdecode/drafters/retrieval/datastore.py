"""The datastore: a tokenized corpus, its suffix array, and the lookups a retrieval drafter makes in it
(the longest matching suffix of the context, the continuations of its occurrences); saved and loaded as
one .npz file."""

from __future__ import annotations

import hashlib
import json
import weakref
import zipfile
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from specdecode.errors import UserError
from specdecode.paths import write_atomically

SEPARATOR = -1  # ends every document in the token array; below every real id, so it sorts first
FORMAT = 1  # the .npz layout; bump when it changes (the default datastore's cache key includes it)
MAX_MATCH = 16  # the longest context suffix looked up (REST's choice too)
MIN_MATCH = 2  # a single token matches almost anywhere and predicts little
MAX_OCCURRENCES = 4096  # occurrences of a match whose continuations are counted, evenly spaced


# --- The suffix array ------------------------------------------------------------------------------


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """The start positions of the suffixes of `tokens`, in lexicographic order (a suffix sorts before
    the longer ones it begins). [n] int -> [n] int32 (int64 past 2^31 positions)

    Built with libdivsufsort (Mori's induced-sorting suffix sorter, the usual tool for this job: among
    the fastest known in practice, and it sorts in place, 4 bytes per input byte, 8 past 2 GiB) through
    `pydivsufsort`, which ships it as binary wheels and takes numpy arrays. A suffix array could be
    built with numpy alone by prefix doubling, but that takes log(n) rounds of argsort over 16-byte
    keys: several times slower and several times the memory. REST's own `draftretriever` was not
    needed: it is a Rust extension with its own index format, while this one is a plain array that
    numpy's binary search reads directly.

    libdivsufsort sorts bytes, so the ids are first renumbered densely in the same order (their rank
    among the ids present, the separator lowest) and written big-endian in as few bytes as the ranks
    need (2 for a code corpus under a 150k vocabulary); the suffixes that start at a multiple of that
    width are then the tokens' suffixes, in the same order. (pydivsufsort converts int arrays itself,
    but to 2, 4 or 8 bytes per id by their spread, not their number, and with whole-array temporaries.)
    Memory: about 16 bytes per token at the peak with 2-byte ranks, the tokens included.
    """
    import pydivsufsort

    tokens = np.asarray(tokens)
    n = tokens.size
    if n == 0:
        return np.empty(0, dtype=np.int32)
    low, high = int(tokens.min()), int(tokens.max())
    if high - low < 1 << 24:  # ids from a vocabulary: a table of the ids present
        offsets = tokens - low
        present = np.zeros(high - low + 1, dtype=bool)
        present[offsets] = True
        ranks = (np.cumsum(present, dtype=np.int32) - 1)[offsets]  # [n], order kept
        del offsets
    else:  # ids spread wider than any vocabulary: sort them
        ranks = np.unique(tokens, return_inverse=True)[1].reshape(-1).astype(np.int32)
    width = max(1, (int(ranks.max()).bit_length() + 7) // 8)  # bytes per rank: 1 to 4
    big_endian = ranks.astype(">u4").view(np.uint8).reshape(n, 4)  # [n, 4]
    del ranks
    packed = np.ascontiguousarray(big_endian[:, 4 - width :]).reshape(-1)  # [n * width] the low bytes
    del big_endian
    order = pydivsufsort.divsufsort(packed)  # [n * width] the suffixes of the bytes, sorted
    del packed
    if width == 1:
        return np.asarray(order)
    result = np.empty(n, dtype=order.dtype)
    filled = 0
    for begin in range(0, order.size, 1 << 20):  # a chunk at a time, so temporaries stay small
        chunk = order[begin : begin + (1 << 20)]
        aligned = chunk[chunk % width == 0] // width
        result[filled : filled + aligned.size] = aligned
        filled += aligned.size
    return result


def join_documents(documents: Iterable[Sequence[int] | np.ndarray]) -> np.ndarray:
    """Documents as one int32 token array, each followed by SEPARATOR (empty ones left out)."""
    parts = []
    for document in documents:
        ids = np.asarray(document, dtype=np.int32)
        if ids.size:
            parts += [ids, np.full(1, SEPARATOR, dtype=np.int32)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)


# --- The datastore ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatastoreInfo:
    """What a datastore holds; saved with it as JSON."""

    tokenizer: str  # the tokenizer's name or folder
    vocab_size: int  # every id is below this: the tokenizer's length, added tokens included
    corpus: str  # what was indexed, for people
    files: int  # documents indexed (files with at least one token)
    tokens: int  # corpus tokens, separators not counted
    format: int = FORMAT
    # a digest of the tokenizer's tokens and ids (`vocabulary_digest`; "": a datastore built before it was kept)
    vocabulary: str = ""


_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary_digest(tokenizer) -> str:
    """What tells two tokenizers' ids apart: a digest of every token and its id (two of one length may mean other
    text by the same ids). Made once per tokenizer object."""
    if tokenizer not in _DIGESTS:
        pairs = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
        _DIGESTS[tokenizer] = hashlib.sha256(pairs.encode()).hexdigest()[:16]
    return _DIGESTS[tokenizer]


@dataclass(frozen=True)
class SuffixRange:
    """The longest context suffix found: `length` tokens, at suffix-array rows [first, last)."""

    length: int
    first: int
    last: int

    @property
    def count(self) -> int:
        """How often it occurs in the corpus."""
        return self.last - self.first


class Datastore:
    """A tokenized corpus and its suffix array; read-only once made."""

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray, info: DatastoreInfo):
        if tokens.ndim != 1 or suffixes.shape != tokens.shape:
            raise ValueError(f"tokens and suffixes must be 1-D of one length, got {tokens.shape}, {suffixes.shape}")
        if tokens.size and tokens[-1] != SEPARATOR:
            raise ValueError("the token array must end with SEPARATOR")
        self.tokens = tokens  # [n] int32
        self.suffixes = suffixes  # [n] int32 or int64
        self.info = info

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, info: DatastoreInfo) -> Datastore:
        """Index a token array made by `join_documents`."""
        return cls(tokens, suffix_array(tokens), info)

    @classmethod
    def from_documents(
        cls, documents: Iterable[Sequence[int]], vocab_size: int, *, tokenizer: str = "", corpus: str = ""
    ) -> Datastore:
        """Index token id lists (tests, or corpora tokenized elsewhere)."""
        arrays = [np.asarray(d, dtype=np.int64).reshape(-1) for d in documents]
        for ids in arrays:
            if ids.size and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
                raise UserError(f"token ids must lie in [0, {vocab_size}), got {int(ids.min())} .. {int(ids.max())}")
        tokens = join_documents(arrays)
        files = int((tokens == SEPARATOR).sum())  # one separator per non-empty document
        info = DatastoreInfo(tokenizer, vocab_size, corpus, files, tokens.size - files)
        return cls.from_tokens(tokens, info)

    # --- Lookup

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """The suffix-array rows [first, last) of the suffixes that begin with `pattern` (equal: none).

        Two binary searches over the suffix array, each comparing the pattern with the first
        len(pattern) tokens of about log2(n) suffixes.
        """
        pattern = [int(t) for t in pattern]
        length, tokens = len(pattern), self.tokens

        def head(start) -> list[int]:
            start = int(start)
            return tokens[start : start + length].tolist()

        first = bisect_left(self.suffixes, pattern, key=head)
        return first, bisect_right(self.suffixes, pattern, first, key=head)

    def longest_match(
        self, context: Sequence[int], max_length: int = MAX_MATCH, min_length: int = MIN_MATCH
    ) -> SuffixRange | None:
        """The longest suffix of `context`, min_length to max_length tokens long, that occurs in the
        corpus; None if not even the shortest does.

        If the last k tokens occur, so do the last k - 1, so the length is found by binary search.
        """
        tail = [int(t) for t in context[len(context) - min(max_length, len(context)) :]]
        low, high, best = min_length, len(tail), None
        while low <= high:
            length = (low + high) // 2
            first, last = self.find(tail[len(tail) - length :])
            if last > first:
                best, low = SuffixRange(length, first, last), length + 1
            else:
                high = length - 1
        return best

    def continuations(self, match: SuffixRange, num_tokens: int, max_occurrences: int = MAX_OCCURRENCES) -> np.ndarray:
        """The tokens after the match's occurrences: at most `max_occurrences` of them, evenly spaced
        over its suffix-array rows (deterministic, and since those rows are sorted by what follows,
        a sample in proportion to each continuation's frequency).

        -> [occurrences, num_tokens] int32, each row cut at its document's end and padded with
        SEPARATOR; rows in lexicographic order (the suffix array's).
        """
        taken = min(match.count, max_occurrences)
        rows = match.first + (np.arange(taken, dtype=np.int64) * match.count) // taken  # [taken]
        starts = self.suffixes[rows].astype(np.int64) + match.length  # [taken]
        # The array ends with a separator, so clipping past its end reads a separator.
        index = np.minimum(starts[:, None] + np.arange(num_tokens), self.tokens.size - 1)  # [taken, num_tokens]
        window = self.tokens[index]
        inside = np.logical_and.accumulate(window != SEPARATOR, axis=1)
        return np.where(inside, window, SEPARATOR).astype(np.int32)

    # --- Files

    def save(self, path: str | Path) -> Path:
        """Write tokens, suffix array and info as one uncompressed .npz (loads in a fraction of a second);
        written under a temporary name and renamed, so a reader never sees half a file."""
        info = np.frombuffer(json.dumps(asdict(self.info)).encode(), dtype=np.uint8)

        def write(temporary: Path) -> None:
            with temporary.open("wb") as sink:
                np.savez(sink, tokens=self.tokens, suffixes=self.suffixes, info=info)

        return write_atomically(Path(path).expanduser(), write)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> Datastore:
        """Read a datastore written by `save`; with `vocab_size`, check that it was built for it."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise UserError(f"no datastore at {path}; make one with `specdecode datastore build CORPUS_DIR {path}`")
        try:
            with np.load(path, allow_pickle=False) as data:
                info = DatastoreInfo(**json.loads(data["info"].tobytes().decode()))
                tokens, suffixes = data["tokens"], data["suffixes"]
            store = cls(tokens, suffixes, info)  # (arrays of other shapes: a ValueError)
            _check_ids(tokens, suffixes, info.vocab_size)
        # (a file cut short; an empty one: EOFError)
        except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as error:
            raise UserError(
                f"{path} is not a retrieval datastore ({error}); rebuild it with `specdecode datastore build`"
            ) from None
        if info.format != FORMAT:
            raise UserError(f"{path} has datastore format {info.format}, this version reads {FORMAT}; rebuild it")
        if vocab_size is not None and info.vocab_size != vocab_size:
            raise UserError(
                f"the datastore {path} was built for a vocabulary of {info.vocab_size} tokens "
                f"({info.tokenizer or 'unknown tokenizer'}), the target's has {vocab_size}: rebuild it with "
                f"`specdecode datastore build CORPUS_DIR OUT --target <your target>`"
            )
        return store


def _check_ids(tokens: np.ndarray, suffixes: np.ndarray, vocab_size: int) -> None:
    """A ValueError unless the arrays hold what `save` writes: integer token ids of the vocabulary (or SEPARATOR),
    suffix rows within the array (an id out of range was drafted, and failed in the target's embedding)."""
    if not (np.issubdtype(tokens.dtype, np.integer) and np.issubdtype(suffixes.dtype, np.integer)):
        raise ValueError(f"its arrays hold {tokens.dtype} and {suffixes.dtype}, not token ids and positions")
    if not tokens.size:
        raise ValueError("it holds no tokens")
    ids = tokens[tokens != SEPARATOR]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"it holds token ids outside its vocabulary of {vocab_size}")
    if int(suffixes.min()) < 0 or int(suffixes.max()) >= tokens.size:
        raise ValueError("its suffix array points outside its tokens")


@lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int, size: int, vocab_size: int | None) -> Datastore:
    return Datastore.load(path, vocab_size)


def open_datastore(path: str | Path, vocab_size: int | None = None) -> Datastore:
    """`Datastore.load`, shared within the process while the file is unchanged (a benchmark builds
    one drafter per method and run; the arrays are read-only)."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        return Datastore.load(path, vocab_size)  # the UserError saying how to make one
    stat = path.stat()
    return _load_cached(str(path), stat.st_mtime_ns, stat.st_size, vocab_size)
