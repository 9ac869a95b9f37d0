"""The latest path `dtype="auto"` took for each model on this machine (`models.precision`), kept where
`specdecode methods` reads it without importing torch. Written atomically; a file that cannot be read is moved
aside with a warning and counts as empty (`paths.set_aside`)."""

from __future__ import annotations

import json
from pathlib import Path

from specdecode.paths import cache_dir, mapping, read_json_cache, write_atomically

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
    return read_json_cache(cache_dir() / LATEST, "record of dtype choices", "taken as none", mapping) or {}
