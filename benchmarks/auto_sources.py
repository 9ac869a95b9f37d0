"""What `auto` should be made of: its composite with some of its sources left out, beside `ar` and `pld`, in one
interleaved run (greedy, the default pair, int4 target, 64 tokens).

    python benchmarks/auto_sources.py [--variants copy+medusa,copy] [--categories rag,qa] [--per-category 1]
                                      [--repeats 2] [--out records.jsonl]
    python benchmarks/over_peer.py records.jsonl --baseline ar
    python benchmarks/within_noise.py records.jsonl [--decoding-alone]

Variants: `auto-all` (the copies, Medusa and EAGLE-3 trees, the draft model as the fallback: what `auto` was
before it took one head), `auto-nodraft` (the same without the draft model), `copy+medusa`, `copy` (prompt
lookup and the suffix cache), `head-below-1` and `head-below-2` (the copies, and the shipped Medusa heads asked
only while the copies promise fewer than 1 or 2 accepted tokens, as the draft model is asked),
`suffix-head-below-2` (the same without prompt lookup), `auto-dear` (`auto` with the step-aside switch pricing a
slow first speculative step as a trial's cost, as it did before `Drafter.catches_up`), `auto-aside` (`auto`
with the engine's step-aside switch, as before `Drafter.weighs_itself`; in the records of
benchmarks/reports/auto-always-2026-11-27/, made before that change, `auto` is this and `auto-always` today's
`auto`). Rows `ar`, `pld`, `suffix` and `auto` always run. Every method forgets earlier prompts before each run
(`--memory prompt`), or as each repeat starts (`--memory repeat`, as `specdecode bench` does).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode.api import load_models
from specdecode.bench.datasets import DEFAULT_CATEGORIES
from specdecode.bench.samples import sample_tasks
from specdecode.bench.harness import method_order, run_task
from specdecode.bench.runners import engine_runner, our_runner
from specdecode.drafters.auto import HEAD_KINDS, head_drafter
from specdecode.drafters.composite import CompositeDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.options import DrafterOptions
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.sources import Source
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine.payoff import StepAside
from specdecode.methods import choose
from specdecode.models.registry import DEFAULT_DRAFTER, DEFAULT_TARGET

VARIANTS = {  # name -> the sources kept: copies, heads by kind, "draft"
    "auto-all": ("copy", "medusa", "eagle3", "draft"),
    "auto-nodraft": ("copy", "medusa", "eagle3"),
    "copy+medusa": ("copy", "medusa"),
    "copy": ("copy",),
    # the shipped head asked only while the copies promise fewer than 1 or 2 accepted tokens (the fallback rule)
    "head-below-1": ("copy", "medusa", "head-fallback"),
    "head-below-2": ("copy", "medusa", "head-fallback"),
    # the same without prompt lookup: the suffix cache indexes the prompt too
    "suffix-head-below-2": ("suffix", "medusa", "head-fallback"),
    # `auto` with the step-aside switch as it was: a slow first speculative step after plain ones is a trial's
    # price even where the drafter owes nothing then (`Drafter.catches_up`)
    "auto-dear": (),
    # `auto` with the engine's step-aside switch, as it was before `Drafter.weighs_itself`
    "auto-aside": (),
}


def variant(models, name: str, kept: tuple[str, ...]):
    target = models.target
    curve = target.cost_curve()
    sources = [Source(PromptLookupDrafter())] if "copy" in kept else []
    sources += [Source(SuffixDrafter(curve, tree=True))] if "copy" in kept or "suffix" in kept else []
    head_cost = "expensive" if "head-fallback" in kept else "free"
    sources += [Source(head_drafter(target, kind, None, DrafterOptions()), head_cost)
                for kind in HEAD_KINDS if kind in kept]
    if "draft" in kept:
        sources.append(Source(DraftModelDrafter.for_models(models.draft, target), "expensive"))
    below = float(name.rsplit("-", 1)[1]) if "head-fallback" in kept else 1.0
    drafter = CompositeDrafter(sources, curve, tree=True, final_layer=target.model.config.num_hidden_layers,
                               fallback_below=below)
    drafter.name = name
    return engine_runner(SpeculativeEngine(target, models.tokenizer, drafter, method=name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--categories", default=",".join(DEFAULT_CATEGORIES))
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("results/auto-sources.jsonl"))
    parser.add_argument("--memory", choices=("prompt", "repeat"), default="prompt",
                        help="forget what earlier prompts taught before every prompt, or as each repeat starts")
    args = parser.parse_args()
    chosen = [name.strip() for name in args.variants.split(",") if name.strip()]
    if unknown := [name for name in chosen if name not in VARIANTS]:
        parser.error(f"unknown variant {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    models = load_models(DEFAULT_TARGET, DEFAULT_DRAFTER, dtype="int4", progress=True)
    runners = {name: our_runner(models, name) for name in ("ar", "pld", "suffix", "auto")}
    runners |= {name: variant(models, name, VARIANTS[name]) for name in chosen if VARIANTS[name]}
    # `auto` with a step-aside switch put back: trials always dear, or dear as the engine would have them
    for name, dear in (("auto-dear", True), ("auto-aside", None)):
        if name in chosen:
            drafter = models.drafter_for(choose("auto"))
            engine = SpeculativeEngine(models.target, models.tokenizer, drafter, method=name)
            engine.step_aside = StepAside(dear_trials=drafter.catches_up if dear is None else dear)
            runners[name] = engine_runner(engine)
    tasks = sample_tasks([c.strip() for c in args.categories.split(",") if c.strip()], args.per_category,
                         part="tuning")  # a tuning script: never the prompts the headline reports on
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    names = list(runners)
    for name in names:  # warm up
        run_task(models, runners[name], tasks[0], GenerationConfig(max_new_tokens=8), -1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for repeat in range(args.repeats):
            for runner in runners.values():
                runner.forget()
            for index, task in enumerate(tasks):
                for name in method_order(names, repeat * len(tasks) + index):
                    if args.memory == "prompt":
                        runners[name].forget()
                    record = run_task(models, runners[name], task, config, repeat)
                    out.write(json.dumps({"method": name, "category": task.category, "task_id": task.task_id,
                                          "repeat": repeat, "turn_lengths": record.turn_lengths,
                                          "seconds": record.seconds, "prefill_seconds": record.prefill_seconds,
                                          "error": record.error}) + "\n")
                    out.flush()
                print(f"repeat {repeat}: {task.task_id}", flush=True)
    print(f"wrote {args.out}; summarise with: python benchmarks/over_peer.py {args.out} --baseline ar")


if __name__ == "__main__":
    main()
