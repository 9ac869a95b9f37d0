"""From benchmark records to figures: per method x category and overall, a markdown report, plots."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from specdecode import metrics
from specdecode.bench.engine_stats import ServerStats
from specdecode.bench.harness import Record
from specdecode.types import StepStats

OVERALL = "overall"
DISAGREEMENT = 0.2  # measured and predicted speedups this far apart (relative) get a remark


@dataclass
class Cell:
    """One method on one category (or overall), over every repeat."""

    tokens_per_second: tuple[float, float]  # mean, std over repeats (and Ray nodes)
    speedup: tuple[float, float]  # mean, std over repeats (and Ray nodes) of the ratio to ar on that machine
    mean_accepted_tokens: float | None  # None for peers (an engine's: its own figure, when it gives one)
    runs: int
    failures: int
    # the same ratio for decoding alone: tokens after the first over the time after the first token
    decode_speedup: tuple[float, float] | None = None  # None: the prefill time is not known


@dataclass
class MethodSummary:
    method: str
    cells: dict[str, Cell]  # by category, plus OVERALL
    exact: tuple[int, int] | None  # (identical to ar, compared); None for lossy methods
    acceptance_rate: float | None = None
    accepted_per_position: list[float] = field(default_factory=list)
    draft_share: float | None = None
    predicted_speedup: float | None = None
    errors: list[str] = field(default_factory=list)
    reference: str = "ar"  # the row its output is compared with
    server: ServerStats | None = None  # an engine's own speculative figures, summed over its runs
    engine: bool = False  # an engine over HTTP (`bench.openai_engines`)
    first_token_seconds: float | None = None  # mean per turn (engines)
    inter_token_seconds: float | None = None  # mean gap per token after the first (engines)
    prompt_mismatches: int = 0  # turns whose prompt the engine counted differently from ours (engines)


def _decode_steps(steps: list[StepStats]) -> list[StepStats]:
    """The steps without a prefill: their costs are those of decoding."""
    return [s for s in steps if s.forward_tokens <= s.drafted + 1]


def _throughput(records: list[Record]) -> float:
    seconds = sum(r.seconds for r in records)
    return metrics.tokens_per_second(sum(r.new_tokens for r in records), seconds)


def _decode_throughput(records: list[Record]) -> float | None:
    known = [(r, r.prefill_seconds) for r in records if r.prefill_seconds is not None]
    if len(known) < len(records):
        return None
    seconds = sum(r.seconds - prefill for r, prefill in known)
    return metrics.tokens_per_second(sum(r.new_tokens - len(r.turn_lengths) for r in records), seconds)


def summed_server(records: list[Record]) -> ServerStats | None:
    stats = [r.server for r in records if r.ok and r.server is not None]
    return sum(stats[1:], stats[0]) if stats else None


def same_output(a: Record, b: Record) -> bool:
    """Token for token where both runs' ids are known, else (an engine that streams text) text for text."""
    return a.token_ids == b.token_ids if a.ids_known and b.ids_known else a.texts == b.texts


def _latencies(records: list[Record]) -> tuple[float | None, float | None]:
    """Mean time to the first token per turn, and mean gap per token after it."""
    ok = [(r, r.prefill_seconds) for r in records if r.ok and r.prefill_seconds is not None]
    turns = sum(len(r.turn_lengths) for r, _ in ok)
    later = sum(r.new_tokens - len(r.turn_lengths) for r, _ in ok)
    first = sum(prefill for _, prefill in ok) / turns if turns else None
    gap = sum(r.seconds - prefill for r, prefill in ok) / later if later > 0 else None
    return first, gap


