"""`specdecode bench`: every method and peer on every category (`specdecode.bench`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from specdecode.cli.options import (
    Backend, BackendOption, DatastoreOption, DeviceOption, DraftDType, DraftDTypeOption, DrafterOption, DType,
    DTypeOption, HeadOption, TargetOption, backend_device)
from specdecode.errors import UserError
from specdecode.models.registry import DEFAULT_DRAFTER, DEFAULT_TARGET

# --record-acceptance and --step-aside (bench.acceptance: recordings of the steps, for scripts/gpu-check to replay)
RecordAcceptanceOption = Annotated[Path | None, typer.Option(help=(
    "Write each greedy run's steps (the draft's shape as verified, the tokens accepted), prompt and output ids to "
    "this file (.json.gz: compressed), for scripts/gpu-check to replay on random-weight models of the same shapes "
    "(docs/benchmarking.md)."))]
StepAsideOption = Annotated[str, typer.Option(help=(
    "auto: each method's step-aside switch (plain steps while speculation is timed slower here); off: every step "
    "speculates, so that a recording keeps what the drafters draft rather than this machine's timing."))]


PartOption = Annotated[str, typer.Option(help=(
    "Which part of each category's prompts the sample draws from: held-out (what results report on), tuning (what "
    "tuning runs draw from; never reported as a result) or all. The split is fixed by the prompts' ids "
    "(docs/benchmarking.md)."))]

EngineOption = Annotated[list[str] | None, typer.Option(help=(
    "An OpenAI-compatible engine as one more row (repeatable): LABEL=openai:URL[;model=NAME][;api=completions|chat]"
    "[;extra_body=JSON][;reference=LABEL][;lossless=false][;stats=auto|vllm|sglang|response|none]"
    "[;api_key_env=VAR][;timeout=SECONDS], e.g. "
    "'llama-draft=openai:http://127.0.0.1:8081/v1;extra_body={\"cache_prompt\":false}'. With --engine and no "
    "--methods, only ar runs of ours."))]
MemoryOption = Annotated[str, typer.Option(help=(
    "What methods that learn across prompts (suffix, auto) keep between prompts: prompt (nothing: each prompt is "
    "a fresh request without a memory owner, as the server serves one; the default, what results report), or "
    "repeat (what the earlier prompts of the same repeat taught them, each repeat starting afresh: a warmed "
    "memory, for a labelled comparison)."))]
RayOption = Annotated[str | None, typer.Option(help=(
    "Share the prompts out over a Ray cluster's nodes, each running every method on its share (ratios stay "
    "within a node): auto, ray://HOST:PORT, HOST:PORT, or local (a Ray started on this machine). Needs "
    "pip install 'specdecode\\[ray]'."))]
PromptsOption = Annotated[Path | None, typer.Option(help=(
    "Your own prompts, every one run beside the --categories named (with --prompts alone, none of them): "
    ".jsonl, a line each {\"prompt\": TEXT} or {\"turns\": [TEXT, ...]} with an optional \"id\" and "
    "\"category\"; any other file, one prompt a line (docs/benchmarking.md)."))]
RenderOption = Annotated[Path | None, typer.Option(help=(
    "Write the report of an earlier run's --out folder again from its records (a run stopped with Ctrl-C "
    "wrote none), and run nothing."))]


def bench(
    methods: Annotated[str, typer.Option(
        help="Comma-separated methods (tree forms as NAME-tree) and peers (default: all).")] = "",
    categories: Annotated[str, typer.Option(help=(
        "Comma-separated categories (default: multi-turn, code, code-edit, math, qa, rag, summarisation, "
        "translation). long-context (prompts of 4k, 8k and 16k tokens: documents with a question, news digests, "
        "standard-library modules to edit or summarise) runs only when named: --categories long-context, or one "
        "length of it: long-context/8k. Its report has a column per length."))] = "",
    per_category: Annotated[int | None, typer.Option(min=1, help=(
        "Seeded sample of prompts per category (long-context: per length). Default 2 (--quick: 1)."))] = None,
    full: Annotated[bool, typer.Option("--full", help="Every prompt of every category (hours).")] = False,
    quick: Annotated[bool, typer.Option("--quick", help=(
        "1 prompt per category, 64 tokens, 1 repeat (each where its option is not given)."))] = False,
    max_new_tokens: Annotated[int | None, typer.Option(min=1, max=4096, help="Default 128 (--quick: 64).")] = None,
    repeats: Annotated[int | None, typer.Option(
        min=1, max=100, help="Interleaved repeats. Default 3 (--quick: 1).")] = None,
    temperature: Annotated[float, typer.Option(min=0.0, max=100.0, help="0: greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(min=0)] = 0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int, typer.Option(help="Seeds the prompt sample and sampling.")] = 0,
    part: PartOption = "held-out",
    threads: Annotated[int, typer.Option(min=1, max=256)] = 2,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: results/bench-<time>; not one holding "
                                                  "a run's records).")] = None,
    dtype: DTypeOption = DType("auto"),
    draft_dtype: DraftDTypeOption = DraftDType("auto"),
    backend: BackendOption = Backend("torch"),
    device: DeviceOption = "auto",
    datastore: DatastoreOption = None,
    head: HeadOption = None,
    target: TargetOption = DEFAULT_TARGET,
    drafter: DrafterOption = DEFAULT_DRAFTER,
    engine: EngineOption = None,
    concurrency: Annotated[str, typer.Option(help=(
        "Comma-separated client streams at once for the --engine rows, e.g. 1,4,16 (1: the interleaved run).")
    )] = "1",
    reference: Annotated[str, typer.Option(help=(
        "The row speedups and exactness are measured against: ar, or an --engine label."))] = "ar",
    memory: MemoryOption = "prompt",
    ray: RayOption = None,
    record_acceptance: RecordAcceptanceOption = None,
    step_aside: StepAsideOption = "auto",
    prompts: PromptsOption = None,
    render: RenderOption = None,
) -> None:
    """Spec-Bench-style evaluation: every method and peer on every category, interleaved and repeated."""
    from specdecode.bench.datasets import DEFAULT_CATEGORIES
    from specdecode.bench.main import LLAMACPP_METHODS, TORCH_METHODS, rerender, run

    if render is not None:
        rerender(render)
        return

    # --quick's sizes, or the defaults, where the command line gives none
    per_category = per_category or (1 if quick else 2)
    max_new_tokens = max_new_tokens or (64 if quick else 128)
    repeats = repeats or (1 if quick else 3)
    try:
        levels = [int(level) for level in concurrency.split(",") if level.strip()]
    except ValueError:
        raise UserError(f"--concurrency takes comma-separated stream counts (1,4,16), not {concurrency!r}") from None
    defaults = [] if engine else TORCH_METHODS if backend.value == "torch" else LLAMACPP_METHODS
    run(
        methods=_names(methods, "methods") or defaults,
        categories=_names(categories, "categories") or ([] if prompts is not None else DEFAULT_CATEGORIES),
        per_category=None if full else per_category,
        max_new_tokens=max_new_tokens, repeats=repeats,
        out=out or Path("results") / time.strftime("bench-%Y%m%d-%H%M%S"),
        target=target, drafter=drafter, dtype=dtype.value, draft_dtype=draft_dtype.value, threads=threads,
        backend=backend.value, device=backend_device(backend, device),
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        datastore=str(datastore) if datastore else None, head=str(head) if head else None,
        engines=engine or [], concurrency=levels, reference=reference, ray=ray, memory=memory,
        record_acceptance=record_acceptance, part=part, step_aside=step_aside_option(step_aside), prompts=prompts,
    )


def _names(listed: str, option: str) -> list[str]:
    """A comma-separated list's names, each once, in order (a category named twice would run its tasks twice under
    the same ids); a UserError for a list that names none (`--categories ,` ran every default one: a longer run)."""
    names = list(dict.fromkeys(name.strip() for name in listed.split(",") if name.strip()))
    if listed.strip() and not names:
        raise UserError(f"--{option} names none: give comma-separated names, or leave it out for the defaults")
    return names


def step_aside_option(value: str) -> bool | None:
    """--step-aside: auto (None: each method's own switch) or off (False)."""
    if value not in ("auto", "off"):
        raise UserError(f"--step-aside is auto or off, not {value!r}")
    return None if value == "auto" else False
