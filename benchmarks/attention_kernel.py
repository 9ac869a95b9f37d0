"""The batch-invariant attention kernel (`models/kernels/attention.cpp`) on the 1.5B target's shapes: one token's
28 layers (12 query heads over 2 key heads, head size 128, random data), milliseconds for 1 and 8 rows at each
context. With `--baseline REV`, the kernel's source at that git revision is compiled under another name and timed
in turn with the current one, and their outputs compared bit for bit.

    python benchmarks/attention_kernel.py --contexts 600,2048,8192 [--baseline efde1e2^]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import torch

from specdecode.models import int4, int8

SOURCE = "specdecode/models/kernels/attention.cpp"


def baseline_kernel(revision: str):
    """The kernel's source at `revision`, compiled as the torch extension `attention_baseline`."""
    root = Path(__file__).resolve().parent.parent
    text = subprocess.run(["git", "show", f"{revision}:{SOURCE}"], cwd=root, check=True, capture_output=True,
                          text=True).stdout
    text = text.replace("TORCH_LIBRARY(specdecode_attention", "TORCH_LIBRARY(attention_baseline")
    text = text.replace("TORCH_LIBRARY_IMPL(specdecode_attention", "TORCH_LIBRARY_IMPL(attention_baseline")
    path = Path(tempfile.mkdtemp()) / "attention_baseline.cpp"
    path.write_text(text)
    return int4.compile_kernel("attention_baseline", path, f"the attention kernel of {revision}")


def time_calls(kernels: list, args, layers: int, repeats: int) -> list[float]:
    """Each kernel's fastest of `repeats` rounds of `layers` calls, in milliseconds, the kernels taking turns."""
    import time

    best = [float("inf")] * len(kernels)
    for _ in range(repeats):
        for i, kernel in enumerate(kernels):
            start = time.perf_counter()
            for _ in range(layers):
                kernel.attention(*args)
            best[i] = min(best[i], (time.perf_counter() - start) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="600,2048,8192")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--baseline", default=None, help="a git revision whose kernel to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = int8._kernel()
    if kernel is None:
        raise SystemExit("the attention kernel does not build here (it needs an x86 CPU with AVX2 and a compiler)")
    kernels = {"current": kernel}
    if args.baseline:
        kernels[args.baseline] = baseline_kernel(args.baseline)
    generator = torch.Generator().manual_seed(0)
    identical = True
    print(f"| context | rows | {' | '.join(f'{name} (ms, 28 layers)' for name in kernels)} |")
    print(f"|---|---|{'---|' * len(kernels)}")
    for length in [int(c) for c in args.contexts.split(",")]:
        key, value = torch.randn(2, 2, length, 128, generator=generator)
        for n in [int(r) for r in args.rows.split(",")]:
            query = torch.randn(12, n, 128, generator=generator)
            call = (query, key, value, 128 ** -0.5, *int8._csr(int8._visible(None, n, length)))
            outputs = [k.attention(*call) for k in kernels.values()]
            identical &= all(torch.equal(outputs[0], other) for other in outputs[1:])
            times = time_calls(list(kernels.values()), call, 28, args.repeats)
            print(f"| {length} | {n} | {' | '.join(f'{t:.1f}' for t in times)} |")
    if args.baseline:
        print(f"outputs identical to {args.baseline}'s: {identical}")


if __name__ == "__main__":
    main()