def _cell(records: list[Record], reference: list[Record]) -> Cell:
    """Ratios per repeat and machine: a Ray run's records on one node against that node's reference runs, over
    the tasks both ran to their end (a task the reference failed on is left out of the ratio, not weighed against
    the reference's other tasks)."""
    ok = [r for r in records if r.ok]
    per_repeat, ratios, decode_ratios = [], [], []
    for repeat, node in dict.fromkeys((r.repeat, r.node) for r in ok):
        mine = [r for r in ok if r.repeat == repeat and r.node == node]
        tasks = {r.task for r in mine}
        base = [r for r in reference if r.repeat == repeat and r.node == node and r.ok and r.task in tasks]
        per_repeat.append(_throughput(mine))  # its own rate, whether or not the reference ran beside it
        if base:
            shared = {r.task for r in base}
            mine = [r for r in mine if r.task in shared]
            ratios.append(_throughput(mine) / _throughput(base))
            decode, decode_base = _decode_throughput(mine), _decode_throughput(base)
            if decode is not None and decode_base:
                decode_ratios.append(decode / decode_base)
    steps = [s for r in ok if r.steps is not None for s in r.steps]
    server = summed_server(ok)
    accepted_tokens = metrics.mean_accepted_tokens(steps) if steps else None
    # not SGLang's lifetime figure
    if accepted_tokens is None and server is not None and server.mean_acceptance_length is None:
        accepted_tokens = server.acceptance_length
    return Cell(
        tokens_per_second=metrics.mean_and_std(per_repeat),
        speedup=metrics.mean_and_std(ratios),
        mean_accepted_tokens=accepted_tokens,
        runs=len(ok),
        failures=len(records) - len(ok),
        decode_speedup=(metrics.mean_and_std(decode_ratios) if decode_ratios and len(decode_ratios) == len(ratios)
                        else None),
    )


def summarise(records: list[Record], lossless: dict[str, bool], reference_name: str = "ar",
              references: dict[str, str] | None = None) -> list[MethodSummary]:
    """Per method: speedups over `reference_name`'s runs, exactness against `references[method]`'s
    (default: `reference_name`'s)."""
    by_method: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_method[r.method].append(r)
    categories = sorted({r.category for r in records})
    reference = by_method.get(reference_name, [])  # (get: no empty row for a reference with no runs)
    outputs = {name: {(r.task, r.repeat): r for r in runs if r.ok} for name, runs in by_method.items()}
    ar_steps = _decode_steps([s for r in by_method.get("ar", []) if r.ok and r.steps for s in r.steps])
    plain_token_seconds = sum(s.verify_seconds for s in ar_steps) / len(ar_steps) if ar_steps else 0.0

    summaries = []
    for method, mine in by_method.items():
        cells = {c: _cell([r for r in mine if r.category == c], reference) for c in categories}
        cells[OVERALL] = _cell(mine, reference)
        ok = [r for r in mine if r.ok]
        exact = None
        compared_with = (references or {}).get(method, reference_name)
        if lossless.get(method, True):
            theirs = outputs.get(compared_with, {})
            pairs = [(r, theirs[(r.task, r.repeat)]) for r in ok if (r.task, r.repeat) in theirs]
            exact = (sum(same_output(a, b) for a, b in pairs), len(pairs))
        errors = [f"{r.task_id} (repeat {r.repeat}): {r.error}" for r in mine if not r.ok]
        summary = MethodSummary(method, cells, exact, errors=errors, reference=compared_with, server=summed_server(ok),
                                engine=any(r.engine_prompt_tokens is not None for r in mine))
        if summary.engine:
            summary.first_token_seconds, summary.inter_token_seconds = _latencies(ok)
            summary.prompt_mismatches = sum(len(p) != n for r in ok
                                            for p, n in zip(r.prompt_ids, r.engine_prompt_tokens or []))
        if summary.server is not None:
            summary.acceptance_rate = summary.server.acceptance_rate
            summary.accepted_per_position = summary.server.accepted_per_position
        steps = [s for r in ok if r.steps is not None for s in r.steps]
        if steps:
            summary.acceptance_rate = metrics.acceptance_rate(steps)
            summary.accepted_per_position = metrics.accepted_per_position(steps)
            draft, verify = sum(s.draft_seconds for s in steps), sum(s.verify_seconds for s in steps)
            summary.draft_share = draft / (draft + verify) if draft + verify > 0 else None
            decode = _decode_steps(steps)
            drafted = sum(s.drafted for s in decode)
            if decode and drafted and plain_token_seconds:
                k = drafted / len(decode)
                a = metrics.chain_acceptance(sum(s.accepted for s in decode) / len(decode), k)
                summary.predicted_speedup = metrics.predicted_speedup(
                    a, k, sum(s.draft_seconds for s in decode) / drafted,
                    sum(s.verify_seconds for s in decode) / len(decode), plain_token_seconds,
                )
        summaries.append(summary)
    return summaries


def _pm(pair: tuple[float, float], digits: int = 2, suffix: str = "") -> str:
    mean, std = pair
    if mean != mean:  # nan: no successful run
        return "failed"
    return f"{mean:.{digits}f}{suffix} ± {std:.{digits}f}" if std else f"{mean:.{digits}f}{suffix}"


