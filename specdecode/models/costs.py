"""The verification cost curve: what one forward over n new tokens costs, relative to one token.

On a CPU decoding is bound by reading the weights, so a forward over 8 tokens costs little more than
over 1 (figures: docs/results/cost-curves.md), and a wider draft tree is nearly free up to a
point that depends on the model, the backend and the machine. The curve is measured once per model,
backend and machine and cached as JSON under the package cache; tree drafters size their trees from it.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import json
import math
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from specdecode import devices
from specdecode.models import holding
from specdecode.paths import cache_dir, console, set_aside, write_atomically

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM  # whose cost_curve() imports this module
    from specdecode.models.live_curve import LiveCurve

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
FLOOR = 1e-3  # no forward costs less than this (noisy measurements must not make one free)


class Curve(Protocol):
    """What the budget and draft-length choices read of a cost curve: a `CostCurve`, or a `LiveCurve`
    correcting one from the forwards the engine times."""

    @property
    def sizes(self) -> tuple[int, ...]: ...

    def __call__(self, n: int) -> float: ...


@dataclass(frozen=True)
class CostCurve:
    """Relative cost of a forward over n new tokens; sizes ascending, relative[0] is for sizes[0] == 1."""

    sizes: tuple[int, ...]
    relative: tuple[float, ...]
    seconds: float = 0.0  # a forward over one token, as measured (0: not measured)
    # a prompt's prefill, seconds per token (a PREFILL_TOKENS forward asking one row of logits; 0: not
    # measured): far less than the curve's widest size per token, which asks every row's logits
    prefill: float = 0.0

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.relative) or len(self.sizes) < 2 or self.sizes[0] != 1:
            raise ValueError("a cost curve needs at least two sizes, starting at 1")

    def __call__(self, n: int) -> float:
        """Cost of a forward over n >= 1 tokens, in forwards over one token: what the smallest measured
        size of at least n costs (the cheapest of it and every larger size), linear beyond the last.

        A step rather than a line between sizes because batch sizes are not smooth on every backend:
        llama.cpp's matrix kernels take 16 tokens for less than 17, or even 12 (docs/results/code-choices.md).
        A forward of a size that was not measured is charged as if padded to one that was, and a drafter
        that can offer more tokens (a longer copy, more tree nodes) fills the batch up to it, as the
        budget search finds on its own.
        """
        sizes, costs = self.sizes, self.relative
        if n > sizes[-1]:  # beyond the measurements: the last segment's slope, but never below a prompt token's
            # prefill (a live curve's last segment can be flat, which made drafts beside a prompt's chunk free)
            slope = (costs[-1] - costs[-2]) / (sizes[-1] - sizes[-2])
            return max(costs[-1] + max(slope, self.prefill / self.seconds if self.seconds > 0 else 0.0, 0.0)
                       * (n - sizes[-1]), FLOOR)
        return self._at_least[bisect.bisect_left(sizes, n)]

    @functools.cached_property
    def _at_least(self) -> tuple[float, ...]:
        """Per size: the cheapest cost of it and every larger size, floored (what `__call__` reads: a budget search
        asks the curve dozens of times a step)."""
        cheapest, out = math.inf, []
        for cost in reversed(self.relative):
            cheapest = min(cheapest, cost)
            out.append(max(cheapest, FLOOR))
        return tuple(reversed(out))

    def observe(self, n: int, seconds: float, context: int | None = None) -> None:
        """A fixed curve learns nothing from timings (`LiveCurve` does)."""

    def at(self, context: int) -> None:
        """A fixed curve prices every cache length alike (`LiveCurve` does not)."""

    def probe(self, widest: int) -> int | None:
        """A fixed curve has nothing to probe."""
        return None

    @staticmethod
    def linear(slope: float, sizes: tuple[int, ...] = SIZES) -> CostCurve:
        """A curve 1 + slope * (n - 1): slope 1 is a machine where width costs as much as depth."""
        return CostCurve(sizes, tuple(1 + slope * (n - 1) for n in sizes))


def lower_median(values) -> float:
    """The lower median (of two values, the smaller)."""
    return sorted(values)[(len(values) - 1) // 2]


def measure(model: CausalLM, sizes: tuple[int, ...] = SIZES, context: int = 256, repeats: int = 5) -> CostCurve:
    """Time forwards over each number of new tokens after a `context`-token prefix: sizes in turn within
    each repeat (so a slow moment of a shared machine does not skew one size), medians over repeats."""
    generator = torch.Generator().manual_seed(0)
    clock = devices.clock(model.device)  # waits for a GPU's queued kernels before each reading
    vocab = min(model.vocab_size, 1000)
    context = max(1, min(context, model.max_context - max(sizes) - 1))  # a small model's context must hold it
    prefill = measure_prefill(model, context, generator)
    model.forward(torch.randint(vocab, (context,), generator=generator, device="cpu"), num_logits=1)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for repeat in range(repeats + 1):  # the first round warms up
        for n in sizes:
            tokens = torch.randint(vocab, (n,), generator=generator, device="cpu")
            # Measured as a tree is verified: an explicit attention mask (here a causal one, which costs
            # what any tree mask costs) and the logits of every token.
            mask = torch.ones(n, n, dtype=torch.bool, device="cpu").tril()
            start = clock()
            model.forward(tokens, tree_mask=mask if n > 1 else None, num_logits=n)
            if repeat:
                times[n].append(clock() - start)
            model.crop(context)
    model.reset()
    seconds = [lower_median(times[n]) for n in sizes]
    return CostCurve(tuple(sizes), tuple(s / seconds[0] for s in seconds), seconds[0], prefill)


PREFILL_TOKENS = 256


def measure_prefill(model: CausalLM, tokens: int = PREFILL_TOKENS, generator: torch.Generator | None = None) -> float:
    """Seconds per token of a prompt's prefill: the faster of two forwards over `tokens` tokens into an
    empty cache (the first also warms up), one row of logits. Leaves the model's cache empty."""
    vocab = min(model.vocab_size, 1000)
    tokens = max(1, min(tokens, model.max_context - 1))
    clock = devices.clock(model.device)
    best = float("inf")
    for _ in range(2):
        model.reset()
        prompt = torch.randint(vocab, (tokens,), generator=generator, device="cpu")
        start = clock()
        model.forward(prompt, num_logits=1)
        best = min(best, clock() - start)
    model.reset()
    return best / tokens


