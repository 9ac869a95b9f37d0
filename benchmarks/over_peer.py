"""Speedups over one row of a benchmark run (llama.cpp's plain decoding by default), from its records.

    python benchmarks/over_peer.py RECORDS.jsonl [--baseline llamacpp-ar] [--slim OUT.jsonl]

Each run's tokens per second is divided by the baseline's on the same prompt and repeat (the pairs of one
interleaved run); per method the table gives the median of those ratios per category, over all categories
(median and geometric mean) and over the open-ended ones (multi-turn, qa, math, translation). `--slim` writes
the records with only the fields this needs, small enough to keep beside a report.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from specdecode.bench.harness import run_records
from specdecode.errors import UserError

OPEN_ENDED = ("multi-turn", "qa", "math", "translation")
FIELDS = ("method", "category", "task_id", "repeat", "turn_lengths", "seconds", "prefill_seconds", "error")


def rates(records: list[dict]) -> dict[tuple[str, tuple[str, str], int], tuple[float, str]]:
    """(method, (category, task id), repeat) -> (new tokens per second, category), failed and warm-up runs left
    out."""
    out = {}
    for r in records:
        if r["repeat"] < 0 or r["error"] or not r["seconds"]:
            continue
        # (a task is its category and id: code and code-edit share HumanEval's ids)
        out[r["method"], (r["category"], r["task_id"]), r["repeat"]] = (sum(r["turn_lengths"]) / r["seconds"],
                                                                        r["category"])
    return out


def table(records: list[dict], baseline: str) -> list[str]:
    measured = rates(records)
    categories = sorted({category for _, category in measured.values()})
    methods = sorted({method for method, _, _ in measured} - {baseline})
    lines = [f"| method | {' | '.join(categories)} | overall (median) | overall (geometric mean) "
             "| open-ended (median) |",
             "|---|" + "---|" * (len(categories) + 3)]
    for method in methods:
        per: dict[str, list[float]] = defaultdict(list)
        for (name, task, repeat), (rate, category) in measured.items():
            if name == method and (baseline, task, repeat) in measured:
                per[category].append(rate / measured[baseline, task, repeat][0])
        every = [x for values in per.values() for x in values]
        if not every:
            continue
        opened = [x for c in OPEN_ENDED for x in per.get(c, [])]
        cells = [f"{statistics.median(per[c]):.2f}x" if per.get(c) else "-" for c in categories]
        cells += [f"{statistics.median(every):.2f}x", f"{statistics.geometric_mean(every):.2f}x",
                  f"{statistics.median(opened):.2f}x" if opened else "-"]
        lines.append(f"| `{method}` | {' | '.join(cells)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path)
    parser.add_argument("--baseline", default="llamacpp-ar")
    parser.add_argument("--slim", type=Path, default=None)
    args = parser.parse_args()
    try:
        records = run_records(args.records)
    except UserError as error:
        raise SystemExit(f"error: {error}") from None
    measured = rates(records)
    if not any(method == args.baseline for method, _, _ in measured):
        raise SystemExit(f"error: no usable run of {args.baseline} in {args.records} (none, or every one failed)")
    if not any(method != args.baseline for method, _, _ in measured):
        raise SystemExit(f"error: only {args.baseline} ran in {args.records}: nothing to compare with it")
    print("\n".join(table(records, args.baseline)))
    if args.slim is not None:
        args.slim.write_text("".join(json.dumps({k: r.get(k) for k in FIELDS}) + "\n" for r in records))


if __name__ == "__main__":
    main()