def markdown(summaries: list[MethodSummary], settings: dict[str, str], notes: list[str], reference: str = "ar",
             levels: list | None = None) -> str:
    """The report; `levels`: the `openai_engines.LevelRun`s of engines under several client streams."""
    categories = [c for c in summaries[0].cells if c != OVERALL] + [OVERALL]
    lines = ["# specdecode benchmark", ""]
    lines += [f"- {key}: {value}" for key, value in settings.items()]
    lines += ["", f"## Leaderboard: speedup over `{reference}` (mean accepted tokens per target forward)", "",
              "Each cell: a repeat's tokens over its seconds, all its prompts pooled (a long run weighs more than a "
              f"short one), over `{reference}`'s, as mean ± sample standard deviation over the repeats; "
              "`benchmarks/over_peer.py` gives medians and geometric means of per-prompt ratios instead.", ""]
    lines.append("| method | " + " | ".join(categories) + f" | exact vs {reference} |")
    lines.append("|---" * (len(categories) + 2) + "|")
    for s in summaries:
        cells = []
        for c in categories:
            cell = s.cells[c]
            text = _pm(cell.speedup, suffix="x")
            if cell.mean_accepted_tokens is not None:
                text += f" ({cell.mean_accepted_tokens:.2f})"
            cells.append(text)
        exact = "lossy" if s.exact is None else f"{s.exact[0]}/{s.exact[1]}"
        if s.exact is not None and s.reference != reference:
            exact += f" (vs {s.reference})"
        lines.append(f"| {s.method} | " + " | ".join(cells) + f" | {exact} |")
    if any(s.cells[OVERALL].decode_speedup for s in summaries):
        lines += ["", f"## Decoding alone: speedup over `{reference}` with the prefill (time to the first token) "
                  "left out", ""]
        lines.append("| method | " + " | ".join(categories) + " |")
        lines.append("|---" * (len(categories) + 1) + "|")
        for s in summaries:
            cells = [_pm(speedup, suffix="x") if (speedup := s.cells[c].decode_speedup) else "-"
                     for c in categories]
            lines.append(f"| {s.method} | " + " | ".join(cells) + " |")
    lines += ["", "## Per method, all categories", ""]
    lines.append("| method | tokens/s | speedup | predicted speedup | acceptance | accepted by draft position "
                 "| draft share | runs | failures |")
    lines.append("|---" * 9 + "|")
    for s in summaries:
        cell = s.cells[OVERALL]
        predicted = "-" if s.predicted_speedup is None else f"{s.predicted_speedup:.2f}x"
        positions = ", ".join(f"{p:.2f}" for p in s.accepted_per_position[:8]) or "-"
        acceptance = "-" if s.acceptance_rate is None else f"{s.acceptance_rate:.0%}"
        share = "-" if s.draft_share is None else f"{s.draft_share:.0%}"
        lines.append(
            f"| {s.method} | {_pm(cell.tokens_per_second)} | {_pm(cell.speedup, suffix='x')} | {predicted} | "
            f"{acceptance} | {positions} | {share} | {cell.runs} | {cell.failures} |"
        )
    lines += _engine_tables(summaries, levels or [], reference)
    if found := remarks(summaries, notes):
        lines += ["", "## Remarks", ""] + found
    lines += ["", "Metrics are defined in `specdecode/metrics.py`. Failed runs are listed above and kept out of "
              "every average."]
    return "\n".join(lines) + "\n"


def remarks(summaries: list[MethodSummary], notes: list[str]) -> list[str]:
    """The report's remarks, as markdown bullets: predictions far from the measurement, failures, engines
    that counted other prompts, and `notes` (exactness, sampling)."""
    found, disagreeing = [], []
    for s in summaries:
        measured = s.cells[OVERALL].speedup[0]
        if (s.predicted_speedup and measured == measured  # measured: not NaN
                and abs(s.predicted_speedup - measured) > DISAGREEMENT * measured):
            disagreeing.append(f"{s.method} (measured {measured:.2f}x, predicted {s.predicted_speedup:.2f}x)")
        found += [f"- {s.method} FAILED on {e}" for e in s.errors]
        if s.prompt_mismatches:
            found.append(f"- {s.method}: on {s.prompt_mismatches} turns the engine counted a different number of "
                         "prompt tokens than our methods were given: its prompts are not identical to theirs.")
    if disagreeing:
        found.insert(0, f"- The analytical model's speedup is more than {DISAGREEMENT:.0%} off the measured one for "
                        f"{', '.join(disagreeing)}: its assumptions (independent acceptance per token, a fixed draft "
                        "length, decoding cost only — the prefill is excluded from the prediction but not from the "
                        "measurement) do not hold there.")
    return found + [f"- {n}" for n in notes]


