"""`specdecode bench`: load the models, run the harness (here, or on a Ray cluster's nodes:
`bench.ray_shards`), write records, report and plots."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.markdown import Markdown
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from specdecode import cluster, devices
from specdecode.bench import acceptance, ray_shards, render, report, terminal
from specdecode.bench.catalogues import TRANSLATION_SOURCE
from specdecode.bench.datasets import Task
from specdecode.bench.own_prompts import read_prompts
from specdecode.bench.samples import sample_tasks
from specdecode.bench.server_process import commit
from specdecode.bench.exactness import diagnose_divergences, sampled_fidelity
from specdecode.bench.harness import BenchOutcome, Record, check_memory, run_benchmark
from specdecode.paths import output_folder
from specdecode.bench.openai_engines import LevelRun, build_engines, run_levels
from specdecode.bench.runners import PEERS, Setup, runner_names
from specdecode.engine import GenerationConfig
from specdecode.errors import UserError
from specdecode.models import costs, loading
from specdecode.drafters.heads import kind_of
from specdecode.methods import METHODS, choose, resolve, variant_names
from specdecode.progress import Progress

ALL_METHODS = [*variant_names(), *PEERS]
# the default selection per backend: our methods that run there and that backend's peers (llamacpp-ar, the
# fastest plain decoder on a CPU, when asked for: it needs llama-cpp-python and the target's GGUF)
TORCH_METHODS = [*variant_names(), *(m for m, peer in PEERS.items() if peer.backend == "torch" and m != "llamacpp-ar")]
# llama.cpp runs our methods only, and not the draft model's tree (it cannot grow one in its own cache)
LLAMACPP_METHODS = [m for m in variant_names() if choose(m).runs_on("llamacpp")]
LLAMACPP_METHODS += [m for m, peer in PEERS.items() if peer.backend == "llamacpp"]


def check_options(methods: list[str], repeats: int, concurrency: list[int] | None, engines: list[str] | None,
                  backend: str, ray: str | None) -> list[int]:
    """A UserError for options that do not go together; the concurrency levels, sorted."""
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise UserError(f"unknown methods {unknown}; choose from: {', '.join(ALL_METHODS)}")
    if repeats < 1:
        raise UserError("--repeats must be at least 1")
    levels = sorted(set(concurrency or [1]))
    if levels[0] < 1:
        raise UserError("--concurrency levels must be at least 1")
    if levels != [1] and not engines:
        raise UserError("--concurrency applies to --engine rows (our own methods run in this process, one at a time)")
    if ray is not None:
        cluster.import_ray()  # before anything loads: without Ray, one line saying how to install it
    if ray is not None and engines:
        raise UserError("--ray shares out our own methods over a cluster's nodes; --engine rows are measured from "
                        "this machine's client: run them without --ray")
    elsewhere = [m for m in methods if m in PEERS and PEERS[m].backend != backend]
    if elsewhere:
        raise UserError(f"the peers {elsewhere} are compared on another backend; on --backend {backend} the peers "
                        f"are: {', '.join(m for m, peer in PEERS.items() if peer.backend == backend)}")
    return levels


class RecordSink:
    """records.jsonl, written record by record as runs end, and the progress bar they advance."""

    def __init__(self, path: Path, console: Console):
        self.path, self.console = path, console
        self.progress: Progress | None = None
        self.written = 0

    @classmethod
    def fresh(cls, out: Path, console: Console) -> RecordSink:
        """The sink of `out`/records.jsonl; a UserError where `out` holds an earlier run's records (never written
        over)."""
        output_folder(out, "--out")
        path = out / "records.jsonl"
        if path.is_file() and path.stat().st_size:
            raise UserError(f"{out} holds an earlier run's records ({path}); name a new --out folder, or move them "
                            "away first")
        return cls(path, console)

    def __enter__(self) -> RecordSink:
        self.file = self.path.open("w")
        return self

    def expect(self, total: int, description: str = "warm-up") -> None:
        """Show the bar (once the models are loaded: their own progress bars are done)."""
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console)
        self.progress.start()
        self.bar = self.progress.add_task(description, total=total, completed=self.written)

    def starting(self, method: str, task_id: str) -> None:
        """The bar names the run under way (not the one just ended)."""
        if self.progress is not None:
            self.progress.update(self.bar, description=f"{method} {task_id}")

    def __call__(self, record: Record) -> None:
        self.file.write(json.dumps(record.to_json()) + "\n")
        self.file.flush()
        self.written += 1
        if self.progress is not None:
            where = f" on {record.node}" if record.node else ""
            self.progress.update(self.bar, advance=1, description=f"{record.method} {record.task_id}{where}")

    def close(self) -> None:
        """The bar stopped (so that what is printed next shows), the file closed."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        self.file.close()

    def __exit__(self, kind, *exc) -> None:
        self.close()
        if kind is KeyboardInterrupt:  # Ctrl-C: what ended is kept, and where it is said
            self.console.print(f"[yellow]interrupted: the {self.written} runs that ended are in {self.path}; a run "
                               "cut short writes no report")


