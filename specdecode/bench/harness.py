"""Run every method on every task, interleaved and repeated, and keep one record per run.

Fairness rules: the same chat-templated prompt ids for every method; the order of methods rotates for
every task and repeat so machine drift cancels; a warm-up run is excluded; tokens are counted from ids;
a failed run is recorded with its error and kept out of every average.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from specdecode.api import Models
from specdecode.bench.datasets import Task
from specdecode.bench.runners import Runner
from specdecode.engine import GenerationConfig
from specdecode.types import StepStats


@dataclass
class Record:
    """One method on one task in one repeat (all turns of a multi-turn task together)."""

    method: str
    category: str
    task_id: str
    repeat: int
    token_ids: list[int] = field(default_factory=list)  # new tokens of every turn, in order
    seconds: float = 0.0
    steps: list[StepStats] | None = None  # None for peers
    error: str | None = None
    prompt_ids: list[list[int]] = field(default_factory=list)  # per turn, as fed to the model
    turn_lengths: list[int] = field(default_factory=list)  # new tokens per turn
    prefill_seconds: float | None = 0.0  # until the first new token, summed over turns (None: not known)

    @property
    def ok(self) -> bool:
        return self.error is None

    def turns(self) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, new ids) per turn."""
        ends = [sum(self.turn_lengths[: i + 1]) for i in range(len(self.turn_lengths))]
        starts = [0, *ends[:-1]]
        return [(p, self.token_ids[a:b]) for p, a, b in zip(self.prompt_ids, starts, ends)]

    def to_json(self) -> dict:
        data = asdict(self)
        data["steps"] = None if self.steps is None else [asdict(s) for s in self.steps]
        return data


def run_task(models: Models, runner: Runner, task: Task, config: GenerationConfig, repeat: int) -> Record:
    """All turns of a task with one method; the later turns follow the method's own earlier answers."""
    record = Record(runner.name, task.category, task.task_id, repeat, steps=None if runner.peer else [])
    messages: list[dict] = []
    try:
        for turn in task.turns:
            messages.append({"role": "user", "content": turn})
            prompt_ids = models.encode_chat(messages)
            output = runner.run(prompt_ids, config)
            record.prompt_ids.append(prompt_ids)
            record.token_ids += output.token_ids
            record.turn_lengths.append(len(output.token_ids))
            record.seconds += output.seconds
            if output.prefill_seconds is None or record.prefill_seconds is None:
                record.prefill_seconds = None
            else:
                record.prefill_seconds += output.prefill_seconds
            if record.steps is not None and output.steps is not None:  # a peer's steps are not kept
                record.steps += output.steps
            answer = models.tokenizer.decode(output.token_ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
    except Exception as error:  # noqa: BLE001 - a failure is a result: recorded, reported, not averaged
        record.error = f"{type(error).__name__}: {error}"
        record.steps = None
        traceback.print_exc()
    return record


def run_benchmark(
    models: Models,
    runners: dict[str, Runner],
    tasks: list[Task],
    config: GenerationConfig,
    repeats: int,
    on_record: Callable[[Record], None] = lambda record: None,
) -> list[Record]:
    warm = GenerationConfig(max_new_tokens=4, sampling=config.sampling, seed=config.seed)
    warm_task = Task(tasks[0].category, "warm-up", tasks[0].turns[:1])
    for runner in runners.values():
        run_task(models, runner, warm_task, warm, repeat=-1)
    names = list(runners)
    records = []
    for repeat in range(repeats):
        for runner in runners.values():  # methods that learn across prompts start each repeat afresh
            runner.forget()
        for index, task in enumerate(tasks):
            shift = (repeat * len(tasks) + index) % len(names)
            # every method gets the same seed for a task and repeat; each task and repeat its own
            seeded = replace(config, seed=(config.seed or 0) + 1_000_003 * repeat + index)
            for name in names[shift:] + names[:shift]:
                record = run_task(models, runners[name], task, seeded, repeat)
                records.append(record)
                on_record(record)
    return records


def compare_arguments(parser, categories: str, prompts: int, out: str) -> None:
    """The options of a benchmark script built on `compare`: its sample and where its report goes."""
    from pathlib import Path

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
    from specdecode.bench import report
    from specdecode.bench.datasets import sample_tasks

    tasks = sample_tasks(categories.split(","), prompts)
    print(f"{len(runners)} methods x {len(tasks)} prompts x {repeats} repeats", flush=True)
    records = run_benchmark(models, runners, tasks, GenerationConfig(max_new_tokens=max_new_tokens), repeats,
                            on_record=lambda r: print(f"  {r.method} {r.task_id} {r.seconds:.1f}s", flush=True))
    summaries = report.summarise(records, {name: True for name in runners})
    text = report.markdown(summaries, {**(header or {}), "tasks": str(len(tasks)),
                                       "max new tokens": str(max_new_tokens)}, [])
    return records, text
