"""Speed of our methods against transformers' own generate() on HumanEval, in one interleaved run.

    python benchmarks/humaneval_speed.py [--prompts 10] [--max-new-tokens 128] [--repeats 2] [--out results/x.json]

Runs, on the same chat-templated HumanEval prompts, greedy, bf16, 2 threads:
  ours:  ar (the reference), draft (the 0.5B drafter), pld (prompt lookup)
  peers: transformers generate() plain, with assistant_model= (the 0.5B), with prompt_lookup_num_tokens=10
Order rotates across methods for every prompt and repeat so machine drift cancels; a warm-up run is
excluded. Tokens are counted from ids. Prints tokens/s (median over repeats of total tokens / total
seconds), speedup over our ar (median over repeats of the per-repeat ratio), mean accepted tokens, and
whether each output equals ar's, with the target's logit margin where one differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from specdecode import metrics
from specdecode.api import load_models
from specdecode.bench.datasets import humaneval_instruction, humaneval_prompts
from specdecode.bench.exactness import diagnose
from specdecode.bench.runners import build_runners
from specdecode.engine import GenerationConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--out", type=Path, default=Path("results/humaneval_speed.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()

    models = load_models(dtype="bfloat16")
    prompts = [models.encode(humaneval_instruction(p), chat=True) for p in humaneval_prompts(args.prompts)]

    names = ["ar", "draft", "pld", "hf-plain", "hf-assisted", "hf-prompt-lookup"]
    if args.methods:
        names = ["ar", *[n for n in args.methods.split(",") if n != "ar"]]
    runners = build_runners(models, names)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)

    def run(name: str, ids: list[int], n: int | None = None):
        output = runners[name].run(ids, config if n is None else GenerationConfig(max_new_tokens=n))
        mean = metrics.mean_accepted_tokens(output.steps) if output.steps else None
        return output.token_ids, output.seconds, mean

    names = list(runners)

    with console.status("Warm-up"):
        for name in runners:
            run(name, prompts[0], 8)

    # records[name][repeat][prompt] = (ids, seconds, mean accepted)
    records = {name: [[None] * len(prompts) for _ in range(args.repeats)] for name in names}
    with Progress(console=console) as progress:
        task = progress.add_task("runs", total=args.repeats * len(prompts) * len(names))
        for r in range(args.repeats):
            for p, ids in enumerate(prompts):
                shift = (r * len(prompts) + p) % len(names)
                for name in names[shift:] + names[:shift]:
                    records[name][r][p] = run(name, ids)
                    progress.advance(task)

    reference = [ids for ids, _, _ in records["ar"][0]]
    rows = []
    for name in names:
        per_repeat_tps = [
            sum(len(ids) for ids, _, _ in rec) / sum(sec for _, sec, _ in rec) for rec in records[name]
        ]
        ar_tps = [sum(len(ids) for ids, _, _ in rec) / sum(sec for _, sec, _ in rec) for rec in records["ar"]]
        accepted = [m for m in (rec[2] for rec in records[name][0]) if m is not None]
        divergences = []
        for p, (ids, _, _) in enumerate(records[name][0]):
            d = diagnose(models.target, prompts[p], reference[p], ids)
            if d is not None:
                divergences.append({"prompt": p, **d.__dict__, "likely_tie": d.likely_tie})
            elif len(ids) != len(reference[p]):
                divergences.append({"prompt": p, "length": len(ids), "reference_length": len(reference[p])})
        rows.append(
            {
                "method": name,
                "tokens": sum(len(ids) for ids, _, _ in records[name][0]),
                "tokens_per_second": statistics.median(per_repeat_tps),
                "speedup": statistics.median(t / a for t, a in zip(per_repeat_tps, ar_tps)),
                "mean_accepted_tokens": statistics.mean(accepted) if accepted else None,
                "identical_to_ar": f"{len(prompts) - len(divergences)}/{len(prompts)}",
                "divergences": divergences,
            }
        )

    table = Table(title=f"HumanEval x{len(prompts)}, {args.max_new_tokens} new tokens, greedy, bf16, "
                  f"{args.threads} threads, {args.repeats} repeats")
    for column in ["method", "tokens", "tokens/s", "speedup vs ar", "mean accepted", "identical to ar"]:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in rows:
        table.add_row(
            row["method"], str(row["tokens"]), f"{row['tokens_per_second']:.2f}", f"{row['speedup']:.2f}x",
            "-" if row["mean_accepted_tokens"] is None else f"{row['mean_accepted_tokens']:.2f}",
            row["identical_to_ar"],
        )
    console.print(table)
    for row in rows:
        for d in row["divergences"]:
            console.print(f"  {row['method']}: prompt {d['prompt']}: {d}", highlight=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                    "torch": torch.__version__, "threads": torch.get_num_threads()}, indent=1))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    sys.exit(main())
