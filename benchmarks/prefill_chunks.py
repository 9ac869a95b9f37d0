"""What feeding a long prompt in chunks costs: the target's prefill whole and in chunks of each size, the ways
taking turns.

    python benchmarks/prefill_chunks.py [--dtype bfloat16] [--length 3000] [--chunks 0,89,178] [--repeats 2]

Chunk size 0 is the whole prompt in one forward; `auto` is `costs.prefill_chunk` of the target's cost curve
(what the engine feeds, `engine.prompts.prefill`). Prints each way's seconds per repeat and their medians.
A chunk reads the weights once more, so the smaller the chunks the slower the prefill; the larger, the
longer a server's other requests may wait for the chunk under way (README, *Long prompts*).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.api import load_models
from specdecode.models.costs import prefill_chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--length", type=int, default=3000)
    parser.add_argument("--chunks", default="0,auto")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    target = load_models(args.target, None, dtype=args.dtype, progress=False).target
    sizes = [prefill_chunk(target.cost_curve()) if c == "auto" else int(c) or args.length
             for c in args.chunks.split(",")]
    ids = torch.randint(100, 20000, (args.length,), generator=torch.Generator().manual_seed(0))
    seconds: dict[int, list[float]] = {size: [] for size in sizes}
    for repeat in range(args.repeats):
        for size in sizes:
            target.reset()
            start = time.perf_counter()
            for begin in range(0, args.length, size):
                target.forward(ids[begin : begin + size], num_logits=1)
            seconds[size].append(time.perf_counter() - start)
            print(f"repeat {repeat + 1}, chunks of {size}: {seconds[size][-1]:.1f} s", flush=True)
    target.reset()
    for size, times in seconds.items():
        print(f"{args.length} tokens in chunks of {size}: median {statistics.median(times):.1f} s", flush=True)


if __name__ == "__main__":
    main()