def run_here(setup: Setup, tasks: list[Task], config: GenerationConfig, repeats: int, levels: list[int],
             engines: list[str], reference: str, sink: RecordSink, console: Console,
             memory: str = "repeat", recorder: acceptance.Recorder | None = None) -> BenchOutcome:
    """The benchmark on this machine: our methods and peers, then the engine rows' concurrency levels.
    `recorder`: our methods' steps recorded as they run (`--record-acceptance`)."""
    models, runners = setup.load(recorder=recorder)
    probe = models.encode_chat([{"role": "user", "content": "Hello"}])
    engine_rows = build_engines(engines, set(ALL_METHODS) | set(runners), probe)
    runners.update({label: engine.runner() for label, engine in engine_rows.items()})
    references = {label: engine.spec.reference or reference for label, engine in engine_rows.items()}
    for name in {reference, *references.values()}:
        if name not in runners:
            raise UserError(f"the reference {name!r} is not a row of this run; rows: {', '.join(runners)}")
    first_turns = {(t.category, t.task_id): models.encode_chat([{"role": "user", "content": t.turns[0]}])
                   for t in tasks}
    too_long = [task_id for (_, task_id), ids in first_turns.items()
                if len(ids) + config.max_new_tokens > models.target.max_context]
    if too_long:
        console.print(f"[yellow]{len(too_long)} of {len(tasks)} tasks do not fit the target's context of "
                      f"{models.target.max_context} tokens with --max-new-tokens {config.max_new_tokens}: they are "
                      f"recorded as failures ({', '.join(too_long[:4])}{', ...' if len(too_long) > 4 else ''})")
    lossless = {name: runner.lossless for name, runner in runners.items()}
    sink.expect(repeats * len(tasks) * (len(runners) + len(engine_rows) * sum(level > 1 for level in levels)))

    def on_record(record: Record) -> None:
        sink(record)
        if recorder is not None:
            recorder.take(record)

    records = run_benchmark(models, runners, tasks, config, repeats, on_record, on_start=sink.starting, memory=memory)
    loaded = run_levels(models, engine_rows, runners, tasks, config, levels, repeats, sink)
    level_runs = [LevelRun(name, 1, repeat, sum(r.seconds for r in mine if r.ok), mine, report.summed_server(mine))
                  for name in engine_rows for repeat in range(repeats)
                  for mine in [[r for r in records if r.method == name and r.repeat == repeat]]] + loaded
    notes = diagnose_divergences(models, records, lossless, references, reference) if config.sampling.greedy else [
        *sampling_caveat(), *sampled_fidelity(models, records, lossless, config.sampling)]
    engines_line = "; ".join(f"{label}: {engine.spec.url} ({engine.model}, /v1/{engine.spec.api}"
                             f"{', token ids' if engine.spec.api == 'completions' else ', its own template'})"
                             for label, engine in engine_rows.items()) or None
    return BenchOutcome(records, lossless, notes, models.target.precision, torch.get_num_threads(),
                        [costs.machine()
                         + ("" if models.target.device.type == "cpu" else f", {devices.name(models.target.device)}")],
                        level_runs if loaded else None, engines_line, references)


def check_head(head: str | None, methods: list[str]) -> None:
    """A one-line UserError when --head names no head, or a head no method of the run drafts with."""
    if head is None:
        return
    kind = kind_of(head)
    if not any(name not in PEERS and resolve(name)[0].head == kind for name in methods):
        raise UserError(f"{head} holds {kind} heads and no method of this run drafts with one (methods: "
                        f"{', '.join(m.name for m in METHODS.values() if m.head == kind)})")


