"""The trained heads (EAGLE, EAGLE-3, Medusa) drafting in float32 and on the quantized kernels
(`drafters.heads.DRAFT_BITS`), interleaved prompt by prompt on one benchmark prompt per category: drafting
milliseconds per step, tokens per target forward, tokens/s against plain decoding, and whether every output
equals plain decoding's.

    python benchmarks/head_bits.py --dtype int4 --methods eagle3-tree,eagle-tree,medusa-tree --bits none,8,4
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from specdecode.api import load_models
from specdecode.bench.datasets import CATEGORIES, DEFAULT_CATEGORIES
from specdecode.drafters import heads
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.methods import resolve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--methods", default="eagle3-tree,eagle-tree,medusa-tree")
    parser.add_argument("--bits", default="none,8,4", help="comma-separated: none (float32), 8, 4")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--categories", default=",".join(DEFAULT_CATEGORIES))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = load_models(drafter=None, dtype=args.dtype, progress=False)
    settings = [None if b == "none" else int(b) for b in args.bits.split(",")]
    engines = {}
    for name in args.methods.split(","):
        method, options = resolve(name)
        for bits in settings:
            heads.DRAFT_BITS = bits  # read when the drafter builds its drafting copy of the head
            drafter = method.drafter(models.target, None, options)
            engines[name, bits] = SpeculativeEngine(models.target, models.tokenizer, drafter)
    plain = SpeculativeEngine(models.target, models.tokenizer)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    seconds, tokens, forwards, draft_ms = defaultdict(float), defaultdict(int), defaultdict(int), defaultdict(list)
    identical = defaultdict(int)
    prompts = 0
    for category in args.categories.split(","):
        task = CATEGORIES[category]()[0]
        prompt = models.encode(task.turns[0], chat=True)
        reference = plain.generate(prompt, config)
        seconds["ar"] += reference.seconds
        tokens["ar"] += reference.new_tokens
        prompts += 1
        for key, engine in engines.items():
            result = engine.generate(prompt, config)
            seconds[key] += result.seconds
            tokens[key] += result.new_tokens
            forwards[key] += result.target_forwards
            draft_ms[key] += [s.draft_seconds * 1e3 for s in result.steps if s.drafted]
            identical[key] += result.token_ids == reference.token_ids
        print(f"{category}: done", flush=True)
    base = tokens["ar"] / seconds["ar"]
    print(f"plain: {base:.1f} tokens/s over {prompts} prompts")
    for key in engines:
        rate = tokens[key] / seconds[key]
        median = statistics.median(draft_ms[key]) if draft_ms[key] else float("nan")
        print(f"{key[0]} bits={key[1]}: {rate:.1f} tokens/s ({rate / base:.2f}x plain), "
              f"{tokens[key] / forwards[key]:.2f} tokens/forward, drafting {median:.1f} ms/step (median), "
              f"identical to plain {identical[key]}/{prompts}")


if __name__ == "__main__":
    main()
