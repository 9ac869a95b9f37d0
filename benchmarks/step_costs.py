"""Where each method's decoding time goes, per category, from full benchmark records (with their steps): per step,
the tokens it added, its drafting and verifying time, the forward's width (tokens fed), the share of plain
steps; and milliseconds per token. The first step of each turn (the prompt's feeding) is left out.

    python benchmarks/step_costs.py RECORDS.jsonl[.gz] [--categories summarisation,rag]

Records written by `specdecode bench` keep their steps; `over_peer.py --slim` drops them.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def read(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as file:
        return [json.loads(line) for line in file if line.strip()]


def table(records: list[dict], categories: set[str] | None) -> list[str]:
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for record in records:
        if record["repeat"] < 0 or record.get("error") or not record.get("steps"):
            continue
        if categories is not None and record["category"] not in categories:
            continue
        # a turn's first step feeds its prompt: the record's first step, and later ones that drafted nothing and fed
        # more tokens than any draft does (a later turn's prompt)
        steps = [s for i, s in enumerate(record["steps"])
                 if i > 0 and not (s["drafted"] == 0 and s["forward_tokens"] > 64)]
        total = sums[record["method"]]
        total["steps"] += len(steps)
        total["tokens"] += sum(s["new_tokens"] for s in steps)
        total["draft"] += sum(s["draft_seconds"] for s in steps)
        total["verify"] += sum(s["verify_seconds"] for s in steps)
        total["width"] += sum(s["forward_tokens"] for s in steps)
        total["plain"] += sum(1 for s in steps if s["drafted"] == 0)
    lines = ["| method | steps | tokens / step | drafting ms / step | verifying ms / step | forward width "
             "| plain steps | ms / token |", "|---|---|---|---|---|---|---|---|"]
    for method, t in sorted(sums.items()):
        n = t["steps"] or 1
        lines.append(f"| `{method}` | {t['steps']:.0f} | {t['tokens'] / n:.2f} | {t['draft'] / n * 1e3:.2f} | "
                     f"{t['verify'] / n * 1e3:.1f} | {t['width'] / n:.2f} | {t['plain'] / n:.0%} | "
                     f"{(t['draft'] + t['verify']) / max(t['tokens'], 1) * 1e3:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path)
    parser.add_argument("--categories", default=None, help="comma-separated (default: all)")
    args = parser.parse_args()
    categories = None if args.categories is None else {c.strip() for c in args.categories.split(",") if c.strip()}
    print("\n".join(table(read(args.records), categories)))


if __name__ == "__main__":
    main()
