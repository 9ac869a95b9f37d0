"""Building datastores from text: tokenizing a folder of files in batches, and the default datastore
(the running Python's standard library), built once per tokenizer and cached."""

from __future__ import annotations

import contextlib
import hashlib
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from specdecode.drafters.retrieval.datastore import (FORMAT, SEPARATOR, Datastore, DatastoreInfo, open_datastore,
                                                     vocabulary_digest)
from specdecode.drafters.retrieval.defaults import DEFAULT_MAX_TOKENS, DEFAULT_PATTERN
from specdecode.errors import UserError
from specdecode.paths import cache_dir, console, set_aside

BYTES_PER_TOKEN = 16  # memory at the peak of sorting, the tokens included (measured; see suffix_array)
PIECE_CHARS = 1 << 20  # text tokenized per batch, and the most of one file tokenized in one piece
# Folders of the standard library left out of the default datastore: its test suite (17 MB, more than
# the library itself, mostly assertion boilerplate), installed third-party packages, and the
# generated codec tables of `encodings` (lines like `'\x00'  #  0x00 -> NULL` that would dominate the
# counts after any short match on them). What remains is 12 MB of library code.
STDLIB_SKIP = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings"})


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
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeElapsedColumn

    from specdecode.progress import Progress

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
    if not tokens:
        raise UserError(f"the files under {folder} matching {pattern} hold no text to index")
    vocab_size = len(tokenizer)
    info = DatastoreInfo(
        tokenizer=str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
        vocab_size=vocab_size,
        corpus=corpus or f"{folder} ({pattern})",
        files=documents,
        tokens=tokens,
        vocabulary=vocabulary_digest(tokenizer),
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
    """The path of the standard-library datastore for `tokenizer`, built on first use (about a minute), and
    again when the file kept cannot be read (moved aside with a warning, `paths.set_aside`)."""
    path = default_datastore_path(tokenizer)
    if path.is_file():
        try:
            open_datastore(path, len(tokenizer))  # (kept for the process: the drafter's own open reads nothing)
            return path
        except UserError as error:  # cut short or damaged: built again
            set_aside(path, "retrieval datastore", str(error).splitlines()[0][:160], "building it again")
    if progress:
        console.print(f"Building the default retrieval datastore (the standard library, once): {path}")
    folder = stdlib_folder()
    datastore = build_datastore(folder, tokenizer, skip=STDLIB_SKIP, progress=progress,
                                corpus=f"Python {sys.version.split()[0]} standard library, {folder}, "
                                       f"without {', '.join(sorted(STDLIB_SKIP))}")
    return datastore.save(path)
