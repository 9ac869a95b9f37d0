"""Retrieval drafting (REST, He et al. 2024): copy what followed the context's end in a corpus.

No model: a *datastore* holds a tokenized corpus and its suffix array. Each step finds the longest
suffix of the context (2 to 16 tokens) that occurs in the corpus, gathers what followed its
occurrences, and drafts either the most frequent continuation (a chain) or all of them merged into a
trie and pruned to the nodes that pay on the target's cost curve (a tree). Where the corpus has nothing
to say, the step is plain decoding.

Glossary, on top of `specdecode.types`:

- *datastore*: one flat int32 array of corpus tokens, each document followed by `SEPARATOR` (an id no
  context ever holds, so no match spans two documents), and its suffix array.
- *match*: the longest suffix of the context found in the corpus, and the block of suffix-array rows
  of the suffixes that begin with it (its *occurrences*).
- *continuation*: the tokens after one occurrence, up to the draft depth or the end of its document.
- a trie node's *count*: the occurrences considered whose continuation passes through it; its score is
  count / occurrences considered, times the running calibration of predicted against accepted tokens.

The default datastore is the Python standard library's own source (see `default_datastore`), built on
first use for the target's tokenizer and cached as one .npz file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import sysconfig
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from specdecode.drafters.base import Drafter
from specdecode.errors import UserError
from specdecode.paths import cache_dir, console
from specdecode.models.base import CausalLM
from specdecode.models.costs import CostCurve
from specdecode.tree import structure
from specdecode.tree.budget import MAX_BUDGET, Calibration, best_budget, check_budget
from specdecode.types import Draft, SamplingParams, StepStats, Verdict

SEPARATOR = -1  # ends every document in the token array; below every real id, so it sorts first
FORMAT = 1  # the .npz layout; bump when it changes (the default datastore's cache key includes it)
MAX_MATCH = 16  # the longest context suffix looked up (REST's choice too)
MIN_MATCH = 2  # a single token matches almost anywhere and predicts little
MAX_OCCURRENCES = 4096  # occurrences of a match whose continuations are counted, evenly spaced
DEFAULT_PATTERN = "**/*.py"
BYTES_PER_TOKEN = 16  # memory at the peak of sorting, the tokens included (measured; see suffix_array)
DEFAULT_MAX_TOKENS = 100_000_000  # about 1.5 GiB while sorting
PIECE_CHARS = 1 << 20  # text tokenized per batch, and the most of one file tokenized in one piece
# Folders of the standard library left out of the default datastore: its test suite (17 MB, more than
# the library itself, mostly assertion boilerplate), installed third-party packages, and the
# generated codec tables of `encodings` (lines like `'\x00'  #  0x00 -> NULL` that would dominate the
# counts after any short match on them). What remains is 12 MB of library code.
STDLIB_SKIP = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings"})


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


@dataclass(frozen=True)
class Match:
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
        documents = [np.asarray(d, dtype=np.int64).reshape(-1) for d in documents]
        for ids in documents:
            if ids.size and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
                raise UserError(f"token ids must lie in [0, {vocab_size}), got {int(ids.min())} .. {int(ids.max())}")
        tokens = join_documents(documents)
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
    ) -> Match | None:
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
                best, low = Match(length, first, last), length + 1
            else:
                high = length - 1
        return best

    def continuations(self, match: Match, num_tokens: int, max_occurrences: int = MAX_OCCURRENCES) -> np.ndarray:
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
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        info = np.frombuffer(json.dumps(asdict(self.info)).encode(), dtype=np.uint8)
        try:
            with temporary.open("wb") as sink:
                np.savez(sink, tokens=self.tokens, suffixes=self.suffixes, info=info)
            temporary.replace(path)
        finally:
            temporary.unlink(missing_ok=True)
        return path

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
        except (OSError, ValueError, KeyError, TypeError) as error:
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
        return cls(tokens, suffixes, info)


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


# --- Tries of continuations ------------------------------------------------------------------------


@dataclass(frozen=True)
class Trie:
    """Continuations merged by shared prefixes; nodes depth by depth, so parents come first."""

    tokens: np.ndarray  # [nodes] int64
    parents: np.ndarray  # [nodes] int64, -1: follows the context
    counts: np.ndarray  # [nodes] int64, continuations through the node
    total: int  # continuations merged (empty ones included)


def build_trie(rows: np.ndarray) -> Trie:
    """Merge continuations into a trie. rows: [m, depth], sorted lexicographically (as `continuations`
    returns them), padded with SEPARATOR.

    In sorted rows, the continuations sharing a prefix are a block of consecutive rows, so each depth
    takes a few array operations: a node starts where a row's prefix differs from the row above.
    """
    m, depth = rows.shape
    real = rows != SEPARATOR  # [m, depth]; once False, False to the end of the row
    changed = np.ones((m, depth), dtype=bool)  # [m, depth] the prefix up to column d differs from the row above
    changed[1:] = np.logical_or.accumulate(rows[1:] != rows[:-1], axis=1)
    tokens, parents, counts = [], [], []
    parent_of_row = np.full(m, structure.ROOT, dtype=np.int64)  # each row's node one level up
    made = 0
    for d in range(depth):
        group = np.cumsum(changed[:, d]) - 1  # [m] the block (prefix of d + 1 tokens) of each row
        heads = np.flatnonzero(changed[:, d] & real[:, d])  # first row of each block that makes a node
        if not heads.size:
            break
        tokens.append(rows[heads, d].astype(np.int64))
        parents.append(parent_of_row[heads])
        counts.append(np.bincount(group)[group[heads]])
        node_of_group = np.full(int(group[-1]) + 1, structure.ROOT, dtype=np.int64)
        node_of_group[group[heads]] = made + np.arange(heads.size)
        parent_of_row = node_of_group[group]
        made += heads.size
    if not tokens:
        empty = np.empty(0, dtype=np.int64)
        return Trie(empty, empty, empty, m)
    return Trie(np.concatenate(tokens), np.concatenate(parents), np.concatenate(counts), m)


def heaviest_path(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The trie's path that takes the most frequent child at every node (ties: the smaller id), and the
    count at each of its nodes. rows: [m, depth] as for build_trie. -> ([k] int64, [k] int64)"""
    path, counts = [], []
    for d in range(rows.shape[1]):
        column = rows[:, d]
        values, sizes = np.unique(column[column != SEPARATOR], return_counts=True)
        if not values.size:
            break
        best = int(np.argmax(sizes))
        path.append(int(values[best]))
        counts.append(int(sizes[best]))
        rows = rows[column == values[best]]
    return np.array(path, dtype=np.int64), np.array(counts, dtype=np.int64)


