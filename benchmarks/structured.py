"""Structured output (docs/structured-output.md): every method on the `structured` category (hand-written
extraction, tool-call and fixed-form tasks, `specdecode/bench/structured.py`), each answer once under its
constraint and once free, interleaved in one run (greedy). Per method and mode: tokens per second, the speedup
over constrained plain decoding, new tokens per target forward, the share of tokens the grammar forced
(drafted from it alone), the share of answers that validate (jsonschema / a full regex match) and whether the
constrained output equals constrained plain decoding token for token.

    python benchmarks/structured.py [--methods ar,suffix,pld,draft,composite] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specdecode import metrics
from specdecode.bench.datasets import Task
from specdecode.bench.samples import sample_tasks
from specdecode.bench.harness import Record, method_order, run_task
from specdecode.bench.runners import Setup
from specdecode.bench.scripts import save_report
from specdecode.bench.server_process import commit
from specdecode.bench.structured import valid
from specdecode.engine import GenerationConfig
from specdecode.models.registry import DEFAULT_DRAFTER, DEFAULT_TARGET

MODES = ("constrained", "free")


@dataclass
class Tally:
    """One method in one mode, over every task and repeat."""

    tokens: int = 0
    seconds: float = 0.0
    steps: list = field(default_factory=list)
    valid: int = 0
    answers: int = 0
    exact: int = 0
    failed: int = 0

    def add(self, record: Record, constraint, reference: list[int] | None) -> None:
        if not record.ok:
            self.failed += 1
            return
        self.tokens += record.new_tokens
        self.seconds += record.seconds
        self.steps += record.steps or []
        self.answers += 1
        self.valid += valid(constraint, record.texts[0])
        self.exact += reference is not None and record.token_ids == reference

    @property
    def tokens_per_second(self) -> float:
        return metrics.tokens_per_second(self.tokens, self.seconds)


def run(setup: Setup, tasks: list[Task], max_new_tokens: int, repeats: int,
        on_task: Callable[[dict[tuple[str, str], Tally]], None]) -> dict[tuple[str, str], Tally]:
    """Every method on every task in both modes, the methods' order changing from task to task (`method_order`);
    `on_task` sees the tallies after each task (a long run's report is saved as it goes)."""
    models, runners = setup.load()
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    for runner in runners.values():  # warm up, the grammar engine's view of the tokenizer built once
        run_task(models, runner, replace(tasks[0], task_id="warm-up"), replace(config, max_new_tokens=8), -1)
    tallies = {(name, mode): Tally() for name in runners for mode in MODES}
    names = list(runners)
    for repeat in range(repeats):
        for index, task in enumerate(tasks):
            order = method_order(names, repeat * len(tasks) + index)
            references: dict[str, list[int]] = {}
            for mode in MODES if (repeat + index) % 2 == 0 else MODES[::-1]:
                shaped = task if mode == "constrained" else replace(task, constraint=None)
                records = {name: run_task(models, runners[name], shaped, config, repeat) for name in order}
                references[mode] = records["ar"].token_ids
                for name, record in records.items():
                    tallies[name, mode].add(record, task.constraint, references[mode])
                    print(f"  {name:<10} {mode:<11} {task.task_id:<18} {record.new_tokens:>4} tokens "
                          f"{record.seconds:6.1f} s {'ok' if record.ok else record.error}", flush=True)
            on_task(tallies)
    return tallies


def first_of_each_kind(tasks: list[Task], count: int | None) -> list[Task]:
    """The first `count` tasks of each kind (the task id's first part), in order; all when None."""
    seen: dict[str, int] = {}
    kept = []
    for task in tasks:
        kind = task.task_id.split("/")[0]
        seen[kind] = seen.get(kind, 0) + 1
        if count is None or seen[kind] <= count:
            kept.append(task)
    return kept


def report(tallies: dict[tuple[str, str], Tally], header: dict[str, str]) -> str:
    base = tallies["ar", "constrained"].tokens_per_second
    lines = [f"- {key}: {value}" for key, value in header.items()]
    lines += ["", "| method | mode | tok/s | speedup | tok/fwd | forced | valid | exact |",
              "|---|---|---|---|---|---|---|---|"]
    for (name, mode), tally in tallies.items():
        lines.append(
            f"| {name} | {mode} | {tally.tokens_per_second:.1f} | {tally.tokens_per_second / base:.2f}x | "
            f"{metrics.mean_accepted_tokens(tally.steps):.2f} | {metrics.forced_share(tally.steps):.0%} | "
            f"{tally.valid}/{tally.answers} | {tally.exact}/{tally.answers} |"
            + (f" ({tally.failed} failed)" if tally.failed else ""))
    lines += ["", "speedup: tokens per second over constrained `ar`'s; tok/fwd: new tokens per target forward; "
              "forced: the share of new tokens drafted from the grammar alone; valid: answers that validate "
              "(free answers checked against the same constraint); exact: outputs equal to `ar`'s in the same "
              "mode, token for token."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ar,suffix,pld,draft,composite")
    parser.add_argument("--per-kind", type=int, default=None,
                        help="the first N tasks of each kind (extraction, tool call, form); all 4 by default")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/reports/structured.md"))
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    setup = Setup(methods=methods, target=args.target, drafter=args.drafter, dtype=args.dtype, threads=args.threads)
    tasks = first_of_each_kind(sample_tasks(["structured"], None), args.per_kind)
    started = time.strftime("%Y-%m-%d")
    header = {"date": started, "CPU capability": torch.backends.cpu.get_cpu_capability(), "commit": commit(),
              "target": args.target,
              "dtype": args.dtype, "tasks": str(len(tasks)), "max new tokens": str(args.max_new_tokens),
              "repeats": str(args.repeats), "command": "python benchmarks/structured.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out")}
    run(setup, tasks, args.max_new_tokens, args.repeats, lambda tallies: save_report(report(tallies, header), args.out))


if __name__ == "__main__":
    main()
