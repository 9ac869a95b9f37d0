"""A file's content digest, read once per version of the file (the prepared weights' key, `models.prepared`).

The digest is blake2b (128 bits) of the file's bytes, read in chunks. A model's weights are gigabytes, so each
digest is kept in `<cache>/digests.json` with the identity of the file it was read from: device, inode, size,
modification time and status-change time. A kept digest serves while all five match; otherwise the file is read
again. The status-change time (ctime) is what makes this honest: every write to a file sets it to the clock's
time, and unlike the modification time no ordinary tool sets it back (`touch -d`, `cp -p`, an unpacked archive
set mtime only), so a file rewritten with the same size and modification time is still read again the first time
its digest is asked for. What is trusted is that a file whose ctime did not move was not written: only a clock set
back or a write to the raw device gets past that. A rename, `chmod` or new hard link moves ctime too, which costs
one more read, never a wrong digest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from specdecode.paths import cache_dir, mapping, read_json_cache, write_atomically

CHUNK = 1 << 22  # bytes read at a time


def store() -> Path:
    """Where the digests read so far are kept."""
    return cache_dir() / "digests.json"


def digest(path: Path) -> str:
    """blake2b (128 bits, hex) of the bytes of `path`, read now."""
    hasher = hashlib.blake2b(digest_size=16)
    with path.open("rb") as source:
        while block := source.read(CHUNK):
            hasher.update(block)
    return hasher.hexdigest()


def identity(path: Path) -> list[int]:
    """What names a version of the file at `path`: device, inode, size, modification and status-change times."""
    stat = path.stat()
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def digests(files: Iterable[Path]) -> list[str]:
    """The content digest of each of `files` (symbolic links followed), read only for a file not read before in
    this version (module docstring); the ones read are kept for the next call, in this process or another."""
    kept = _kept()
    out, changed = [], False
    for path in files:
        path = path.resolve()
        now = identity(path)  # before reading: a write during the read leaves a stale identity, read again later
        entry = kept.get(str(path))
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == now and isinstance(entry[1], str)):
            entry = [now, digest(path)]
            kept[str(path)] = entry
            changed = True
        out.append(entry[1])
    if changed:
        kept = {name: entry for name, entry in kept.items() if Path(name).exists()}  # (files deleted since)
        with contextlib.suppress(OSError):  # a read-only cache: the digests are read again next time
            write_atomically(store(), json.dumps(kept))
    return out


def _kept() -> dict:
    """The digests kept, by resolved path; {} when none are, or when the file cannot be read (moved aside)."""
    return read_json_cache(store(), "record of file digests", "reading the files again", mapping) or {}