def sampling_caveat() -> list[str]:
    return ["Sampling run: each task and repeat has one seed for every method, so a torch method whose drafts carry "
            "no distributions gives plain decoding's sampled answer token for token ('exact vs ar' counts it; "
            "docs/verification.md, \"Randomness\"); the draft model's chain, the self-speculative methods and "
            "other engines sample otherwise, and are judged statistically below (the exact distribution is also "
            "proven by tests/statistical/)."]


def drawn(categories: list[str], per_category: int | None, seed: int, part: str, prompts: Path | None
          ) -> tuple[list[Task], list[str], bool]:
    """A run's tasks: a sample of each category's `part`, then every prompt of `prompts` (whatever the part: a user's
    own prompts tune nothing of ours); the categories the report names; whether `prompts` gave any."""
    own = read_prompts(prompts) if prompts is not None else []
    tasks = sample_tasks(categories, per_category, seed=seed, part=part) + own
    if not tasks:
        raise UserError("no prompt to run: name --categories, or give --prompts FILE")
    return tasks, categories + list(dict.fromkeys(task.category for task in own)), bool(own)


def run(
    methods: list[str], categories: list[str], per_category: int | None, max_new_tokens: int, repeats: int,
    out: Path, target: str, drafter: str, dtype: str, draft_dtype: str, threads: int, backend: str,
    temperature: float, top_k: int, top_p: float, seed: int, datastore: str | None = None,
    engines: list[str] | None = None, concurrency: list[int] | None = None, reference: str = "ar",
    ray: str | None = None, device: str | None = None, head: str | None = None, memory: str = "prompt",
    record_acceptance: Path | None = None, part: str = "held-out", step_aside: bool | None = None,
    prompts: Path | None = None,
) -> Path:
    """The benchmark on this machine, or with `ray` (a Ray cluster's address) on the cluster's nodes, each
    running every method on its share of the tasks; either way one records file, report and plots.
    `record_acceptance`: a file for every step's draft shape and acceptance (`bench.acceptance`); `step_aside=False`:
    our methods speculate at every step (no step-aside switch)."""
    from specdecode.types import SamplingParams

    levels = check_options(methods, repeats, concurrency, engines, backend, ray)
    if record_acceptance is not None and (ray is not None or temperature > 0):
        raise UserError("--record-acceptance records greedy runs on this machine: drop --ray and --temperature")
    recorder = acceptance.Recorder() if record_acceptance is not None else None
    if datastore is not None and not Path(datastore).is_file():
        raise UserError(f"no datastore at {datastore} (build one with `specdecode datastore build`)")
    check_head(head, methods)
    check_memory(memory)  # before the models load
    rows = runner_names(methods)
    if (ray is not None or not engines) and reference not in rows:  # (an engine's row is known once it answers)
        raise UserError(f"the reference {reference!r} is not a row of this run; rows: {', '.join(rows)}")
    config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature, top_k, top_p),
                              seed=seed)
    tasks, shown, own = drawn(categories, per_category, seed, part, prompts)
    setup = Setup(methods, target, drafter, dtype, draft_dtype, backend, threads, datastore, device, head, step_aside)
    console, start, date = Console(stderr=True), time.time(), time.strftime("%Y-%m-%d %H:%M")
    with RecordSink.fresh(out, console) as sink:
        if ray is None:
            outcome = run_here(setup, tasks, config, repeats, levels, engines or [], reference, sink, console,
                               memory, recorder)
        else:
            outcome = ray_shards.run(ray, setup, tasks, config, repeats, reference, sink, sink.expect, memory)
            if not config.sampling.greedy:
                outcome.notes[:0] = sampling_caveat()
    sampled = {"categories": ",".join(categories), "per-category": per_category if per_category is not None else "all",
               **({"part": part} if part != "held-out" else {})} if categories else {}  # (none: --prompts alone)
    options = {"methods": ",".join(methods) or "ar", **sampled, **({"prompts": prompts} if prompts is not None else {}),
               "max-new-tokens": max_new_tokens, "repeats": repeats,
               "temperature": temperature, "top-k": top_k, "top-p": top_p, "seed": seed,
               # what the run ran on, so the line reproduces it
               "backend": backend, "target": target, "drafter": drafter, "dtype": dtype, "draft-dtype": draft_dtype,
               "threads": threads, **({"datastore": datastore} if datastore is not None else {}),
               **({"head": head} if head is not None else {}),
               **({"reference": reference} if reference != "ar" else {}),
               **({"memory": memory} if memory != "prompt" else {}),
               **({"concurrency": ",".join(map(str, levels))} if levels != [1] else {}),
               **({"ray": ray} if ray is not None else {}),
               **({"record-acceptance": record_acceptance} if record_acceptance is not None else {}),
               **({"step-aside": "off"} if step_aside is False else {}), "out": out}
    settings = {
        "date": date,
        "commit": commit(),
        "command": "specdecode bench " + " ".join(f"--{k} {v}" for k, v in options.items())
                   + "".join(f" --engine '{option}'" for option in engines or []),
        "target / drafter": f"{target} / {drafter}",
        "decoding": "greedy" if config.sampling.greedy else
                    f"sampling (temperature {temperature}, top-k {top_k}, top-p {top_p})",
        "backend, dtype (target, draft), threads": (
            f"{backend}, {outcome.precision} ({dtype}), {loading.draft_dtype(draft_dtype)} ({draft_dtype}), "
            f"{outcome.threads}" if backend == "torch"
            else f"{backend}, {outcome.precision} (the GGUF file's own), {outcome.threads}"),
        "machine" if len(outcome.machines) == 1 else f"machines ({len(outcome.machines)} Ray nodes, each ratio "
                                                      "within one node)": "; ".join(outcome.machines),
        "tasks": f"{len(tasks)} ({', '.join(f'{c}: {sum(t.category == c for t in tasks)}' for c in shown)}), "
                 + ", ".join([f"seeded sample of each category's {part} part"] * bool(categories)
                             + [f"every prompt of {prompts}"] * bool(own) + ["chat template for every method"]),
        "translation data": TRANSLATION_SOURCE,
        "wall time": f"{time.time() - start:.0f} s",
    }
    if outcome.engines:
        settings["engines"] = outcome.engines
    if recorder is not None and record_acceptance is not None:
        acceptance.save(record_acceptance, recorder.runs, settings)
        console.print(f"wrote {record_acceptance}: {len(recorder.runs)} recorded runs")
    return write_report(out, outcome, settings, reference, console)


