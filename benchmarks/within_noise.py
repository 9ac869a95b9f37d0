"""Is one method as fast as the best of the others in every category, within noise? From benchmark records.

    python benchmarks/within_noise.py RECORDS.jsonl [MORE.jsonl ...] [--method auto] [--rivals pld,suffix]
                                      [--decoding-alone]

Each run's tokens per second is paired with every rival's on the same prompt and repeat (one interleaved run;
several files are pooled, a pair never crossing files). Per category and rival: the geometric mean of
`method / rival` over the pairs and a 90% interval for it (Student's t over the pairs' log ratios: the noise of
the measurement on these prompts, not a claim about other prompts). The category's verdict is against its
strongest rival (the lowest geometric mean): *ahead* where the whole interval is above 1, *behind* where it is all
below 1, *level* where it lies within 5% of 1 either way (`bench.noise.MARGIN`: equivalence shown), *unresolved*
where it holds 1 but reaches further (no gap found, and none up to the interval's ends ruled out). Beside it, the
smallest gap the run would find four times in five at its noise (`bench.noise.detectable`), and the one-sided
p-value of *behind* against that rival after Holm's step-down over every rival in every category (`bench.noise.holm`:
below 0.05, a *behind* that stands with the chance of any false one in the family under 5%); under the table the
chance that noise alone reads some category *behind* unadjusted, and how many comparisons stand after Holm; then
the repeat noise of the run: how far one run of a prompt lies from the mean of its repeats (one method, the root
mean square over methods and prompts), what two runs of the very same work differ by here.

`--decoding-alone`: the rates after the first token of each turn (the records' `prefill_seconds` left out),
where the prompt's feeding is the same work for every method and its time only adds noise to the comparison.

Rivals: every other method in the records but `ar` (the default), llama.cpp's rows included; lossy rows are not
told apart (pass --rivals to choose).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from pathlib import Path

from specdecode.bench.harness import run_records
from specdecode.bench.noise import chance_of_a_false_behind, detectable, holm, interval, p_behind, verdict
from specdecode.errors import UserError

Key = tuple[int, str, int]  # (file, task, repeat)


def load(paths: list[Path], decoding_alone: bool = False) -> dict[str, dict[str, dict[Key, float]]]:
    """category -> method -> (file, task, repeat) -> log tokens per second; failed and warm-up runs left out
    (and with `decoding_alone`, runs without a prefill time: slimmed records, llama.cpp's rows)."""
    out: dict[str, dict[str, dict[Key, float]]] = defaultdict(lambda: defaultdict(dict))
    seen: dict[tuple, Path] = {}
    for index, path in enumerate(paths):
        for record in run_records(path):
            if record["repeat"] < 0 or record["error"] or not record["seconds"]:
                continue
            # a run given twice (a file and its slimmed copy, the same lines in another order) would count its
            # pairs twice: a narrower interval from the same evidence
            run = (record["method"], record["category"], record["task_id"], record["repeat"], record["seconds"])
            if run in seen:
                raise UserError(f"a run is in the records twice ({record['method']} on {record['task_id']}, repeat "
                                f"{record['repeat']}: {seen[run]} and {path}): each run counts once")
            seen[run] = path
            tokens, seconds = sum(record["turn_lengths"]), record["seconds"]
            if decoding_alone:
                if record.get("prefill_seconds") is None:
                    continue
                tokens, seconds = tokens - len(record["turn_lengths"]), seconds - record["prefill_seconds"]
                if tokens < 1 or seconds <= 0:
                    continue
            rate = tokens / seconds
            out[record["category"]][record["method"]][index, record["task_id"], record["repeat"]] = math.log(rate)
    return out


def repeat_noise(measured: dict[str, dict[str, dict[Key, float]]]) -> float:
    """Root mean square deviation of a log rate from its prompt's mean over repeats (one method, one prompt)."""
    squares, count = 0.0, 0
    for methods in measured.values():
        for runs in methods.values():
            by_prompt: dict[tuple[int, str], list[float]] = defaultdict(list)
            for (index, task, _), value in runs.items():
                by_prompt[index, task].append(value)
            for values in by_prompt.values():
                if len(values) > 1:
                    centre = statistics.fmean(values)
                    squares += sum((v - centre) ** 2 for v in values)
                    count += len(values) - 1
    return math.sqrt(squares / count) if count else float("nan")


def table(measured, method: str, rivals: list[str] | None) -> list[str]:
    lines = [f"| category | strongest rival | `{method}` / rival (geometric mean) | 90% interval | pairs | verdict "
             "| gap it would find | every rival | *behind*: Holm's p |", "|---|---|---|---|---|---|---|---|---|"]
    judged: dict[str, list[tuple]] = {}  # category -> (rival, pairs, mean, low, high, gap, p of behind)
    for category in sorted(measured):
        runs = measured[category]
        if method not in runs:
            continue
        others = [m for m in (rivals or sorted(runs)) if m in runs and m != method and (rivals or m != "ar")]
        rows = []
        for rival in others:
            pairs = [value - runs[rival][key] for key, value in runs[method].items() if key in runs[rival]]
            if pairs:
                rows.append((rival, len(pairs), *interval(pairs), detectable(pairs), p_behind(pairs)))
        if rows:
            judged[category] = rows
    # the family: every rival in every category, so that picking the slowest-looking rival is paid for
    family = [row for rows in judged.values() for row in rows]
    adjusted = dict(zip(map(id, family), holm([row[-1] for row in family])))
    for category, rows in judged.items():
        rival, count, mean, low, high, gap, _ = shown = min(rows, key=lambda row: row[2])
        every = ", ".join(f"{row[0]} {math.exp(row[2]):.2f}" for row in sorted(rows, key=lambda row: row[2]))
        interval_shown = f"{math.exp(low):.3f}-{math.exp(high):.3f}" if count > 1 else "- (one pair)"
        found = f"{100 * (math.exp(gap) - 1):.0f}%" if count > 1 else "-"
        lines.append(f"| {category} | {rival} | {math.exp(mean):.3f} | {interval_shown} | {count} "
                     f"| {verdict(low, high) if count > 1 else '-'} | {found} | {every} "
                     f"| {adjusted[id(shown)]:.3f} |")
    noise = repeat_noise(measured)
    standing = sum(p < 0.05 for p in adjusted.values())
    lines.append("")
    lines.append(f"Were every method as fast as every other, noise alone would read at least one of these "
                 f"{len(family)} comparisons *behind* in {100 * chance_of_a_false_behind(len(family)):.0f}% of runs "
                 "(more, as each category is judged against its slowest-looking rival): a lone *behind* is weak "
                 f"evidence. Holm's step-down over all {len(family)} (every rival in every category) keeps that chance "
                 f"below 5%: {standing} of them *behind* at that level.")
    lines.append(f"Repeat noise: one run of a prompt lies {100 * (math.exp(noise) - 1):.1f}% (root mean square, log "
                 "scale) from the mean of its repeats.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, nargs="+")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--rivals", default=None, help="comma-separated (default: every other method but ar)")
    parser.add_argument("--decoding-alone", action="store_true", help="leave each turn's first token out")
    args = parser.parse_args()
    for path in args.records:
        if not path.is_file():
            parser.error(f"no such file: {path}")
    rivals = [r.strip() for r in args.rivals.split(",") if r.strip()] if args.rivals else None
    try:
        measured = load(args.records, args.decoding_alone)
    except UserError as error:
        parser.error(str(error))
    present = sorted({method for runs in measured.values() for method in runs})
    if args.method not in present or any(rival not in present for rival in rivals or ()):
        missing = [name for name in [args.method, *(rivals or ())] if name not in present]
        parser.error(f"no usable runs of {', '.join(missing)} in the records; methods there: "
                     f"{', '.join(present) or 'none'}")
    if not [m for m in rivals or present if m != args.method and (rivals or m != "ar")]:
        parser.error(f"no rival of {args.method} in the records to compare it with (--rivals names them)")
    print("\n".join(table(measured, args.method, rivals)))


if __name__ == "__main__":
    main()