# --- The drafters ----------------------------------------------------------------------------------


def _check_retrieval(num_tokens: int, max_match: int, min_match: int, max_occurrences: int) -> None:
    if num_tokens < 1:
        raise UserError(f"retrieval drafting needs num_tokens >= 1, got {num_tokens}")
    if not 1 <= min_match <= max_match:
        raise UserError(f"retrieval drafting needs 1 <= min_match <= max_match, got {min_match}, {max_match}")
    if max_occurrences < 1:
        raise UserError(f"retrieval drafting needs max_occurrences >= 1, got {max_occurrences}")


class _RetrievalDrafter(Drafter):
    """What the chain and tree forms share: the lookup and the calibration of their scores."""

    batchable = True  # no model: one instance per sequence serves a batch

    def __init__(self, datastore: Datastore, num_tokens: int, max_match: int, min_match: int, max_occurrences: int):
        _check_retrieval(num_tokens, max_match, min_match, max_occurrences)
        self.datastore = datastore
        self.num_tokens, self.max_match, self.min_match = num_tokens, max_match, min_match
        self.max_occurrences = max_occurrences
        self._calibration = Calibration()
        self._shares = np.empty(0)  # [len(last draft)] each node's count / occurrences considered

    def begin(self, prompt_ids: list[int]) -> None:
        self._calibration.reset()
        self._shares = np.empty(0)

    def _continuations(self, context: list[int], depth: int) -> np.ndarray | None:
        """[occurrences, depth] what followed the longest matching suffix of the context, or None."""
        match = self.datastore.longest_match(context, self.max_match, self.min_match)
        return None if match is None else self.datastore.continuations(match, depth, self.max_occurrences)

    def _scores(self, shares: np.ndarray) -> np.ndarray:
        """Acceptance estimates: the shares, scaled by how acceptance has compared with them so far."""
        return np.minimum(shares * self._calibration.factor, 1.0)

    def update(self, verdict: Verdict, stats: StepStats) -> None:
        self._calibration.record_verdict(self._shares, verdict)

    def _rows(self, context: list[int], max_tokens: int) -> np.ndarray | None:
        """The continuations (at most `num_tokens` and `max_tokens` deep) of the context's longest match."""
        self._shares = np.empty(0)
        depth = min(self.num_tokens, max_tokens)
        return self._continuations(context, depth) if depth > 0 else None


