"""`specdecode bench`: load the models, run the harness, write records, report and plots."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.markdown import Markdown
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specdecode import metrics
from specdecode.api import load_models
from specdecode.bench import report
from specdecode.bench.datasets import TRANSLATION_SOURCE, sample_tasks
from specdecode.bench.exactness import diagnose
from specdecode.bench.harness import Record, run_benchmark
from specdecode.bench.openai_engines import LevelRun, build_engines, run_levels
from specdecode.bench.report import same_output
from specdecode.bench.runners import PEERS, build_runners, needs_draft_model
from specdecode.engine import GenerationConfig
from specdecode.errors import UserError
from specdecode.models import loading
from specdecode.methods import resolve, variant_names

ALL_METHODS = [*variant_names(), *PEERS]
# the default selection per backend: our methods that run there and that backend's peers (llamacpp-ar, the
# fastest plain decoder on a CPU, when asked for: it needs llama-cpp-python and the target's GGUF)
TORCH_METHODS = [*variant_names(), *(m for m, peer in PEERS.items() if peer.backend == "torch" and m != "llamacpp-ar")]
# llama.cpp runs our methods only, and not the draft model's tree (it cannot grow one in its own cache)
LLAMACPP_METHODS = [m for m in variant_names()  # the draft model's tree grows inside the draft's cache: torch only
                    if not m.startswith("draft-tree") and not resolve(m)[0].torch_only]
LLAMACPP_METHODS += [m for m, peer in PEERS.items() if peer.backend == "llamacpp"]


def diagnose_divergences(models, records: list[Record], lossless: dict[str, bool],
                         references: dict[str, str] | None = None, reference: str = "ar") -> list[str]:
    """For each lossless run whose output differs from its reference's (`ar`, or the row `references`
    names), where and with what logit margin; for an engine that streams text only, where the texts part
    (no logits: a near-tie cannot be told from a bug)."""
    runs = {(r.method, r.task_id, r.repeat): r for r in records if r.ok}
    notes = []
    for r in records:
        name = (references or {}).get(r.method, reference)
        other = runs.get((name, r.task_id, r.repeat))
        if r.method == name or not r.ok or other is None or not lossless[r.method] or same_output(r, other):
            continue
        against = "" if name == "ar" else f" vs {name}"
        if not (r.ids_known and other.ids_known):
            turn = next(i for i, (a, b) in enumerate(zip(r.texts, other.texts)) if a != b)
            mine, theirs = r.texts[turn], other.texts[turn]
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            notes.append(f"{r.method} on {r.task_id}{against} (repeat {r.repeat}, turn {turn + 1}): the text differs at "
                         f"character {at} ({theirs[at:at + 12]!r} vs {mine[at:at + 12]!r}); the engine streams text "
                         "without logits, so a numerical near-tie cannot be told from a bug")
            continue
        engine = r.engine_prompt_tokens is not None or other.engine_prompt_tokens is not None
        for turn, ((prompt, mine), (_, theirs)) in enumerate(zip(r.turns(), other.turns())):
            if mine != theirs:
                divergence = diagnose(models.target, prompt, theirs, mine)
                what = divergence.describe() if divergence else f"lengths differ ({len(mine)} vs {len(theirs)})"
                if divergence and engine:
                    what += " (the margin of our local target: an engine's own weights may round otherwise)"
                notes.append(f"{r.method} on {r.task_id}{against} (repeat {r.repeat}, turn {turn + 1}): {what}")
                break
    return notes


def sampled_fidelity(models, records: list[Record], lossless: dict[str, bool], params) -> list[str]:
    """Statistical exactness for sampling runs: the target's log-probability (under the processed
    distribution) of every sampled token, per method, against plain decoding's, by a two-sample KS test."""
    from specdecode.sampling import logits_to_probs

    log_probs: dict[str, list[float]] = {}
    for r in records:
        if not r.ok or not lossless[r.method]:
            continue
        for prompt, new in r.turns():
            if not new:
                continue
            models.target.reset()
            logits = models.target.forward(torch.tensor(prompt + new), num_logits=len(new) + 1).logits[:-1]
            probs = logits_to_probs(logits, params)  # [new, vocab]
            picked = probs[torch.arange(len(new)), torch.tensor(new)].clamp_min(1e-30)
            log_probs.setdefault(r.method, []).extend(picked.log().tolist())
    models.target.reset()
    notes = []
    for method, values in log_probs.items():
        if method == "ar" or "ar" not in log_probs:
            continue
        gap, p = metrics.two_sample_ks(values, log_probs["ar"])
        verdict = "consistent with the target's distribution" if p > 0.01 else "DIFFERS from plain sampling"
        notes.append(f"{method}: target log-probabilities of its {len(values)} sampled tokens vs ar's "
                     f"{len(log_probs['ar'])}: KS distance {gap:.3f}, p = {p:.3f} ({verdict}; tokens within "
                     "a sequence are not independent, so p is approximate)")
    return notes


