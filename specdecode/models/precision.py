"""`dtype="auto"`: the target's fastest path on this machine, chosen by measurement.

CPUs of the same kind differ: with AVX-512 bf16 units a bfloat16 product is several times faster than
float32 and nearly as cheap for 8 rows as for one; with AVX2 only, bfloat16 is emulated (its cost grows with
the rows) and fbgemm's int8 product is the fastest (timings of one product of the 1.5B's MLP shape:
docs/results/cost-curves.md). So each
candidate path times one product of the model's MLP shape, for 1 row (plain decoding) and 8 rows (a
speculative step), and the cheapest per generated token wins: min(t1, t8 / 3), as if an 8-token
verification yielded three tokens; a quantized path (int8, or int4 where its AVX2 kernel runs), which
is not the float model, only when it is QUANTIZED_MARGIN times cheaper than the best float path. Measured
once per machine and shape, cached beside the cost curves.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

import torch

from specdecode.models import int4
from specdecode.models.int8 import InvariantInt8Linear

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
    if int4.available():
        paths["int4"] = int4.InvariantInt4Linear(weight)
    calls = {(name, rows): functools.partial(path, inputs[rows]) for name, path in paths.items() for rows in (1, 8)}
    with torch.inference_mode():
        seconds = _time_interleaved(calls)
    return {name: (seconds[name, 1], seconds[name, 8]) for name in paths}


def per_token(seconds: tuple[float, float]) -> float:
    one, eight = seconds
    return min(one, eight / TOKENS_PER_WIDE_STEP)


def fastest(hidden: int, intermediate: int) -> str:
    """The cheapest path for a model of this shape on this machine (measured once, then cached)."""
    from specdecode.models import costs

    path = costs.cache_root() / f"precision2-{costs.machine_digest()}-{hidden}x{intermediate}.json"  # 2: int4
    if path.exists():
        measured = {name: tuple(times) for name, times in json.loads(path.read_text()).items()}
    else:
        measured = measure_paths(hidden, intermediate)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(measured))
    best_float = min(("bfloat16", "float32"), key=lambda name: per_token(measured[name]))
    best_quantized = min((name for name in ("int8", "int4") if name in measured),
                         key=lambda name: per_token(measured[name]))
    if per_token(measured[best_quantized]) * QUANTIZED_MARGIN <= per_token(measured[best_float]):
        return best_quantized
    return best_float