def write_report(out: Path, outcome: BenchOutcome, settings: dict[str, str], reference: str,
                 console: Console) -> Path:
    """report.md, the plots and (engines under load) levels.jsonl, from the records."""
    if outcome.levels:
        (out / "levels.jsonl").write_text("".join(json.dumps(run.to_json()) + "\n" for run in outcome.levels))
    summaries = report.summarise(outcome.records, outcome.lossless, reference, outcome.references)
    text = report.markdown(summaries, settings, outcome.notes, reference, outcome.levels)
    (out / "report.md").write_text(text)
    # what the run was, for the tables rendered from its records (scripts/method-table)
    (out / "settings.json").write_text(json.dumps(settings, indent=1, default=str) + "\n")
    render.save_outcome(out, outcome.lossless, outcome.references, reference, outcome.notes)  # (for --render)
    report.plots(summaries, out)
    return show(out, summaries, reference, outcome.notes, console)


def rerender(folder: Path) -> Path:
    """`specdecode bench --render DIR`: the report of a run's folder written again from its records (`bench.render`)."""
    summaries, reference, notes = render.render(folder)
    return show(folder, summaries, reference, notes, Console(stderr=True))


def show(out: Path, summaries: list, reference: str, notes: list[str], console: Console) -> Path:
    """The leaderboard and the remarks on the terminal; what was written where."""
    screen = Console()  # stdout: the command's output; 80 columns are enough, report.md has it all
    for table in [*terminal.leaderboard(summaries, reference, screen.width), terminal.per_method(summaries, reference)]:
        screen.print(table)
        screen.print()
    if found := report.remarks(summaries, notes):
        screen.print(Markdown("\n".join(found)))
    console.print(f"wrote {out / 'records.jsonl'}, {out / 'report.md'} (every figure, the engines' tables), "
                  f"{out / 'speedup.png'}, {out / 'acceptance_by_position.png'}")
    return out / "report.md"
