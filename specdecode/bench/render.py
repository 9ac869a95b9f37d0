"""A benchmark's report rendered again from the folder of its run (`specdecode bench --render DIR`): after a run
stopped with Ctrl-C (its records kept, no report written), or to read kept records through the report as it is
now. What the run knew beside its records is read from its outcome.json (which rows are lossless, each row's
reference, the notes of its exactness check) and settings.json; a run without them (stopped before its end, or
older than outcome.json) has its method rows' losslessness from the registry, other rows left uncompared, and a
note saying what the report lacks. An engines-under-load table (levels.jsonl) is not rendered again."""

from __future__ import annotations

import json
from pathlib import Path

from specdecode.bench import report
from specdecode.bench.harness import read_records
from specdecode.errors import UserError
from specdecode.methods import resolve

OUTCOME = "outcome.json"


def save_outcome(out: Path, lossless: dict[str, bool], references: dict[str, str], reference: str,
                 notes: list[str]) -> None:
    """What the run knew beside its records, for `render`."""
    (out / OUTCOME).write_text(json.dumps({"lossless": lossless, "references": references, "reference": reference,
                                           "notes": notes}, indent=1) + "\n")


def render(folder: Path) -> tuple[list[report.MethodSummary], str, list[str]]:
    """`folder`'s report.md and plots written again from its records; returns the summaries, the reference row
    and the notes (for the terminal's tables)."""
    path = folder / "records.jsonl"
    if not path.is_file():
        raise UserError(f"--render {folder}: no records.jsonl there (the folder a bench run wrote into)")
    try:
        records = read_records(path)
    except (ValueError, KeyError, TypeError) as error:
        raise UserError(f"--render {path}: not a bench run's records ({type(error).__name__}: {error})") from None
    if not records:
        raise UserError(f"--render {path} holds no record")
    rows = list(dict.fromkeys(record.method for record in records))
    settings = _json(folder / "settings.json") or {}
    known = _json(folder / OUTCOME)
    if known is not None:
        lossless, references, reference, notes = (known["lossless"], known["references"], known["reference"],
                                                  known["notes"])
    else:
        lossless = {row: _lossless(row) for row in rows}
        references, reference = {}, "ar" if "ar" in rows else rows[0]
        why = "a run older than outcome.json" if settings else "a run stopped before its end"
        notes = [f"Rendered again from {path.name} alone ({why}): where outputs differ they were not diagnosed, and "
                 "only the registry's lossless methods were compared with the reference."]
    summaries = report.summarise(records, lossless, reference, references)
    (folder / "report.md").write_text(report.markdown(summaries, settings, notes, reference, None))
    report.plots(summaries, folder)
    return summaries, reference, notes


def _lossless(row: str) -> bool:
    try:
        return resolve(row)[0].lossless
    except UserError:  # a peer or an engine: not known here, so not compared
        return False


def _json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise UserError(f"--render: {path} is not JSON ({error})") from None
    return data if isinstance(data, dict) else None
