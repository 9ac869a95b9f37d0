"""A user's own prompts as benchmark tasks (`specdecode bench --prompts FILE`), run beside or instead of the
benchmark's categories and reported the same way.

The file is JSON Lines (`.jsonl` or `.ndjson`: one object a line, `{"prompt": "..."}` or `{"turns": ["...",
"..."]}` for a conversation whose later turns are asked after the model's own answers, with an optional `"id"` and
`"category"`, "own" by default) or text (any other name but `.json`: one prompt a line). Blank lines are skipped.
Every prompt is reported on: a user's own prompts tune nothing of ours, so none is set aside for tuning
(`bench.samples.part_of`)."""

from __future__ import annotations

import json
from pathlib import Path

from specdecode.bench.datasets import CATEGORIES, Task
from specdecode.bench.report import OVERALL
from specdecode.errors import UserError

OWN = "own"  # the category of a prompt that names none
FIELDS = {"id", "prompt", "turns", "category"}


def read_prompts(path: Path) -> list[Task]:
    """The file's prompts as tasks, in order; a UserError naming the line of anything that is not one."""
    kind = path.suffix.lower()
    if kind == ".json":
        raise UserError(f"--prompts {path}: a .json file is one JSON value; give JSON Lines (one object a line) as "
                        ".jsonl, or text as one prompt a line")
    try:
        text = path.read_text(encoding="utf-8-sig")  # (a byte-order mark is not the first line's)
    except FileNotFoundError:
        raise UserError(f"--prompts {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--prompts {path} cannot be read as UTF-8 text: {error}") from None
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise UserError(f"--prompts {path} holds no prompt")
    tasks = [_task(path, number, line) if kind in (".jsonl", ".ndjson") else Task(OWN, str(number), (line,))
             for number, line in lines]
    seen: set[tuple[str, str]] = set()
    for task in tasks:
        if (task.category, task.task_id) in seen:
            raise UserError(f"--prompts {path}: the id {task.task_id!r} comes twice in category {task.category!r}")
        seen.add((task.category, task.task_id))
    return tasks


def _task(path: Path, number: int, line: str) -> Task:
    where = f"--prompts {path}, line {number}"
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as error:
        raise UserError(f"{where}: not a JSON object ({error.msg})") from None
    if not isinstance(entry, dict):
        raise UserError(f"{where}: not a JSON object")
    if unknown := set(entry) - FIELDS:
        raise UserError(f"{where}: unknown field {sorted(unknown)[0]!r}; the fields are {', '.join(sorted(FIELDS))}")
    if ("prompt" in entry) == ("turns" in entry):
        raise UserError(f"{where}: give a prompt or turns (one of the two)")
    turns = [entry["prompt"]] if "prompt" in entry else entry["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise UserError(f"{where}: a prompt is text that is not blank, and turns a list of them")
    category = entry.get("category", OWN)
    if not isinstance(category, str) or not category.strip() or "/" in category or category in [*CATEGORIES, OVERALL]:
        raise UserError(f"{where}: a category is a name without '/' that is not one of the benchmark's "
                        f"({', '.join(CATEGORIES)}) nor {OVERALL!r} (the report's column of every prompt), got "
                        f"{category!r}")
    identifier = entry.get("id", number)
    if not isinstance(identifier, str | int) or isinstance(identifier, bool) or not str(identifier).strip():
        raise UserError(f"{where}: an id is a text or a whole number, got {identifier!r}")
    return Task(category, str(identifier), tuple(turns))