# A long prompt's prefill is fed in forwards of about this long (`prefill_chunk`): what a request that comes
# in meanwhile waits at most on a server (`engine.batch`), against the weights read once more for every chunk
# (a forward's share that does not shrink with its tokens); the figures: docs/results/code-choices.md.
CHUNK_SECONDS = 1.0
DEFAULT_CHUNK = 256  # prompt tokens a forward, where the curve has no prefill figure
MIN_CHUNK, MAX_CHUNK = 16, 4096


def prefill_chunk(curve: CostCurve | LiveCurve, seconds: float = CHUNK_SECONDS) -> int:
    """Prompt tokens one forward of a prefill feeds at most: about `seconds` by the curve's prefill
    figure (DEFAULT_CHUNK where it has none), within MIN_CHUNK .. MAX_CHUNK.

    Why chunks: between two forwards a server runs other requests' steps and notices a client leaving or a
    deadline passing (`engine.batch`, `serve.worker`), and a forward's activations stay bounded. The figure
    is timed at the start of a prompt; attention grows with the context, so a chunk deep into a long prompt
    costs more (the batch sizes its chunks by their pace: `engine.pacing.PrefillShare`)."""
    if not curve.prefill > 0:
        return DEFAULT_CHUNK
    return max(MIN_CHUNK, min(MAX_CHUNK, round(seconds / curve.prefill)))


def _machine() -> str:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    # with the instructions PyTorch runs here: ATEN_CPU_CAPABILITY=avx2 makes another machine of an AVX-512 one
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{cpu}|{capability}|{torch.get_num_threads()} threads|torch {torch.__version__}"


def machine() -> str:
    """This machine as a report names it: the CPU's model, the instructions PyTorch runs on it, threads, torch."""
    return _machine().replace("|", ", ")


def cache_root() -> Path:
    return cache_dir() / "costs"