def run(
    methods: list[str], categories: list[str], per_category: int | None, max_new_tokens: int, repeats: int,
    out: Path, target: str, drafter: str, dtype: str, draft_dtype: str, threads: int, backend: str, temperature: float, top_k: int,
    top_p: float, seed: int, datastore: str | None = None, engines: list[str] | None = None,
    concurrency: list[int] | None = None, reference: str = "ar",
) -> Path:
    from specdecode.types import SamplingParams

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
    config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature, top_k, top_p), seed=seed)
    tasks = sample_tasks(categories, per_category, seed=seed)
    torch.set_num_threads(threads)
    console = Console(stderr=True)
    elsewhere = [m for m in methods if m in PEERS and PEERS[m].backend != backend]
    if elsewhere:
        raise UserError(f"the peers {elsewhere} are compared on another backend; on --backend {backend} the peers "
                        f"are: {', '.join(m for m, peer in PEERS.items() if peer.backend == backend)}")
    models = load_models(target, drafter if needs_draft_model(methods) else None, dtype=dtype,
                         draft_dtype=draft_dtype, backend=backend)
    if datastore is not None and not Path(datastore).is_file():
        raise UserError(f"no datastore at {datastore} (build one with `specdecode datastore build`)")
    runners = build_runners(models, methods, datastore=datastore)
    probe = models.encode_chat([{"role": "user", "content": "Hello"}])
    engine_rows = build_engines(engines or [], set(ALL_METHODS) | set(runners), probe)
    runners.update({label: engine.runner() for label, engine in engine_rows.items()})
    references = {label: engine.spec.reference or reference for label, engine in engine_rows.items()}
    for name in {reference, *references.values()}:
        if name not in runners:
            raise UserError(f"the reference {name!r} is not a row of this run; rows: {', '.join(runners)}")
    first_turns = {t.task_id: models.encode_chat([{"role": "user", "content": t.turns[0]}]) for t in tasks}
    too_long = [task_id for task_id, ids in first_turns.items() if len(ids) + max_new_tokens > models.target.max_context]
    if too_long:
        console.print(f"[yellow]{len(too_long)} of {len(tasks)} tasks do not fit the target's context of "
                      f"{models.target.max_context} tokens with --max-new-tokens {max_new_tokens}: they are recorded "
                      f"as failures ({', '.join(too_long[:4])}{', ...' if len(too_long) > 4 else ''})")
    lossless = {name: runner.lossless for name, runner in runners.items()}
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / "records.jsonl"
    total = repeats * len(tasks) * (len(runners) + len(engine_rows) * sum(level > 1 for level in levels))
    with records_path.open("w") as sink, Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        bar = progress.add_task("warm-up", total=total)

        def on_record(record: Record) -> None:
            sink.write(json.dumps(record.to_json()) + "\n")
            sink.flush()
            progress.update(bar, advance=1, description=f"{record.method} {record.task_id}")

        start = time.time()
        records = run_benchmark(models, runners, tasks, config, repeats, on_record)
        loaded = run_levels(models, engine_rows, runners, tasks, config, levels, repeats, on_record)
    level_runs = [LevelRun(name, 1, repeat, sum(r.seconds for r in mine if r.ok), mine, report.summed_server(mine))
                  for name in engine_rows for repeat in range(repeats)
                  for mine in [[r for r in records if r.method == name and r.repeat == repeat]]] + loaded
    if loaded:
        (out / "levels.jsonl").write_text("".join(json.dumps(run.to_json()) + "\n" for run in level_runs))
    summaries = report.summarise(records, lossless, reference, references)
    greedy = config.sampling.greedy
    notes = diagnose_divergences(models, records, lossless, references, reference) if greedy else [
        "Sampling run: outputs are judged statistically, not token for token ('exact vs ar' only counts "
        "chance agreement); the exact distribution is also proven by tests/test_sampling_statistical.py.",
        *sampled_fidelity(models, records, lossless, config.sampling),
    ]
    settings = {
        "command": "specdecode bench " + " ".join(f"--{k} {v}" for k, v in {
            "methods": ",".join(methods) or "ar", "categories": ",".join(categories),
            "per-category": per_category if per_category is not None else "all", "max-new-tokens": max_new_tokens,
            "repeats": repeats, "temperature": temperature, "top-k": top_k, "top-p": top_p, "seed": seed,
            **({"reference": reference} if reference != "ar" else {}),
            **({"concurrency": ",".join(map(str, levels))} if levels != [1] else {}),
        }.items()) + "".join(f" --engine '{option}'" for option in engines or []),
        "target / drafter": f"{target} / {drafter}",
        "decoding": "greedy" if greedy else f"sampling (temperature {temperature}, top-k {top_k}, top-p {top_p})",
        "backend, dtype (target, draft), threads": (
            f"{backend}, {models.target.precision} ({dtype}), {loading.draft_dtype(draft_dtype)} ({draft_dtype}), "
            f"{torch.get_num_threads()}"
            if backend == "torch"
            else f"{backend}, the GGUF files' own quantization, {torch.get_num_threads()}"),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "tasks": f"{len(tasks)} ({', '.join(f'{c}: {sum(t.category == c for t in tasks)}' for c in categories)}), "
                 f"seeded sample, chat template for every method",
        "translation data": TRANSLATION_SOURCE,
        "wall time": f"{time.time() - start:.0f} s",
    }
    if engine_rows:
        settings["engines"] = "; ".join(f"{label}: {engine.spec.url} ({engine.model}, /v1/{engine.spec.api}"
                                        f"{', token ids' if engine.spec.api == 'completions' else ', its own template'})"
                                        for label, engine in engine_rows.items())
    text = report.markdown(summaries, settings, notes, reference, level_runs if loaded else None)
    (out / "report.md").write_text(text)
    report.plots(summaries, out)
    Console().print(Markdown(text))
    console.print(f"wrote {records_path}, {out / 'report.md'}, {out / 'speedup.png'}, {out / 'acceptance_by_position.png'}")
    return out / "report.md"

