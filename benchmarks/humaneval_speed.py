"""Speed of our methods against transformers' own generate() on HumanEval, in one interleaved run.

    python benchmarks/humaneval_speed.py [--prompts 10] [--max-new-tokens 128] [--repeats 2] [--out results/x.json]

Runs, on the same chat-templated HumanEval prompts (the first of the held-out part, `bench.samples.part_of`),
greedy, the target in bfloat16 (the drafter at its `auto` dtype), 2 threads, the methods of `METHODS`:
  ours:  ar (the reference), draft and draft-tree (the 0.5B drafter), pld and pld-tree (prompt lookup)
  peers: transformers generate() plain (hf-plain), with assistant_model= (the 0.5B; hf-assisted), with
         prompt_lookup_num_tokens=10 (hf-prompt-lookup)
through the benchmark's harness (`specdecode.bench`): order of methods changing for every prompt and
repeat, a warm-up excluded, tokens counted from ids. Prints tokens/s and speedup over our ar (mean over
repeats), mean accepted tokens, and whether each output equals ar's, with the target's logit margin
where one differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from specdecode.api import load_models
from specdecode.bench import report
from specdecode.bench.datasets import Task, humaneval_instruction, humaneval_prompts
from specdecode.bench.harness import run_benchmark
from specdecode.bench.main import diagnose_divergences
from specdecode.bench.runners import build_runners
from specdecode.bench.samples import part_of
from specdecode.bench.server_process import run_settings
from specdecode.engine import GenerationConfig

METHODS = ["ar", "draft", "draft-tree", "pld", "pld-tree", "hf-plain", "hf-assisted", "hf-prompt-lookup"]


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
    tasks = [Task("code", p["task_id"], (humaneval_instruction(p),)) for p in humaneval_prompts()]
    tasks = [task for task in tasks if part_of(task) == "held-out"][: args.prompts]  # never the tuning part
    runners = build_runners(models, [m for m in args.methods.split(",") if m] or METHODS)
    with console.status(f"{len(runners)} methods x {len(tasks)} prompts x {args.repeats} repeats"):
        records = run_benchmark(models, runners, tasks, GenerationConfig(max_new_tokens=args.max_new_tokens),
                                args.repeats)
    lossless = {name: runner.lossless for name, runner in runners.items()}
    summaries = report.summarise(records, lossless)
    divergences = diagnose_divergences(models, records, lossless)

    table = Table(title=f"HumanEval x{len(tasks)}, {args.max_new_tokens} new tokens, greedy, bf16, "
                  f"{torch.get_num_threads()} threads, {args.repeats} repeats")
    for column in ["method", "tokens", "tokens/s", "speedup vs ar", "mean accepted", "identical to ar"]:
        table.add_column(column, justify="left" if column == "method" else "right")
    rows = []
    for s in summaries:
        cell = s.cells[report.OVERALL]
        tokens = sum(len(r.token_ids) for r in records if r.method == s.method and r.ok and r.repeat == 0)
        exact = "-" if s.exact is None else f"{s.exact[0]}/{s.exact[1]}"
        rows.append({"method": s.method, "tokens": tokens, "tokens_per_second": cell.tokens_per_second,
                     "speedup": cell.speedup, "mean_accepted_tokens": cell.mean_accepted_tokens,
                     "identical_to_ar": exact, "failures": cell.failures})
        table.add_row(
            s.method, str(tokens), f"{cell.tokens_per_second[0]:.2f}", f"{cell.speedup[0]:.2f}x",
            "-" if cell.mean_accepted_tokens is None else f"{cell.mean_accepted_tokens:.2f}", exact,
        )
    console.print(table)
    for line in divergences + [f"{s.method} FAILED on {e}" for s in summaries for e in s.errors]:
        console.print(f"  {line}", highlight=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**run_settings(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                    "divergences": divergences, "torch": torch.__version__,
                                    "threads": torch.get_num_threads()}, indent=1))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    sys.exit(main())