def _engine_tables(summaries: list[MethodSummary], levels: list, reference: str) -> list[str]:
    engines = [s for s in summaries if s.engine]
    if not engines:
        return []

    def number(value, digits=2, scale=1.0, suffix=""):
        return "-" if value is None else f"{value * scale:.{digits}f}{suffix}"

    lines = ["", "## Engines over HTTP, measured from the client (speculative figures: the engine's own)", ""]
    lines.append("| engine | tokens/s | time to first token (s) | inter-token latency (ms) | drafted | accepted | "
                 "acceptance | tokens per verification | figures from |")
    lines.append("|---" * 9 + "|")
    for s in engines:
        server = s.server
        lines.append(
            f"| {s.method} | {_pm(s.cells[OVERALL].tokens_per_second)} | {number(s.first_token_seconds)} | "
            f"{number(s.inter_token_seconds, 1, 1000)} | {number(server and server.drafted, 0)} | "
            f"{number(server and server.accepted, 0)} | {number(server and server.acceptance_rate, 0, 100, '%')} | "
            f"{number(server and server.acceptance_length)} | {server.source if server else 'not published'} |")
    if levels:
        lines += ["", "## Engines under load: several client streams at once (tokens/s: all new tokens over the "
                  "level's wall time; 1 stream: the interleaved run)", ""]
        lines.append(f"| engine | streams | tokens/s | vs {reference} at the same streams | acceptance | failures |")
        lines.append("|---" * 6 + "|")
        by_key: dict[tuple[str, int], list] = defaultdict(list)
        for run in levels:
            by_key[(run.engine, run.concurrency)].append(run)
        for (name, level), runs in sorted(by_key.items(), key=lambda item: (item[0][1], item[0][0])):
            rates = [run.new_tokens / run.seconds for run in runs if run.seconds > 0]
            # each repeat's rate over the reference's in the same repeat, averaged as the tables above are
            base = {run.repeat: run.new_tokens / run.seconds for run in by_key.get((reference, level), [])
                    if run.seconds > 0 and run.new_tokens}
            paired = [run.new_tokens / run.seconds / base[run.repeat] for run in runs
                      if run.seconds > 0 and run.repeat in base]
            ratio = f"{sum(paired) / len(paired):.2f}x" if paired and name != reference else "-"
            servers = [run.server for run in runs if run.server is not None]
            server = sum(servers[1:], servers[0]) if servers else None
            failures = sum(not r.ok for run in runs for r in run.records)
            lines.append(f"| {name} | {level} | {_pm(metrics.mean_and_std(rates))} | {ratio} | "
                         f"{number(server and server.acceptance_rate, 0, 100, '%')} | {failures} |")
    return lines


def plots(summaries: list[MethodSummary], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = [c for c in summaries[0].cells if c != OVERALL] + [OVERALL]
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(categories)), 4.5))
    width = 0.8 / len(summaries)
    for i, s in enumerate(summaries):
        means = [s.cells[c].speedup[0] for c in categories]
        stds = [s.cells[c].speedup[1] for c in categories]
        xs = [j + (i - (len(summaries) - 1) / 2) * width for j in range(len(categories))]
        ax.bar(xs, means, width, yerr=stds, label=s.method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(categories)), categories, rotation=20)
    ax.set_ylabel("speedup over ar")
    ax.legend(fontsize=8, ncols=3)
    ax.set_title("Speedup by category and method")
    fig.tight_layout()
    speedup_path = out / "speedup.png"
    fig.savefig(speedup_path, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summaries:
        if s.accepted_per_position:
            positions = s.accepted_per_position[:16]
            ax.plot(range(1, len(positions) + 1), positions, marker="o", label=s.method)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (given the position was drafted)")
    ax.set_ylim(0, 1.05)
    if ax.get_legend_handles_labels()[0]:  # no method drafted (plain decoding alone): nothing to name
        ax.legend()
    ax.set_title("Acceptance by draft position")
    fig.tight_layout()
    acceptance_path = out / "acceptance_by_position.png"
    fig.savefig(acceptance_path, dpi=110)
    plt.close(fig)
    return [speedup_path, acceptance_path]
