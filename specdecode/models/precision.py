"""`dtype="auto"`: the target's fastest path on this machine, chosen by timing whole forwards.

CPUs of the same kind differ: with AVX-512 bf16 units a bfloat16 product is several times faster than
float32 and nearly as cheap for 8 rows as for one; with AVX2 only, bfloat16 is emulated (its cost grows with
the rows), and which quantized path wins depends on more than one matrix product: the attention, the norms,
the LM head and the work around each layer's kernels are part of every step, and one MLP-shaped product can
rank int8 first where the whole int4 model decodes faster.

So the choice is made in two rounds. First each candidate path times one product of the model's MLP shape
(`measure_paths`, cheap: no model loaded), which only prunes the float paths more than `WHOLE_WITHIN` times
dearer per token than the best (on a CPU without bf16 units, bfloat16 and float32; they would also take the most
memory to load); the quantized paths are always timed whole. Then the model itself is loaded on each remaining
path in turn and its own decoder's one-token and eight-token forwards after a context are timed
(`time_forwards`); the cheapest per generated token wins (`decide`): (t1 + t8 / 3) / 2, decoding taken as
as many steps that verify one token as steps that verify eight and yield three (where text gives speculation
little, most steps are narrow; judging by the wide ones alone can rank first a path whose one-token forward
is far dearer: docs/backends.md, "`--dtype auto`"), a quantized path (int8, or int4 where its AVX2 kernel
runs), which is not the float model, only when it is QUANTIZED_MARGIN times cheaper than the best float path
timed. The whole choice is
measured once per machine and model and cached beside the cost curves (written atomically; a file that cannot be
read is moved aside with a warning and the paths timed again) (the quantized paths timed are prepared on
disk then, `models.prepared`, so the chosen one loads at once), so a second start reads it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import TypeVar

import torch

from specdecode.errors import UserError
from specdecode.models import dtype_choice, int4
from specdecode.models.int8 import InvariantInt8Linear
from specdecode.paths import mapping, read_json_cache, write_atomically

TOKENS_PER_WIDE_STEP = 3  # what an 8-token verification is taken to yield
# the quantized paths are not the float model (greedy agreement: docs/results/quality.md): taken only when at least
# this much cheaper per token than the best float path
QUANTIZED_MARGIN = 1.3


K = TypeVar("K", bound=Hashable)  # what names a timed call


def bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX); elsewhere it is emulated, and
    training in bfloat16 autocast is several times slower than in float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _time_interleaved(calls: Mapping[K, Callable[[], object]], repeats: int = 9) -> dict[K, float]:
    """Median seconds of each call, timed in turn round after round (after warm-up rounds), so that a
    moment of load elsewhere on the machine falls on every call alike, not on whichever ran then."""
    for _ in range(3):
        for fn in calls.values():
            fn()
    times: dict[K, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[repeats // 2] for name, t in times.items()}


def measure_paths(hidden: int, intermediate: int) -> dict[str, tuple[float, float]]:
    """Seconds of one [rows, hidden] x [hidden, intermediate] product per candidate path, for 1 and 8 rows
    (int4 only where its kernel runs), every path and width timed in turn."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(intermediate, hidden, generator=generator) * hidden**-0.5
    inputs = {rows: torch.randn(rows, hidden, generator=generator) for rows in (1, 8)}
    weight_bf16 = weight.bfloat16()
    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "bfloat16": (lambda x: x.bfloat16() @ weight_bf16.t()),
        "float32": (lambda x: x @ weight.t()),
        "int8": InvariantInt8Linear(weight),
    }
    if int4.usable():
        paths["int4"] = int4.InvariantInt4Linear(weight)
    calls = {(name, rows): functools.partial(path, inputs[rows]) for name, path in paths.items() for rows in (1, 8)}
    with torch.inference_mode():
        seconds = _time_interleaved(calls)
    return {name: (seconds[name, 1], seconds[name, 8]) for name in paths}


def per_token(seconds: tuple[float, float]) -> float:
    """The best a path can do per token: plain, or an 8-token verification at its yield (to prune with)."""
    one, eight = seconds
    return min(one, eight / TOKENS_PER_WIDE_STEP)


def mixed_per_token(seconds: tuple[float, float]) -> float:
    """A path's seconds per token over as many plain steps as 8-token verifications (to choose with)."""
    one, eight = seconds
    return (one + eight / TOKENS_PER_WIDE_STEP) / 2


