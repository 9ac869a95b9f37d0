"""One forward of the quantized target through the lean decoder loop (`models.lean`) and through transformers'
forward, interleaved, at a given context: milliseconds for 1 and for 8 new tokens, and whether the logits
agree bit for bit.

    python benchmarks/lean_forward.py --dtype int4 --context 600 --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.api import load_models
from specdecode.models.hf import HFCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None,
                        help="registered name, hub id, folder or .gguf (default: the default target)")
    parser.add_argument("--dtype", default="int4", choices=["int4", "int8"])
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--widths", default="1,8")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kwargs = {} if args.target is None else {"target": args.target}
    model = load_models(drafter=None, dtype=args.dtype, progress=False, **kwargs).target.model
    lean, reference = HFCausalLM(model), HFCausalLM(model)
    if lean._lean is None:
        raise SystemExit("this model has no lean decoder loop (not a quantized Llama, Mistral or Qwen2)")
    reference._lean = None
    context = torch.randint(100, 20000, (args.context,), generator=torch.Generator().manual_seed(0))
    for lm in (lean, reference):
        lm.forward(context, num_logits=1)
    for width in [int(w) for w in args.widths.split(",")]:
        tokens = torch.randint(100, 20000, (width,), generator=torch.Generator().manual_seed(width))
        times: dict[str, list[float]] = {"lean": [], "transformers": []}
        same = True
        for _ in range(args.repeats):
            logits = []
            for name, lm in (("lean", lean), ("transformers", reference)):
                start = time.perf_counter()
                logits.append(lm.forward(tokens).logits)
                times[name].append(time.perf_counter() - start)
                lm.crop(args.context)
            same &= torch.equal(*logits)
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"{width} tokens: lean {medians['lean']:.1f} ms (min {min(times['lean']) * 1e3:.1f}), transformers "
              f"{medians['transformers']:.1f} ms (min {min(times['transformers']) * 1e3:.1f}); "
              f"lean/transformers {medians['lean'] / medians['transformers']:.3f}; logits identical: {same}")


if __name__ == "__main__":
    main()
