"""What the scripts in benchmarks/ share: their options, one interleaved run of several runners with its
markdown report, and saving it (on top of the harness and the report, which know nothing of scripts)."""

from __future__ import annotations

from pathlib import Path

from specdecode.api import Models
from specdecode.bench import report
from specdecode.bench.samples import sample_tasks
from specdecode.bench.harness import Record, run_benchmark
from specdecode.bench.base import Runner
from specdecode.engine import GenerationConfig


def compare_arguments(parser, categories: str, prompts: int, out: str) -> None:
    """The options of a benchmark script built on `compare`: its sample and where its report goes."""
    parser.add_argument("--categories", default=categories)
    parser.add_argument("--prompts", type=int, default=prompts, help="per category")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(out))


def save_report(text: str, out) -> None:
    """Print a script's report and write it to `out`."""
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"saved {out}")


def compare(models: Models, runners: dict[str, Runner], categories: str, prompts: int, max_new_tokens: int,
            repeats: int, header: dict[str, str] | None = None) -> tuple[list[Record], str]:
    """The benchmark scripts' common run: `prompts` seeded tasks of each comma-separated category, every
    runner on each (greedy, progress printed), and the markdown report of them (every runner counted as
    lossless, so each output is checked against `ar`'s)."""
    tasks = sample_tasks(categories.split(","), prompts)
    print(f"{len(runners)} methods x {len(tasks)} prompts x {repeats} repeats", flush=True)
    records = run_benchmark(models, runners, tasks, GenerationConfig(max_new_tokens=max_new_tokens), repeats,
                            on_record=lambda r: print(f"  {r.method} {r.task_id} {r.seconds:.1f}s", flush=True))
    summaries = report.summarise(records, {name: True for name in runners})
    text = report.markdown(summaries, {**(header or {}), "tasks": str(len(tasks)),
                                       "max new tokens": str(max_new_tokens)}, [])
    return records, text
