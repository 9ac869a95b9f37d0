"""Where the package writes: its cache folder, how a cache file is written and set aside, and the console
its progress goes to.

At the bottom of the package (it imports nothing of it), so any layer can cache a file or show progress
without importing model loading.

Every cache file goes through `write_atomically` (a temporary file in the same folder, then `os.replace`), so a
kill, a full disk or a second process writing the same file leaves the old file or the new one, never half of
one. A reader that still finds a file it cannot read (edited by hand, a disk error) moves it aside with
`set_aside` (one warning line) and makes it again: a cache never stops a start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

# progress goes to stderr, so stdout stays clean for the command line; a message is never folded at the width (a
# log that is no terminal has 80 columns), so a path it names stays whole, to copy
console = Console(stderr=True, soft_wrap=True)


def cache_dir() -> Path:
    """Root of everything this package caches: `$SPECDECODE_CACHE`, else `~/.cache/specdecode`; a file there is
    the user's mistake, said in one line (every store under it would fail, each in its own words)."""
    root = os.environ.get("SPECDECODE_CACHE")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "specdecode"
    if path.exists() and not path.is_dir():
        from specdecode.errors import UserError

        raise UserError(f"the cache folder {path} is a file ({'SPECDECODE_CACHE' if root else 'the default'}): "
                        "give SPECDECODE_CACHE a folder")
    return path


log = logging.getLogger("specdecode.cache")
T = TypeVar("T")


def output_folder(path: Path, option: str) -> Path:
    """A folder a command writes into, made now: a file in its place or one that cannot be made is the user's
    mistake, said in one line before any work (`errors.UserError`; imported where it is raised, as nothing else of
    the package)."""
    from specdecode.errors import UserError

    if path.exists() and not path.is_dir():
        raise UserError(f"{option} {path} is a file; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"{option} {path} cannot be made: {error.strerror or error}") from None
    return path


def write_atomically(path: Path, content: str | bytes | Callable[[Path], object]) -> Path:
    """Write `path` whole or not at all: `content` (text as UTF-8, bytes, or a function that writes the file
    at the path it is given, as safetensors' `save_file` does) goes to a temporary file beside it, which
    `os.replace` then puts in its place; a failure removes the temporary and leaves `path` as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # named by process and thread: two writers of one file never share a temporary
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        if isinstance(content, str):
            temporary.write_text(content, encoding="utf-8")
        elif isinstance(content, bytes):
            temporary.write_bytes(content)
        else:
            content(temporary)
            os.chmod(temporary, 0o666 & ~_umask())  # (safetensors writes 0600: an export another user serves)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def _reason(error: BaseException) -> str:
    """Why a file did not read, in one short line: the error's first line, or its type."""
    return (str(error).splitlines() or [""])[0][:160] or type(error).__name__


def _umask() -> int:
    """The process's file-mode creation mask, read without setting it (Linux's /proc; else the usual 022)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("Umask:"))
        return int(line.split()[1], 8)
    return 0o022


@contextlib.contextmanager
def damaged(path: Path, what: str, fix: str):
    """What reads `path` (a file the project wrote: a manifest, a head's weights) fails as a one-line UserError naming
    it, and `fix`, where the file does not read (cut short by a kill, a full disk, edited by hand)."""
    from specdecode.errors import UserError

    try:
        yield
    except UserError:
        raise
    except Exception as error:  # (safetensors' SafetensorError, JSON's, a shape that does not fit)
        raise UserError(f"{path} ({what}) is damaged: {_reason(error)}; {fix}") from error


def read_record(path: Path, what: str, fix: str) -> Any:
    """The JSON of a file the project wrote (`damaged`'s one line where it does not read)."""
    with damaged(path, what, fix):
        return json.loads(Path(path).read_text(encoding="utf-8"))


def set_aside(path: Path, what: str, reason: str, then: str) -> Path:
    """Move the unreadable cache file `path` out of the way, as `<name>.broken` beside it (kept for a look;
    an older one is replaced), with a one-line warning naming both, what the file held (`what`), why it is
    unreadable (`reason`) and what the caller does instead (`then`). Returns where it went."""
    aside = path.with_name(path.name + ".broken")
    with contextlib.suppress(FileNotFoundError):  # another process may have moved it already
        os.replace(path, aside)
    log.warning("the cached %s %s is unusable (%s): moved to %s; %s", what, path, reason, aside, then)
    return aside


def read_json_cache(path: Path, what: str, then: str, parse: Callable[[Any], T]) -> T | None:
    """`parse` of the JSON in the cache file `path`, or None: no such file, or one that cannot be read (not UTF-8
    JSON, or a shape `parse` refuses by raising ValueError, KeyError or TypeError), which is then set aside
    (`set_aside`, with `what` and `then`) for the caller to make again."""
    if not path.is_file():
        return None
    try:
        return parse(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
        set_aside(path, what, _reason(error), then)
        return None


def mapping(data: Any) -> dict:
    """`data` if it is a JSON object (a `read_json_cache` parse), else a TypeError."""
    if not isinstance(data, dict):
        raise TypeError(f"a {type(data).__name__}, not an object")
    return data