class RetrievalDrafter(_RetrievalDrafter):
    """REST as a chain: the most frequent continuation of the context's longest suffix found in the
    datastore. Its scores (count through each token / occurrences, calibrated) let the engine verify
    only the prefix that pays on the target's cost curve."""

    name = "rest"

    def __init__(
        self,
        datastore: Datastore,
        num_tokens: int = 16,
        max_match: int = MAX_MATCH,
        min_match: int = MIN_MATCH,
        max_occurrences: int = MAX_OCCURRENCES,
    ):
        super().__init__(datastore, num_tokens, max_match, min_match, max_occurrences)

    def propose(self, context, max_tokens, params: SamplingParams, generator) -> Draft:
        rows = self._rows(context, max_tokens)
        if rows is None:
            return Draft.empty()
        tokens, counts = heaviest_path(rows)
        if not tokens.size:  # every occurrence ends its document
            return Draft.empty()
        self._shares = counts / rows.shape[0]  # [k], non-increasing
        scores = torch.from_numpy(self._scores(self._shares)).float()
        return Draft(tokens=torch.from_numpy(tokens), scores=scores)


class RetrievalTreeDrafter(_RetrievalDrafter):
    """REST as a token tree: every continuation of the context's longest matching suffix, merged into
    a trie; the best nodes by score are kept, a fixed number (`budget`) or the number that maximises
    expected tokens per unit of time on the target's cost curve (as PromptLookupTreeDrafter)."""

    name = "rest-tree"

    def __init__(
        self,
        datastore: Datastore,
        curve: CostCurve,
        num_tokens: int = 10,
        max_match: int = MAX_MATCH,
        min_match: int = MIN_MATCH,
        max_occurrences: int = MAX_OCCURRENCES,
        budget: int | None = None,
    ):
        super().__init__(datastore, num_tokens, max_match, min_match, max_occurrences)
        check_budget(budget)
        self.curve, self.budget = curve, budget

    def propose(self, context, max_tokens, params: SamplingParams, generator) -> Draft:
        rows = self._rows(context, max_tokens)
        if rows is None:
            return Draft.empty()
        # 1. Merge the continuations into a trie; score each node.
        trie = build_trie(rows)
        shares = trie.counts / trie.total  # [nodes]
        scores = self._scores(shares)
        # 2. The best nodes, by score then node order. A child never outscores its parent and comes
        #    after it, so every prefix of this ranking is closed under ancestors.
        ranked = np.lexsort((np.arange(scores.size), -scores))[: self.budget or MAX_BUDGET]
        budget = self.budget or best_budget(scores[ranked].tolist(), self.curve, 0.0, cap=MAX_BUDGET)
        if budget == 0 or not ranked.size:  # nothing followed the match, or no node pays: a plain step
            return Draft.empty()
        keep = torch.from_numpy(np.sort(ranked[:budget]))
        self._shares = shares[keep.numpy()]
        return Draft(
            tokens=torch.from_numpy(trie.tokens)[keep],
            parents=structure.select(torch.from_numpy(trie.parents), keep),
            scores=torch.from_numpy(scores[keep.numpy()]).float(),
        )


# --- Building datastores from text -----------------------------------------------------------------


def corpus_files(folder: Path, pattern: str = DEFAULT_PATTERN, skip: frozenset[str] = frozenset()) -> list[Path]:
    """The files under `folder` matching the glob `pattern`, sorted, none inside a folder named in `skip`."""
    if not folder.is_dir():
        raise UserError(f"no such folder: {folder}")
    return sorted(
        path for path in folder.glob(pattern)
        if path.is_file() and not skip.intersection(path.relative_to(folder).parts[:-1])
    )


def _pieces(text: str, limit: int) -> Iterator[str]:
    """`text` in pieces of at most about `limit` characters, cut after a newline where there is one, so
    one huge file never has to be tokenized (and held as a list of ids) at once."""
    start = 0
    while len(text) - start > limit:
        cut = text.rfind("\n", start, start + limit) + 1 or start + limit
        yield text[start:cut]
        start = cut
    yield text[start:]


