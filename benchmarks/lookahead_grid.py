"""Tune lookahead decoding's window W, n-gram size N and candidates G on this machine, in one run.

    python benchmarks/lookahead_grid.py [--grid 5,3,3 7,4,5 ...] [--categories code,math] [--prompts 2]

Every setting runs through the benchmark's harness beside plain decoding (`ar`) on the same prompts, order
changing per prompt, a warm-up excluded; prints decode-only speedup over ar per category, mean accepted tokens and
whether the outputs equal ar's. The defaults in `specdecode.drafters.lookahead` come from this script.
"""

from __future__ import annotations

import argparse

import torch

from specdecode.api import load_models
from specdecode.bench.scripts import compare, compare_arguments, save_report
from specdecode.bench.runners import engine_runner, our_runner
from specdecode.drafters.lookahead import LookaheadDrafter
from specdecode.engine import SpeculativeEngine

GRID = ["5,3,3", "7,3,5", "5,4,3", "7,4,5", "10,4,7", "7,5,5"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", nargs="+", default=GRID, help="W,N,G settings")
    compare_arguments(parser, categories="code", prompts=3, out="results/lookahead_grid.md")
    args = parser.parse_args()
    torch.set_num_threads(2)

    models = load_models(dtype="bfloat16")
    runners = {"ar": our_runner(models, "ar")}
    for setting in args.grid:
        window, ngram, candidates = (int(x) for x in setting.split(","))
        name = f"lookahead-W{window}N{ngram}G{candidates}"
        drafter = LookaheadDrafter(window, ngram, candidates, max_context=models.target.max_context)
        runners[name] = engine_runner(SpeculativeEngine(models.target, models.tokenizer, drafter, method=name))
    _, text = compare(models, runners, args.categories, args.prompts, args.max_new_tokens, args.repeats,
                      {"grid": " ".join(args.grid)})
    save_report(text, args.out)


if __name__ == "__main__":
    main()
