"""Where the torch backend runs, and the three things that change with it: which device `auto` picks, how its
work is timed honestly, and what counts as a host synchronisation.

- `resolve(spec)`: "auto" (CUDA where torch sees one, else the CPU), "cpu", "cuda", "cuda:N" or "mps" to a
  `torch.device`, with a one-line UserError for one this machine lacks.
- `stopwatch(device)`: times spans of device work without waiting for the device (`Stopwatch`): on CUDA
  between two events recorded on the device's stream, the span handed over once the device has passed the
  second (a step or two later), so that timing adds no host synchronisation to a step.
- `synchronize(device)`, `clock(device)`: a clock read that waits for the device's queued work first, for
  callers that want a span at once and can afford the wait (a calibration, a benchmark): on CUDA (and MPS)
  kernels run asynchronously, so a clock read without waiting times their launches, not their work.
- `SyncCounter`: counts the calls that make the host wait for a device (`.item()`, `.tolist()`, `.cpu()`,
  `bool()`/`int()`/`float()` of a tensor, `nonzero`, boolean indexing..., and the explicit waits:
  `torch.cuda.synchronize`, a stream's or an event's `synchronize`, `torch.mps.synchronize`,
  `devices.synchronize`) while it is active. On a CPU run they cost nothing, but each one on a GPU stalls the
  launch queue; counting them on the CPU keeps the budget of each step (one transfer per greedy
  verification) enforced without a GPU.
- `name(device)`: what a cache key says of a device (a GPU's name, capability, torch's and CUDA's
  versions; the CPU's ATen capability).
- `settle_attention(device)`: the attention kernels forwards may use there, fixed once at load (on CUDA, every
  one but cuDNN's).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeGuard

import torch
from torch.overrides import TorchFunctionMode

from specdecode.errors import UserError

CHOICES = ("auto", "cpu", "cuda", "cuda:N", "mps")


def resolve(spec: str | torch.device | None = "auto") -> torch.device:
    """A device from its name: "auto" takes CUDA where torch sees one, else the CPU."""
    if isinstance(spec, torch.device):
        return spec
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UserError(f"unknown device {spec!r}; use one of {', '.join(CHOICES)}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {spec}: torch sees no CUDA device here (torch {torch.__version__}, "
                            f"built {'with CUDA ' + torch.version.cuda if torch.version.cuda else 'for the CPU'})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device mps: torch sees no Apple GPU here")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"unknown device {spec!r}; use one of {', '.join(CHOICES)}")
    return device


# cuDNN's fused attention builds an execution graph on the host for every new shape it meets, and decoding
# meets a new key length at every step (one token more in the cache): each token paid one build per layer,
# more than the forward itself (docs/results/gpu.md, "cuDNN attention"). Flash and memory-efficient
# attention take any length as it comes; the math kernel is the last resort (float32 on some cards).
def settle_attention(device: torch.device | str | None) -> None:
    """Fix the attention kernels torch's scaled_dot_product_attention (transformers' "sdpa", our heads' and the
    static path's attention) may use on `device`, once, when a model is loaded there: on CUDA every one but
    cuDNN's; elsewhere nothing changes. torch keeps the choice for the whole process, so it is set and never
    toggled: no forward switches it around itself, whatever thread it runs on."""
    if device is not None and torch.device(device).type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)


def refuse_off_cpu(device: torch.device, what: str, alternative: str) -> None:
    """A one-line UserError where a CPU-only path (int8, int4, llama.cpp as shipped) meets another device."""
    if device.type != "cpu":
        raise UserError(f"{what} runs on the CPU only, not on {device}; {alternative}")


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def clock(device: torch.device | str | None) -> Callable[[], float]:
    """`time.perf_counter`, read after the device's queued work is done: the clock for timing device work."""
    device = None if device is None else torch.device(device)
    if device is None or device.type == "cpu":
        return time.perf_counter

    def read() -> float:
        synchronize(device)
        return time.perf_counter()

    return read


class Event(Protocol):
    """A device event as a stopwatch reads it (`torch.cuda.Event`): passed yet? (without waiting); the
    milliseconds from it to a later one, both passed."""

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...


Mark = float | Event  # a point in the work queued so far: a host clock's reading, or a device event