def build_datastore(
    folder: str | Path,
    tokenizer,
    *,
    pattern: str = DEFAULT_PATTERN,
    skip: frozenset[str] = frozenset(),
    corpus: str | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    progress: bool = True,
) -> Datastore:
    """Tokenize every file under `folder` matching `pattern` with `tokenizer` (a Hugging Face tokenizer,
    no special tokens) and index the tokens.

    Streams: files are read and tokenized in batches of about PIECE_CHARS characters (fast tokenizers
    encode a batch in parallel), and only their ids are kept, 4 bytes a token; the suffix sort then
    needs BYTES_PER_TOKEN in all for a while. Files are read as UTF-8, undecodable bytes replaced.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    folder = Path(folder).expanduser()
    files = corpus_files(folder, pattern, skip)
    if not files:
        raise UserError(f"no files match {pattern!r} under {folder}")
    parts: list[np.ndarray] = []
    documents = tokens = 0
    open_document = False  # the current file has tokens and no separator yet
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not progress) as bar:
        task = bar.add_task(f"Tokenizing {len(files):,} files", total=sum(path.stat().st_size for path in files))
        for batch, done in _batches(files):
            if not batch:
                bar.advance(task, done)
                continue
            ids = tokenizer(
                [piece for _, piece in batch], add_special_tokens=False, return_attention_mask=False, verbose=False
            )["input_ids"]
            for (last_piece, _), piece_ids in zip(batch, ids):
                if piece_ids:
                    parts.append(np.asarray(piece_ids, dtype=np.int32))
                    tokens += len(piece_ids)
                    open_document = True
                if last_piece and open_document:
                    parts.append(np.full(1, SEPARATOR, dtype=np.int32))
                    documents += 1
                    open_document = False
            if tokens > max_tokens:
                raise UserError(
                    f"the corpus passed {max_tokens:,} tokens; sorting it would need over "
                    f"{BYTES_PER_TOKEN * max_tokens / 2**30:.1f} GiB. Pick fewer files (--pattern) or raise "
                    f"--max-tokens."
                )
            bar.advance(task, done)
    vocab_size = len(tokenizer)
    info = DatastoreInfo(
        tokenizer=str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
        vocab_size=vocab_size,
        corpus=corpus or f"{folder} ({pattern})",
        files=documents,
        tokens=tokens,
    )
    with console.status(f"Sorting the suffixes of {tokens:,} tokens") if progress else contextlib.nullcontext():
        flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
        del parts
        if flat.size and int(flat.max()) >= vocab_size:
            raise UserError(f"the tokenizer produced id {int(flat.max())}, beyond its length {vocab_size}")
        return Datastore.from_tokens(flat, info)


def _batches(files: list[Path]) -> Iterator[tuple[list[tuple[bool, str]], int]]:
    """Batches of (is the file's last piece, text piece) of about PIECE_CHARS characters, and the
    bytes of the files finished with each batch."""
    batch: list[tuple[bool, str]] = []
    chars = done = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise UserError(f"cannot read {path}: {error.strerror}") from None
        pieces = list(_pieces(text, PIECE_CHARS))
        for index, piece in enumerate(pieces):
            batch.append((index == len(pieces) - 1, piece))
            chars += len(piece)
            if chars >= PIECE_CHARS:
                yield batch, done
                batch, chars, done = [], 0, 0
        done += path.stat().st_size
    if batch or done:
        yield batch, done


# --- The default datastore: the standard library ---------------------------------------------------


def stdlib_folder() -> Path:
    """The running Python's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_datastore_path(tokenizer) -> Path:
    """Where the standard-library datastore for `tokenizer` is cached: the file name's key covers the
    tokenizer (name and length), the library (path and Python version), what is skipped and the format."""
    name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    key = "|".join([name, str(len(tokenizer)), str(stdlib_folder()), sys.version, DEFAULT_PATTERN,
                    ",".join(sorted(STDLIB_SKIP)), str(FORMAT)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "datastores" / f"stdlib-py{version}-{digest}.npz"


def default_datastore(tokenizer, *, progress: bool = True) -> Path:
    """The path of the standard-library datastore for `tokenizer`, built on first use (about a minute)."""
    path = default_datastore_path(tokenizer)
    if not path.is_file():
        if progress:
            console.print(f"Building the default retrieval datastore (the standard library, once): {path}")
        folder = stdlib_folder()
        datastore = build_datastore(folder, tokenizer, skip=STDLIB_SKIP, progress=progress,
                                    corpus=f"Python {sys.version.split()[0]} standard library, {folder}, "
                                           f"without {', '.join(sorted(STDLIB_SKIP))}")
        datastore.save(path)
    return path


def build_retrieval(target: CausalLM, draft: CausalLM | None, options) -> Drafter:
    """The `rest` method's drafter: `options.datastore` (a path), else the standard-library datastore
    for `options.tokenizer`; a tree when `options.tree` (sized by `options.budget` or the target's cost
    curve). `options` is a `DrafterOptions`."""
    if options.datastore is not None:
        # The tokenizer's length when known; the logits may be wider than it (Qwen2.5 pads them).
        expected = len(options.tokenizer) if options.tokenizer is not None else None
        datastore = open_datastore(options.datastore, expected)
        if datastore.info.vocab_size > target.vocab_size:
            raise UserError(
                f"the datastore {options.datastore} was built for a vocabulary of {datastore.info.vocab_size} "
                f"tokens, more than the target's {target.vocab_size}: rebuild it with the target's tokenizer"
            )
    elif options.tokenizer is not None:
        datastore = open_datastore(default_datastore(options.tokenizer), len(options.tokenizer))
    else:
        raise UserError("retrieval drafting needs a datastore (`specdecode datastore build`) or the target's "
                        "tokenizer to build the default one from the standard library")
    if not options.tree:
        return RetrievalDrafter(datastore)
    return RetrievalTreeDrafter(datastore, target.cost_curve(), budget=options.budget)
