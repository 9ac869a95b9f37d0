"""The target's cost curve on every path this machine has: what a forward over n new tokens costs,
relative to one token, after a 256-token context (or several: `--contexts 256,2048,8192`, where the
attention over the cache makes width dearer).

    python benchmarks/cost_curves.py [--paths bfloat16,float32,int8,llamacpp] [--quantize Q4_0,Q8_0] [--contexts 256]

Paths: the torch backend in bfloat16, float32, int8 and int4 (`--dtype int8`/`int4`: batch-invariant;
`int4:avx2`, `int4:avx-vnni`, `int4:avx512-vnni` force a variant of the int4 kernel), and
llama.cpp on the target's GGUF (Q4_K_M for the default target); `--quantize` adds llama.cpp on
requantized copies of it (`llama_model_quantize`, cached beside the GGUF). Each model is timed with
`models.costs.measure` (sizes in turn within each repeat, medians), one model loaded at a time. Prints a
markdown table: milliseconds for one token, then the relative cost of 2, 4, 8, 16 and 32, and a prompt's
prefill in milliseconds per token (`costs.measure_prefill`; `--target qwen2.5-coder-0.5b-instruct` for the
draft model's), with what the CPU is (`torch.backends.cpu.get_cpu_capability()`, llama.cpp's system info).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
from pathlib import Path

import torch

from specdecode.api import gguf_of, load_models
from specdecode.models import costs, int4
from specdecode.models.registry import DEFAULT_TARGET

SIZES = (1, 2, 4, 8, 16, 32)


def requantized(gguf: Path, kind: str) -> Path:
    """A copy of `gguf` requantized to `kind` (made once, beside it)."""
    import ctypes

    import llama_cpp

    out = gguf.with_name(f"{gguf.stem}.{kind}.gguf")
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
        params.allow_requantize = True
        if llama_cpp.llama_model_quantize(str(gguf).encode(), str(out).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama_model_quantize failed for {kind}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--paths", default="bfloat16,float32,int8,llamacpp")
    parser.add_argument("--quantize", default="", help="llama.cpp requantizations to add, e.g. Q4_0,Q8_0,BF16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--contexts", default="256", help="tokens cached before the timed forwards, e.g. 256,2048,8192")
    parser.add_argument("--out", type=Path, default=Path("results/cost-curves.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    rows = {}  # label -> row; a path measured twice (or at several contexts) gets a row per pass
    loaded = {}  # the torch model of the last dtype measured
    paths = [p for p in args.paths.split(",") if p] + [f"llamacpp-{k}" for k in args.quantize.split(",") if k]
    for path in paths:
        if path.startswith("llamacpp"):
            from specdecode.models.llamacpp import LlamaCppLM

            gguf = gguf_of(args.target)  # the shipped file, loaded only when it is the path measured
            if gguf is None:
                raise SystemExit(f"{args.target} names no GGUF file: give a registered model or a .gguf path")
            if not gguf.exists():
                raise SystemExit(f"{gguf} is not there yet: run `specdecode models fetch` (or `make models`)")
            model = LlamaCppLM(gguf if path == "llamacpp" else requantized(gguf, path.split("-", 1)[1]),
                               n_ctx=max(4096, max(contexts) + max(SIZES) + 1))
        else:  # int4:NAME forces the int4 kernel variant NAME (`int4.KERNELS`); the weights are loaded once
            dtype, _, kernel = path.partition(":")
            if dtype not in loaded:
                loaded.clear()
                gc.collect()
                loaded[dtype] = load_models(args.target, None, dtype=dtype, progress=False).target
            model = loaded[dtype]
        for context in contexts:
            forced = path.startswith("int4:")
            with int4.forced_kernel(model.model, path.partition(":")[2]) if forced else contextlib.nullcontext():
                curve = costs.measure(model, sizes=SIZES, context=context, repeats=args.repeats)
            label = path if len(contexts) == 1 else f"{path} @{context}"
            label = next(f"{label} #{i}" for i in range(1, len(rows) + 2) if f"{label} #{i}" not in rows) \
                if label in rows else label
            rows[label] = {"context": context, "ms": curve.seconds * 1e3, "relative": dict(zip(SIZES, curve.relative)),
                           "prefill_ms_per_token": curve.prefill * 1e3}
            print(label, json.dumps(rows[label]), flush=True)
        del model
        gc.collect()
    import llama_cpp

    kernels = f"; int4 kernels here: {', '.join(int4.kernels())}" if int4.available() else ""
    print(f"\ntorch CPU capability: {torch.backends.cpu.get_cpu_capability()}{kernels}; llama.cpp: "
          f"{llama_cpp.llama_print_system_info().decode().strip()}\n")
    print("| path | 1 token | " + " | ".join(str(n) for n in SIZES[1:]) + " | prefill, per token |")
    print("|---" * (len(SIZES) + 2) + "|")
    for path, row in rows.items():
        print(f"| {path} | {row['ms']:.1f} ms | " + " | ".join(f"{row['relative'][n]:.2f}" for n in SIZES[1:])
              + f" | {row['prefill_ms_per_token']:.2f} ms |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
