"""The target's prefill on the int4 path, two ways of the kernel's in turn.

    python benchmarks/prefill.py [--target NAME] [--lengths 256,1024] [--compare panels|slices] [--repeats 3]

`--compare panels` (the default): with many rows the AVX-512 VNNI variant unpacks weights into panels once
(`int4.PANEL_ROWS`) against unpacking them for each tile of rows (on a CPU without AVX-512 VNNI both ways are the
tiles). `--compare slices`: the kernel's row slices (`int4.ROW_SLICE_BYTES`) against one call for every row.
Prints seconds and tokens per second for each prompt length and way, the ways interleaved and their order
turned each repeat, then each way's median; the logits are asked for the last row only, as the engine does.
Both ways give the same logits, bit for bit: the script checks it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.api import load_models
from specdecode.models import int4

WAYS = {  # --compare -> {way: (the module setting it changes, its value)}
    "panels": {"tiles": ("PANEL_ROWS", 1 << 40), "panels": ("PANEL_ROWS", int4.PANEL_ROWS)},
    "slices": {"one call": ("ROW_SLICE_BYTES", 1 << 40), "sliced": ("ROW_SLICE_BYTES", int4.ROW_SLICE_BYTES)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--lengths", default="256,1024")
    parser.add_argument("--compare", choices=sorted(WAYS), default="panels")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    target = load_models(args.target, None, dtype="int4", progress=False).target
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, int4 kernel {int4.kernels()[-1]}, "
          f"{torch.get_num_threads()} threads", flush=True)
    ways = WAYS[args.compare]
    for n in map(int, args.lengths.split(",")):
        ids = torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(n))
        seconds: dict[str, list[float]] = {way: [] for way in ways}
        logits: dict[str, torch.Tensor] = {}
        for repeat in range(args.repeats):
            for way in list(ways)[:: 1 if repeat % 2 == 0 else -1]:
                name, value = ways[way]
                saved = getattr(int4, name)
                setattr(int4, name, value)
                try:
                    target.reset()
                    start = time.perf_counter()
                    logits[way] = target.forward(ids, num_logits=1).logits
                    seconds[way].append(time.perf_counter() - start)
                finally:
                    setattr(int4, name, saved)
                print(f"{n} tokens, {way}: {seconds[way][-1]:.2f} s, {n / seconds[way][-1]:.0f} tokens/s", flush=True)
        first, *others = logits.values()
        same = all(torch.equal(first, other) for other in others)
        medians = ", ".join(f"{way} {n / statistics.median(times):.0f}" for way, times in seconds.items())
        print(f"{n} tokens, median tokens/s: {medians}; logits {'identical' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
