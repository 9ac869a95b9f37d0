"""Run every method on every task, interleaved and repeated, and keep one record per run.

Fairness rules: the same chat-templated prompt ids for every method; the order of methods changes for
every task and repeat (`method_order`) so machine drift cancels and no method always follows the same one;
a warm-up run is excluded; tokens are counted from ids;
a failed run is recorded with its error and kept out of every average.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from typing import cast

from specdecode.api import Models
from specdecode.bench.samples import part_of
from specdecode.bench.datasets import Task
from specdecode.bench.base import Runner
from specdecode.bench.engine_stats import ServerStats
from specdecode.engine import GenerationConfig
from specdecode.errors import UserError
from specdecode.types import StepStats

# What methods that learn across prompts (the suffix cache, `auto`'s ledgers, the step-aside switch) keep between
# the prompts of a run: "repeat", what the earlier prompts of the same repeat taught them (each repeat starts
# afresh); "prompt", nothing, as the server keeps nothing between requests without a memory owner.
MEMORY = ("repeat", "prompt")


def check_memory(memory: str) -> None:
    """A one-line error for a `memory` setting that is not one of MEMORY."""
    if memory not in MEMORY:
        raise UserError(f"--memory is one of {', '.join(MEMORY)}, not {memory!r}")


WARM_UP_CHARACTERS = 2000  # of the warm-up run's prompt: a few hundred tokens warm every method's code paths


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
    texts: list[str] = field(default_factory=list)  # each turn's answer (an engine's as it sent it)
    ids_known: bool = True  # False: an engine that streams text only (token_ids empty, lengths from `usage`)
    server: ServerStats | None = None  # the engine's own speculative figures, summed over turns
    engine_prompt_tokens: list[int] | None = None  # per turn, the prompt as the engine counted it
    concurrency: int = 1  # client streams running at once (the interleaved run: 1)
    node: str | None = None  # the Ray node that ran it ("host/node id"; None: the machine of the run)
    part: str = "held-out"  # the part of its category the task belongs to (`bench.samples.part_of`)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def new_tokens(self) -> int:
        return sum(self.turn_lengths)

    @property
    def task(self) -> tuple[str, str]:
        """The task it ran: its category and id (code and code-edit both hold HumanEval's ids)."""
        return self.category, self.task_id

    def turns(self) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, new ids) per turn."""
        ends = [sum(self.turn_lengths[: i + 1]) for i in range(len(self.turn_lengths))]
        starts = [0, *ends[:-1]]
        return [(p, self.token_ids[a:b]) for p, a, b in zip(self.prompt_ids, starts, ends)]

    def to_json(self) -> dict:
        data = asdict(self)
        data["steps"] = None if self.steps is None else [asdict(s) for s in self.steps]
        data["server"] = None if self.server is None else self.server.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict) -> Record:
        """A record as `to_json` wrote it (a kept run's records.jsonl: tables are rendered from these)."""
        known = {f.name for f in fields(cls)}
        data = {key: value for key, value in data.items() if key in known}
        steps = data.get("steps")
        data["steps"] = None if steps is None else [StepStats(**step) for step in steps]
        server = data.get("server")
        data["server"] = None if server is None else ServerStats.from_json(server)
        return cls(**data)


def read_records(path) -> list[Record]:
    """The records of a kept run (its records.jsonl)."""
    return [Record.from_json(line) for line in record_lines(path)]


def record_lines(path) -> list[dict]:
    """A records file's JSON lines, blank ones skipped; a UserError for a file that is missing or holds a line that
    is not JSON, but its last: a run cut off while writing leaves that half written, and it is skipped with a
    warning."""
    import json
    import sys
    from pathlib import Path

    if not Path(path).is_file():
        raise UserError(f"no such records file: {path}")
    lines = [(number, line) for number, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
    out = []
    for index, (number, line) in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if index < len(lines) - 1:
                raise UserError(f"{path}:{number} is not a JSON record") from None
            print(f"warning: {path}:{number}, the last line, is cut short (a run stopped while writing): skipped",
                  file=sys.stderr)
    return out


# what the record of a run holds
RUN_FIELDS = ("method", "category", "task_id", "repeat", "turn_lengths", "seconds", "error")


def run_records(path) -> list[dict]:
    """`record_lines` of a file of `specdecode bench` runs; a UserError for one of another kind (a served
    concurrency run's records, say), naming the first field a line lacks."""
    records = record_lines(path)
    for number, record in enumerate(records, 1):
        missing = [field for field in RUN_FIELDS if field not in record] if isinstance(record, dict) else RUN_FIELDS
        if missing:
            raise UserError(f"{path} is not a file of `specdecode bench` runs (its record {number} has no "
                            f"{missing[0]!r})")
    return records


@dataclass
class BenchOutcome:
    """What a benchmark run gives, on this machine or gathered from a Ray cluster's nodes."""

    records: list[Record]
    lossless: dict[str, bool]  # by row
    notes: list[str]  # exactness: where lossless outputs part (greedy), or the distribution tests (sampling)
    precision: str  # the target's, as loaded
    threads: int
    machines: list[str]  # every machine that ran records, described
    levels: list | None = None  # `openai_engines.LevelRun`s of engines under several client streams
    engines: str | None = None  # the engine rows, described
    references: dict[str, str] = field(default_factory=dict)  # an engine row's reference row, when not the run's


def check_context(runner: Runner, prompt_ids: list[int], config: GenerationConfig, max_context: int) -> None:
    """A UserError unless the prompt and max_new_tokens fit in the runner's context: every method must be
    able to generate the same tokens (our engine would stop short, transformers' generate() would run past
    the positions the model was trained on, llama.cpp would fail)."""
    limit = runner.max_context or max_context
    if len(prompt_ids) + config.max_new_tokens > limit:
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; with {config.max_new_tokens} new tokens it needs "
                        f"{len(prompt_ids) + config.max_new_tokens} positions, but {runner.name}'s model holds {limit}")


def check_tools_rendered(models: Models, task: Task, prompt_ids: list[int]) -> None:
    """A UserError unless the chat template wrote every tool of an agentic task into its prompt: a template that
    takes no tools drops them, and the agent's earlier calls with them, without a word."""
    text = models.tokenizer.decode(prompt_ids)
    missing = [tool["function"]["name"] for tool in task.tools if tool["function"]["name"] not in text]
    if missing:
        raise UserError(f"the target's chat template renders no tools (the prompt lacks {', '.join(missing)}): "
                        "an agentic task needs a template that does, such as Qwen2.5's")


def run_task(models: Models, runner: Runner, task: Task, config: GenerationConfig, repeat: int) -> Record:
    """All turns of a task with one method; the later turns follow the method's own earlier answers. A
    failure is recorded (a UserError, such as a prompt too long for the model, without a traceback)."""
    record = Record(runner.name, task.category, task.task_id, repeat, steps=None if runner.peer else [],
                    part=part_of(task))
    messages: list[dict] = []
    config = replace(config, constraint=task.constraint)
    try:
        if task.constraint is not None and runner.peer:
            raise UserError(f"{runner.name} takes no constraint (a structured task)")
        for index, turn in enumerate(task.turns):
            messages.append({"role": "user", "content": turn})
            if index == 0:  # the agent's earlier calls and the tools' answers, after its request
                messages += [dict(message) for message in task.history]
            prompt_ids = models.encode_chat(messages, list(task.tools)) if task.tools else models.encode_chat(messages)
            if index == 0 and task.tools:
                check_tools_rendered(models, task, prompt_ids)
            check_context(runner, prompt_ids, config, models.target.max_context)
            output = runner.chat(messages, config, task.tools) if runner.chat else runner.run(prompt_ids, config)
            record.prompt_ids.append(prompt_ids)
            record.token_ids += output.token_ids
            record.turn_lengths.append(len(output.token_ids) if output.new_tokens is None else output.new_tokens)
            record.ids_known = record.ids_known and (output.new_tokens is None
                                                     or len(output.token_ids) == output.new_tokens)
            if output.server is not None:
                record.server = output.server if record.server is None else record.server + output.server
            if output.prompt_tokens is not None:
                record.engine_prompt_tokens = [*(record.engine_prompt_tokens or []), output.prompt_tokens]
            record.seconds += output.seconds
            if output.prefill_seconds is None or record.prefill_seconds is None:
                record.prefill_seconds = None
            else:
                record.prefill_seconds += output.prefill_seconds
            if record.steps is not None and output.steps is not None:  # a peer's steps are not kept
                record.steps += output.steps
            answer = output.text if output.text is not None else cast("str", models.tokenizer.decode(
                output.token_ids, skip_special_tokens=True))  # one sequence's ids: one text
            record.texts.append(answer)
            messages.append({"role": "assistant", "content": answer})
    except Exception as error:  # any failure is a result: recorded, reported, not averaged
        record.error = f"{type(error).__name__}: {error}"
        record.steps = None
        if not isinstance(error, UserError):
            traceback.print_exc()
    return record


def task_config(config: GenerationConfig, repeat: int, index: int) -> GenerationConfig:
    """Every method gets the same seed for a task and repeat; each task and repeat its own."""
    return replace(config, seed=(config.seed or 0) + 1_000_003 * repeat + index)


def interleaved(
    models: Models,
    runners: dict[str, Runner],
    tasks: list[Task],
    config: GenerationConfig,
    repeats: int,
    positions: list[int] | None = None,
    count: int | None = None,
    on_start: Callable[[str, str], None] = lambda method, task_id: None,
    memory: str = "repeat",
) -> Iterator[Record]:
    """Every method on every task, repeat after repeat, one record at a time. `positions`: each task's place
    in the whole benchmark's list of `count` tasks, when these are a share of it (a Ray node's,
    `bench.ray_shards`): its seed and its order of methods are then those it has in the whole run.
    `on_start(method, task_id)` is told of each run as it begins (a progress bar's description: a 16k-token
    prefill takes minutes). `memory`: what methods that learn across prompts keep (`MEMORY`)."""
    check_memory(memory)
    positions = list(range(len(tasks))) if positions is None else positions
    count = len(tasks) if count is None else count
    warm = GenerationConfig(max_new_tokens=4, sampling=config.sampling, seed=config.seed)
    # the shortest task's first turn, cut to a few hundred tokens: not a 16k-token prefill per method when the
    # benchmark has only long-context tasks
    shortest = min(tasks, key=lambda task: len(task.turns[0]))
    warm_task = Task(shortest.category, "warm-up", (shortest.turns[0][:WARM_UP_CHARACTERS],))
    for name, runner in runners.items():
        on_start(name, warm_task.task_id)
        run_task(models, runner, warm_task, warm, repeat=-1)
    names = list(runners)
    for repeat in range(repeats):
        for runner in runners.values():  # methods that learn across prompts start each repeat afresh
            runner.forget()
        for position, task in zip(positions, tasks):
            seeded = task_config(config, repeat, position)
            for name in method_order(names, repeat * count + position):
                on_start(name, task.task_id)
                if memory == "prompt":
                    runners[name].forget()
                yield run_task(models, runners[name], task, seeded, repeat)


def method_order(names: list[str], index: int) -> list[str]:
    """The order of `names` for the `index`-th (task, repeat) of a run: the rows of a balanced Latin square
    (Williams 1949) in turn. Over every n rows (2n for an odd number n of methods) each method runs once in
    each place and right after each other method equally often, so neither a drifting machine nor what one
    method leaves behind for the next (a warm cache, a busy core) favours one of them; a plain rotation
    always put the same method after the same one."""
    n = len(names)
    base = [0]  # 0, 1, n-1, 2, n-2, ...: consecutive differences that are all distinct modulo n
    for step in range(1, n):
        base.append((step + 1) // 2 if step % 2 else n - step // 2)
    row = index % (n if n % 2 == 0 else 2 * n)
    order = [names[(b + row) % n] for b in base]
    return order[::-1] if row >= n else order


def run_benchmark(
    models: Models,
    runners: dict[str, Runner],
    tasks: list[Task],
    config: GenerationConfig,
    repeats: int,
    on_record: Callable[[Record], None] = lambda record: None,
    on_start: Callable[[str, str], None] = lambda method, task_id: None,
    memory: str = "repeat",
) -> list[Record]:
    records = []
    for record in interleaved(models, runners, tasks, config, repeats, on_start=on_start, memory=memory):
        records.append(record)
        on_record(record)
    return records
