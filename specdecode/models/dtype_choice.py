"""The latest path `dtype="auto"` took for each model on this machine (`models.precision`), kept where
`specdecode methods` reads it without importing torch. Written atomically; a file that cannot be read is moved
aside with a warning and counts as empty (`paths.set_aside`)."""

from __future__ import annotations

import json
from pathlib import Path

from specdecode.paths import cache_dir, set_aside, write_atomically

LATEST = "dtype-auto.json"  # {model folder name: path}


def remember(model_key: str, choice: str) -> None:
    """Record the path chosen for the model whose folder is `model_key`."""
    known = _known()
    known[Path(model_key).name] = choice
    write_atomically(cache_dir() / LATEST, json.dumps(known))


def cached_choice(name: str) -> str | None:
    """The path last chosen for a model (its folder's name, e.g. the registered name), or None."""
    choice = _known().get(name)
    return choice if isinstance(choice, str) else None


def _known() -> dict:
    """Every model's latest path; {} when none was chosen yet or the file cannot be read (then moved aside)."""
    path = cache_dir() / LATEST
    if not path.is_file():
        return {}
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(known, dict):
            raise ValueError("not a mapping of model names to paths")
    except (OSError, UnicodeDecodeError, ValueError) as error:
        set_aside(path, "record of dtype choices", str(error).splitlines()[0][:120], "taken as none")
        return {}
    return known