def draft_cost(draft: CausalLM, target: CausalLM) -> float:
    """A one-token draft forward in one-token target forwards, from both measured curves."""
    return draft.cost_curve().seconds / target.cost_curve().seconds


def machine_digest() -> str:
    """Names this machine (CPU, threads, torch) in cache file names."""
    return hashlib.sha256(_machine().encode()).hexdigest()[:12]


def _path(key: str) -> Path:
    digest = hashlib.sha256(f"{key}|{_machine()}|{SIZES}".encode()).hexdigest()[:16]
    return cache_root() / f"{digest}.json"


def store(key: str, curve: CostCurve) -> None:
    """Cache `curve` as the model's on this machine (atomically: concurrent processes may write too)."""
    write_atomically(_path(key), json.dumps({"key": key, "machine": _machine(), "sizes": curve.sizes,
                                             "relative": curve.relative, "seconds": curve.seconds,
                                             "prefill": curve.prefill}))


def _load(path: Path) -> tuple[CostCurve, bool]:
    """The curve cached in `path`, and whether its prefill was measured (a file older than that lacks it);
    a ValueError saying what is wrong with the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:  # a folder in its place, a file without read permission
        raise ValueError(f"cannot be read ({error.strerror or error})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"not JSON ({error})") from None
    if not isinstance(data, dict) or not {"sizes", "relative", "seconds"} <= set(data):
        raise ValueError("not a cost curve (sizes, relative, seconds)")
    sizes, relative = data["sizes"], data["relative"]
    numbers = [data["seconds"], data.get("prefill", 0.0)]
    if not (isinstance(sizes, list) and all(type(n) is int and n > 0 for n in sizes) and sizes == sorted(set(sizes))):
        raise ValueError(f"its sizes are not positive integers in ascending order: {str(sizes)[:80]}")
    if not isinstance(relative, list) or not all(_finite(c) and c > 0 for c in relative):
        raise ValueError(f"its relative costs are not positive numbers: {str(relative)[:80]}")
    if not all(_finite(n) and n >= 0 for n in numbers) or not numbers[0] > 0:
        raise ValueError(f"its seconds are not a measured time and a number of at least 0: {numbers}")
    # what `measure` writes, and what a LiveCurve can correct: a curve without some sizes never learns their
    # cost (a forward wider than its last size is not timed), and one whose first size is not the unit prices
    # every width wrong until timings arrive
    if tuple(sizes) != SIZES or not math.isclose(relative[0], 1.0):
        raise ValueError(f"not a curve over this version's sizes {SIZES} relative to one token")
    # CostCurve refuses (ValueError) lengths that differ
    return CostCurve(tuple(sizes), tuple(relative), *numbers), "prefill" in data


def _finite(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def cached(model: CausalLM, key: str) -> CostCurve:
    """The model's curve on this machine, measured on first use and cached.

    `key` names the model and backend (weights, dtype); the machine's CPU, thread count and torch version
    are added to it. A `LiveCurve` built on it stores its corrections back (`store`), so a curve measured
    in a busy moment does not stay wrong in the cache. A cached file that cannot be read as a curve (edited
    by hand, a disk error: a write is atomic, `paths.write_atomically`) is moved aside as `*.json.broken`, with a
    warning naming both (`paths.set_aside`), and the curve measured again.
    """
    path = _path(key)
    curve, has_prefill = _stored(path)
    if curve is not None and has_prefill:
        return curve
    # on a cache no sequence holds (a measurement empties it: `holding.measuring`)
    with holding.measuring(model) as measured:
        if curve is not None:  # a curve cached before prefills were timed: its figure now
            curve = dataclasses.replace(curve, prefill=measure_prefill(measured))
        else:
            if not model.quiet:
                console.print(f"Measuring what wider forwards cost this model on this machine (once; kept in {path})",
                              style="dim", highlight=False)
            curve = measure(measured)
    store(key, curve)
    return curve


def _stored(path: Path) -> tuple[CostCurve | None, bool]:
    """The curve cached at `path` (None: none, or none that reads as a curve) and whether its prefill was timed."""
    if path.exists():
        try:
            return _load(path)
        except ValueError as error:
            set_aside(path, "cost curve", str(error), "measuring the curve again")
    return None, False
