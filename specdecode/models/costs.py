"""The verification cost curve: what one forward over n new tokens costs, relative to one token.

On a CPU decoding is bound by reading the weights, so a forward over 8 tokens costs little more than
over 1 (PyTorch bf16 here: 1.2x), and a wider draft tree is nearly free up to a point that depends on
the model, the backend and the machine. The curve is measured once per model, backend and machine and
cached as JSON under the package cache; tree drafters size their trees from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass

import torch

from specdecode.models.base import CausalLM

SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CostCurve:
    """Relative cost of a forward over n new tokens; sizes ascending, relative[0] is for sizes[0] == 1."""

    sizes: tuple[int, ...]
    relative: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.relative) or len(self.sizes) < 2 or self.sizes[0] != 1:
            raise ValueError("a cost curve needs at least two sizes, starting at 1")

    def __call__(self, n: int) -> float:
        """Cost of a forward over n >= 1 tokens, in forwards over one token (piecewise linear, and
        linear beyond the last measured size)."""
        sizes, costs = self.sizes, self.relative
        i = 1
        while i < len(sizes) - 1 and sizes[i] < n:
            i += 1
        (x0, y0), (x1, y1) = (sizes[i - 1], costs[i - 1]), (sizes[i], costs[i])
        return max(y0 + (y1 - y0) * (n - x0) / (x1 - x0), 0.0)

    @staticmethod
    def linear(slope: float, sizes: tuple[int, ...] = SIZES) -> CostCurve:
        """A curve 1 + slope * (n - 1): slope 1 is a machine where width costs as much as depth."""
        return CostCurve(sizes, tuple(1 + slope * (n - 1) for n in sizes))


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def measure(model: CausalLM, sizes: tuple[int, ...] = SIZES, context: int = 128, repeats: int = 3) -> CostCurve:
    """Time forwards over each number of new tokens after a `context`-token prefix (medians)."""
    generator = torch.Generator().manual_seed(0)
    vocab = min(model.vocab_size, 1000)
    model.reset()
    model.forward(torch.randint(vocab, (context,), generator=generator), num_logits=1)
    model.forward(torch.randint(vocab, (max(sizes),), generator=generator))  # warm-up at the widest size
    model.crop(context)
    seconds = []
    for n in sizes:
        times = []
        for _ in range(repeats):
            tokens = torch.randint(vocab, (n,), generator=generator)
            start = time.perf_counter()
            model.forward(tokens, num_logits=n)  # a verification needs the logits of every token
            times.append(time.perf_counter() - start)
            model.crop(context)
        seconds.append(_median(times))
    model.reset()
    return CostCurve(tuple(sizes), tuple(s / seconds[0] for s in seconds))


def _machine() -> str:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}|{torch.get_num_threads()} threads|torch {torch.__version__}"


def cached(model: CausalLM, key: str) -> CostCurve:
    """The model's curve on this machine, measured on first use and cached.

    `key` names the model and backend (weights, dtype); the machine's CPU, thread count and torch version
    are added to it.
    """
    from specdecode.models.loading import cache_dir  # the package cache

    digest = hashlib.sha256(f"{key}|{_machine()}".encode()).hexdigest()[:16]
    path = cache_dir() / "costs" / f"{digest}.json"
    if path.exists():
        data = json.loads(path.read_text())
        return CostCurve(tuple(data["sizes"]), tuple(data["relative"]))
    curve = measure(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "machine": _machine(), "sizes": curve.sizes, "relative": curve.relative}))
    tmp.replace(path)
    return curve
