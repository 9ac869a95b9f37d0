"""The target's prefill on the int4 path, with the kernel's row slices and without (one call for every row).

    python benchmarks/prefill.py [--target NAME] [--lengths 1024,4096]

Prints seconds and tokens per second for each prompt length, the two ways in turn; the logits are asked for the
last row only, as the engine does.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.api import load_models
from specdecode.models import int4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--lengths", default="1024,4096")
    args = parser.parse_args()
    target = load_models(args.target, None, dtype="int4", progress=False).target
    sliced = int4.ROW_SLICE_BYTES
    for n in map(int, args.lengths.split(",")):
        for label, slice_bytes in (("one call", 1 << 40), ("sliced", sliced)):
            int4.ROW_SLICE_BYTES = slice_bytes
            target.reset()
            ids = torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(n))
            start = time.perf_counter()
            target.forward(ids, num_logits=1)
            seconds = time.perf_counter() - start
            print(f"{n} tokens, {label}: {seconds:.1f} s, {n / seconds:.0f} tokens/s", flush=True)
    int4.ROW_SLICE_BYTES = sliced


if __name__ == "__main__":
    main()