FLOATS, QUANTIZED = ("bfloat16", "float32"), ("int8", "int4")
WHOLE_WITHIN = 2.0  # a path whose product costs more than this many times the best per token is not timed whole


def decide(measured: Mapping[str, tuple[float, float]]) -> str:
    """The path to take given each candidate's (one-token, eight-token) seconds (see the module docstring)."""
    floats = [name for name in FLOATS if name in measured]
    quantized = [name for name in QUANTIZED if name in measured]
    if not floats or not quantized:
        return min(floats or quantized, key=lambda name: mixed_per_token(measured[name]))
    best_float = min(floats, key=lambda name: mixed_per_token(measured[name]))
    best_quantized = min(quantized, key=lambda name: mixed_per_token(measured[name]))
    if mixed_per_token(measured[best_quantized]) * QUANTIZED_MARGIN <= mixed_per_token(measured[best_float]):
        return best_quantized
    return best_float


def candidates(products: Mapping[str, tuple[float, float]]) -> list[str]:
    """The paths worth timing whole: every quantized one (the fewest bytes to load, and the ones a product
    misranks most), and the float ones whose product costs at most WHOLE_WITHIN times the best per token."""
    best = min(per_token(times) for times in products.values())
    return [name for name, times in products.items()
            if name in QUANTIZED or per_token(times) <= WHOLE_WITHIN * best]


def time_forwards(model, context: int = 64, repeats: int = 5) -> tuple[float, float]:
    """Median seconds of a `CausalLM`'s forward over one and over eight new tokens after `context` tokens,
    timed in turn, the cache cropped back after each."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.vocab_size if hasattr(model, "vocab_size") else 1000
    tokens = torch.randint(0, min(vocab, 1000), (context + 8,), generator=generator)
    model.reset()
    model.forward(tokens[:context], num_logits=1)

    def forward(n: int) -> None:
        model.forward(tokens[context : context + n], num_logits=n)
        model.crop(context)

    seconds = _time_interleaved({1: functools.partial(forward, 1), 8: functools.partial(forward, 8)}, repeats)
    model.reset()
    return seconds[1], seconds[8]


def fastest(model_key: str, hidden: int, intermediate: int, load: Callable[[str], object]) -> str:
    """The cheapest path for a model on this machine: `load(path)` gives it as a `CausalLM` on a path, loaded
    only for the paths the product timing leaves (see the module docstring); measured once, then cached under
    `model_key` (what names the model: its folder)."""
    from specdecode.models import costs

    name = hashlib.sha256(f"{model_key}|{hidden}x{intermediate}".encode()).hexdigest()[:16]
    path = costs.cache_root() / f"precision3-{costs.machine_digest()}-{name}.json"  # 3: whole forwards
    kept = _kept(path)
    if kept is not None:  # measured before: decided again from the timings kept (the rule may have changed)
        choice = decide(kept["forwards"]) if kept.get("forwards") else kept["choice"]
        if choice != kept["choice"]:
            write_atomically(path, json.dumps(kept | {"choice": choice}))
            dtype_choice.remember(model_key, choice)
        return choice
    products = measure_paths(hidden, intermediate)
    whole: dict[str, tuple[float, float]] = {}
    for candidate in candidates(products):
        try:
            model = load(candidate)
        except UserError:  # a path this model cannot take (int8 or int4 where its projections are no nn.Linear)
            continue
        with torch.inference_mode():
            whole[candidate] = time_forwards(model)
        del model  # one path's weights in memory at a time
    choice = decide(whole)
    write_atomically(path, json.dumps({"choice": choice, "forwards": whole, "products": products}))
    dtype_choice.remember(model_key, choice)
    return choice


def _kept(path: Path) -> dict | None:
    """The choice cached in `path` with its timings, or None: not measured yet, or a file that cannot be read as
    one, which is moved aside with a warning (`paths.read_json_cache`) so the paths are timed again."""
    return read_json_cache(path, "dtype choice", "timing the paths again", _choice)


def _choice(data) -> dict:
    """`data` if it is a cached choice (a path, and each timed path's one- and eight-token seconds), else a
    ValueError."""
    forwards = mapping(data).get("forwards") or {}
    if not (isinstance(data.get("choice"), str) and isinstance(forwards, dict) and all(
            isinstance(times, list) and len(times) == 2 and all(type(t) in (int, float) for t in times)
            for times in forwards.values())):
        raise ValueError("not a choice (choice, forwards)")
    return data