class Stopwatch:
    """Times spans of work: `mark()` where a span starts and where it ends, `measure(start, end, then)` to have
    `then(seconds)` called with the span between them. This one reads a host clock (`time.perf_counter`, or the
    clock given: a test's fake one, or `clock(device)`, which waits), so `then` is called at once; on a device
    that runs ahead of the host, `EventStopwatch`. `now()` reads the host clock alone: what the host spent, the
    device's work included only where the host waited for it."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.now = clock

    def mark(self) -> Mark:
        return self.now()

    def measure(self, start: Mark, end: Mark, then: Callable[[float], None]) -> None:
        then(end - start)  # type: ignore[operator]

    def settle(self) -> None:
        """Hand over the spans whose work the device has finished (nothing to wait for on the host)."""


class EventStopwatch(Stopwatch):
    """A stopwatch whose marks are events recorded on a device's stream (`record`: a new one, recorded), so
    that a mark never waits for the device. A span is handed over (`then(seconds)`) once the device has passed
    its end, as `settle` finds without waiting (`Event.query`), spans in the order measured: a step's time comes
    a step or two later, when a later step has read the device (it waited for everything queued before)."""

    def __init__(self, record: Callable[[], Event]):
        super().__init__()
        self._record = record
        self._pending: collections.deque[tuple[Event, Event, Callable[[float], None]]] = collections.deque()

    def mark(self) -> Event:
        return self._record()

    def measure(self, start: Mark, end: Mark, then: Callable[[float], None]) -> None:
        assert not isinstance(start, float) and not isinstance(end, float), "marks of another stopwatch"
        self._pending.append((start, end, then))
        self.settle()

    def settle(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end, then = self._pending.popleft()
            then(start.elapsed_time(end) / 1000.0)  # (milliseconds; never read before the device passed both)


def stopwatch(device: torch.device | str | None, fixed: Callable[[], float] | None = None) -> Stopwatch:
    """The stopwatch that times work on `device` without waiting for it: on CUDA, events on the device's
    current stream; on the CPU, `time.perf_counter`; on MPS, `clock(device)`, which waits (its events are not
    used here). `fixed` (a test's fake clock, or `clock(device)` to wait at every mark): a Stopwatch reading it."""
    device = None if device is None else torch.device(device)
    if fixed is None and device is not None and device.type == "cuda":
        def record() -> Event:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event

        return EventStopwatch(record)
    return Stopwatch(fixed or clock(device))


@functools.cache
def name(device: torch.device | str) -> str:
    """Names a device for a cache key: a GPU's model, compute capability and the torch and CUDA versions
    its kernels come from; for the CPU, ATen's capability (AVX2, AVX512...)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return (f"cuda|{torch.cuda.get_device_name(index)}|sm{major}{minor}|torch{torch.__version__}"
                f"|cuda{torch.version.cuda}")
    if device.type == "mps":
        return f"mps|torch{torch.__version__}"
    return f"cpu|{torch.backends.cpu.get_cpu_capability()}"


# Tensor methods and torch functions that copy a device tensor's values to the host (and so wait for it).
# `__getitem__` counts only with a boolean mask (its size depends on the values) or a 0-d integer index.
_SYNCING = {
    "item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
}


class Tracked(torch.Tensor):
    """A CPU tensor that stands for data on a device, for counting synchronisations without one: what a
    tracked model's forward returns (`track`), and, through torch's subclass rules, everything computed
    from it, while data the host made itself stays a plain tensor."""


def track(model) -> None:
    """Make a `CausalLM` on the CPU return `Tracked` logits and hidden states, as a GPU model's would live on
    the GPU, so that a `SyncCounter(cpu)` counts each later read of them on the host. The forward itself
    runs on plain tensors and is not counted (its own synchronisations are the library's, not ours)."""
    forward = model.forward

    def tracked_forward(token_ids, **kwargs):
        plain = {key: value.as_subclass(torch.Tensor) if isinstance(value, torch.Tensor) else value
                 for key, value in kwargs.items()}
        with _paused():
            out = forward(token_ids.as_subclass(torch.Tensor), **plain)
        hidden = None if out.hidden is None else out.hidden.as_subclass(Tracked)
        return dataclasses.replace(out, logits=out.logits.as_subclass(Tracked), hidden=hidden)

    model.forward = tracked_forward


_counting: list[SyncCounter] = []  # the active counters, innermost last


@contextlib.contextmanager
def _paused():
    saved = list(_counting)
    for counter in saved:
        counter.paused += 1
    try:
        yield
    finally:
        for counter in saved:
            counter.paused -= 1


class SyncCounter(TorchFunctionMode):
    """Counts the calls that would make the host wait for a device, while active (a `with` block).

    On a GPU (`device` cuda or mps) the calls on tensors of that device count. On the CPU (`device` cpu or
    None) the calls on `Tracked` tensors count: what a `track`ed model returned and what was computed
    from it, the data that would live on a GPU. `counts` maps each call's name to how many times it ran,
    `total` is their sum. `.to("cpu")` counts as a transfer when its tensor is on a GPU (on the CPU it is
    the model's device too, so host reads there go through `.cpu()`, `.tolist()`...), indexing with a
    boolean mask counts (its result's size depends on the values), and so does indexing with a 0-d integer
    tensor of the device (torch reads it as a Python int). The explicit waits count as "synchronize",
    whatever the device (`devices.synchronize` of the CPU too: on a GPU the same call would wait); they are
    counted by replacing those calls while any counter is active, process-wide."""

    def __init__(self, device: torch.device | str | None = None):
        super().__init__()
        self.device = None if device is None else torch.device(device)
        self.counts: collections.Counter[str] = collections.Counter()
        self.paused = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()

    def __enter__(self):
        if not _counting:
            _count_waits()
        _counting.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _counting.remove(self)
        if not _counting:
            _restore_waits()
        return super().__exit__(*exc)

    def _watched(self, tensor: object) -> TypeGuard[torch.Tensor]:
        if self.paused or not isinstance(tensor, torch.Tensor):
            return False
        if self.device is None or self.device.type == "cpu":
            return isinstance(tensor, Tracked)
        return tensor.device.type == self.device.type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if name in _SYNCING and self._watched(first):
            self.counts[name] += 1
        elif name == "to" and self._watched(first) and first.device.type != "cpu" and _to_cpu(args, kwargs):
            self.counts["to(cpu)"] += 1
        elif name == "__getitem__" and self._watched(first) and _boolean_index(args[1] if len(args) > 1 else None):
            self.counts["boolean index"] += 1
        elif name in ("__getitem__", "__setitem__") and any(map(self._watched, _scalar_indices(args[1:2]))):
            self.counts["scalar index"] += 1
        return func(*args, **kwargs)


# The calls that block the host until a device's queued work is done, counted as "synchronize" while a counter
# is active (`SyncCounter`): they take no tensor, so no torch function mode sees them (nor does torch's sync debug
# mode). An event's or a stream's `wait` makes the device wait, not the host: not counted.
def _explicit_waits() -> list[tuple[Any, str]]:
    owners = [torch.cuda, torch.cuda.Stream, torch.cuda.Event, torch.mps, sys.modules[__name__]]
    return [(owner, "synchronize") for owner in owners + [getattr(torch, "accelerator", None)] if owner is not None]


_originals: list[tuple[Any, str, Any]] = []  # (owner, name, the call before counting) while counters are active
_waiting = 0  # explicit waits under way: one wait calling another (devices.synchronize) counts once


def _counted(original: Callable) -> Callable:
    @functools.wraps(original)
    def wait(*args, **kwargs):
        global _waiting
        if not _waiting:
            for counter in _counting:
                if not counter.paused:
                    counter.counts["synchronize"] += 1
        _waiting += 1
        try:
            return original(*args, **kwargs)
        finally:
            _waiting -= 1

    return wait


def _count_waits() -> None:
    """Replace every explicit wait by one that counts itself (process-wide, until `_restore_waits`)."""
    for owner, attribute in _explicit_waits():
        _originals.append((owner, attribute, vars(owner).get(attribute)))  # None: inherited, not its own
        setattr(owner, attribute, _counted(getattr(owner, attribute)))


def _restore_waits() -> None:
    while _originals:
        owner, attribute, original = _originals.pop()
        if original is None:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, original)


def _to_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def _scalar_indices(index: tuple) -> list:
    """The 0-d integer tensors among an index's parts: torch reads each on the host, as a Python int (on a GPU,
    a wait), where a 1-d index of one element stays on the device."""
    parts = index[0] if index and isinstance(index[0], tuple) else index
    return [part for part in parts if isinstance(part, torch.Tensor) and part.dim() == 0
            and not part.is_floating_point() and part.dtype != torch.bool]


def _boolean_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


def to_device(values: torch.Tensor | list[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values (a list, or a tensor anywhere) on `device`. From the host to a GPU the copy goes through
    pinned memory without blocking, so it never waits for the kernels queued before it."""
    if not isinstance(values, torch.Tensor):
        values = torch.tensor(values, dtype=dtype, device="cpu")
    if values.device == device or values.device.type != "cpu" or device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[Any]:
    """Several small tensors' values on the host in one transfer (each as a nested list of its shape, a 0-d
    tensor as a number):
    float and integer tensors travel together as float64, which holds every token id and float32 exactly."""
    flat = torch.cat([tensor.reshape(-1).to(torch.float64 if tensor.device.type != "mps" else torch.float32)
                      for tensor in tensors])
    values, out, start = flat.tolist(), [], 0
    for tensor in tensors:
        part = values[start : start + tensor.numel()]
        start += tensor.numel()
        if not tensor.is_floating_point():
            part = [int(value) for value in part]
        out.append(_nest(part, tuple(tensor.shape)) if tensor.dim() else part[0])
    return out


def _nest(values: list, shape: tuple[int, ...]) -> list:
    if len(shape) == 1 or not values:
        return values if len(shape) == 1 else [[] for _ in range(shape[0])]
    size = len(values) // shape[0]
    return [_nest(values[i * size : (i + 1) * size], shape[1:]) for i in range(shape[0])]
