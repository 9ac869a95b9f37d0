"""Medusa's heads over the truncated draft vocabulary against the target's whole LM head, in one run.

    python benchmarks/medusa_vocabulary.py [--categories code,math,qa] [--prompts 1] [--max-new-tokens 96]

The shipped heads (`specdecode/heads/<target>/medusa`) draft as a chain and as a tree, each once with the
LM-head rows of the draft vocabulary (what `--method medusa` uses) and once with the whole vocabulary,
beside plain decoding (`ar`) on the same prompts through the benchmark's harness. Prints the speedup
over ar, mean accepted tokens and, per method, the share of a step spent drafting.
"""

from __future__ import annotations

import argparse

import torch

from specdecode.api import load_models
from specdecode.bench.scripts import compare, compare_arguments, save_report
from specdecode.bench.runners import engine_runner, our_runner
from specdecode.drafters.heads import shipped_head
from specdecode.drafters.medusa import MedusaDrafter, MedusaHeads
from specdecode.engine import SpeculativeEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    compare_arguments(parser, categories="code,math,qa,multi-turn", prompts=1, out="results/medusa_vocabulary.md")
    args = parser.parse_args()
    torch.set_num_threads(2)

    models = load_models(dtype="bfloat16")
    model = models.target.model
    heads, _ = MedusaHeads.load(shipped_head(model, "medusa"), dtype=model.dtype)
    curve = models.target.cost_curve()
    runners = {"ar": our_runner(models, "ar")}
    for tree in (False, True):
        for full in (False, True):
            name = "medusa" + ("-tree" if tree else "") + ("-full-vocabulary" if full else "")
            drafter = MedusaDrafter(heads, model, curve, tree=tree, full_vocabulary=full)
            runners[name] = engine_runner(SpeculativeEngine(models.target, models.tokenizer, drafter, method=name))
    records, text = compare(models, runners, args.categories, args.prompts, args.max_new_tokens, args.repeats)
    shares = []
    for name in runners:
        steps = [s for r in records if r.method == name and r.ok for s in r.steps[1:]]  # decode steps
        drafting = sum(s.draft_seconds for s in steps)
        total = drafting + sum(s.verify_seconds for s in steps)
        shares.append(f"- {name}: drafting {100 * drafting / total:.1f}% of decode time, "
                      f"{1000 * drafting / max(1, len(steps)):.1f} ms per step")
    save_report(text + "\n\n" + "\n".join(shares) + "\n", args.out)


if __name__ == "__main__":
    main()
