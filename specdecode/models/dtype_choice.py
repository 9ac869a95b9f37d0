"""The latest path `dtype="auto"` took for each model on this machine (`models.precision`), kept where
`specdecode methods` reads it without importing torch."""

from __future__ import annotations

import json
from pathlib import Path

from specdecode.paths import cache_dir

LATEST = "dtype-auto.json"  # {model folder name: path}


def remember(model_key: str, choice: str) -> None:
    """Record the path chosen for the model whose folder is `model_key`."""
    path = cache_dir() / LATEST
    known = json.loads(path.read_text()) if path.is_file() else {}
    known[Path(model_key).name] = choice
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(known))


def cached_choice(name: str) -> str | None:
    """The path last chosen for a model (its folder's name, e.g. the registered name), or None."""
    path = cache_dir() / LATEST
    return json.loads(path.read_text()).get(name) if path.is_file() else None
