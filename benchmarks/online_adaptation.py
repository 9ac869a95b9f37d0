"""An EAGLE-3 head that keeps learning while it serves (`eagle3-online`) against the same head frozen
(`eagle3`), over one stream of benchmark prompts taken in turn: tokens per target forward and drafting
agreement as the stream goes on, tokens/s, and whether every output equals plain decoding's.

    python benchmarks/online_adaptation.py --dtype int4 --category code --prompts 12 --tree
"""

from __future__ import annotations

import argparse

import torch

from specdecode.api import load_models
from specdecode.bench.datasets import CATEGORIES
from specdecode.drafters.options import DrafterOptions
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.methods import get_method


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--category", default="code", choices=sorted(CATEGORIES))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", action="store_true", help="the tree forms (eagle3-tree, eagle3-online-tree)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = load_models(drafter=None, dtype=args.dtype, progress=False)
    options = DrafterOptions(tree=args.tree)
    engines = {name: SpeculativeEngine(models.target, models.tokenizer,
                                       get_method(name).drafter(models.target, None, options), gate=True)
               for name in ("eagle3", "eagle3-online")}
    plain = SpeculativeEngine(models.target, models.tokenizer)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    tasks = CATEGORIES[args.category]()[: args.prompts]
    rows = {name: [] for name in engines}  # per prompt: (tokens, forwards, seconds, accepted, drafted, identical)
    plain_seconds = plain_tokens = 0
    for number, task in enumerate(tasks, 1):
        prompt = models.encode(task.turns[0], chat=True)
        reference = plain.generate(prompt, config)
        plain_seconds, plain_tokens = plain_seconds + reference.seconds, plain_tokens + reference.new_tokens
        line = [f"prompt {number:2d}"]
        for name, engine in engines.items():
            result = engine.generate(prompt, config)
            accepted, drafted = sum(s.accepted for s in result.steps), sum(s.drafted for s in result.steps)
            rows[name].append((result.new_tokens, result.target_forwards, result.seconds, accepted, drafted,
                               result.token_ids == reference.token_ids))
            line.append(f"{name} {result.new_tokens / result.target_forwards:.2f} tokens/forward")
        print(", ".join(line), flush=True)
    half = len(tasks) // 2
    print(f"plain: {plain_tokens / plain_seconds:.1f} tokens/s")
    for name, data in rows.items():
        def rate(part):
            return sum(r[0] for r in part) / max(1, sum(r[1] for r in part))
        tokens, seconds = sum(r[0] for r in data), sum(r[2] for r in data)
        print(f"{name}: tokens/forward first half {rate(data[:half]):.2f}, second half {rate(data[half:]):.2f}; "
              f"accepted {sum(r[3] for r in data)} of {sum(r[4] for r in data)} drafted; "
              f"{tokens / seconds:.1f} tokens/s ({tokens / seconds / (plain_tokens / plain_seconds):.2f}x plain); "
              f"identical to plain {sum(r[5] for r in data)}/{len(data)}")
    adaptation = engines["eagle3-online"].drafter.state.adaptation
    if adaptation.updates:
        print(f"online: {adaptation.updates} optimiser steps in {adaptation.seconds:.1f} s; loss by sequence "
              f"{', '.join(f'{x:.2f}' for x in adaptation.losses)}")


if __name__ == "__main__":
    main()
