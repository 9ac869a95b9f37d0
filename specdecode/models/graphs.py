"""How a static-shape step function runs (`static.StaticDecoder.step`, the EAGLE heads'
`static_heads.StaticFeeds.step`, Medusa's heads' call `medusa.MedusaDrafter._distributions` and its late tree):
eagerly, through `torch.compile`, as CUDA graphs captured by hand, or both ("compile-graphs": inductor's kernels
captured, an option `scripts/gpu-check --inductor` measures).

A runner is called with the step's tensor inputs (host or device; each of a shape fixed for the key) and its
options (hashable values the function takes after the tensors, such as which hidden states to return); it
returns the function's outputs, which the caller may keep.

Why by hand (`torch.cuda.CUDAGraph`) rather than `torch.compile(mode="reduce-overhead")` on a GPU: capturing
the eager forward costs a few forwards' time per shape, so every bucket of a model is ready soon after loading,
at every start; inductor's compilation of a deep model takes far longer per shape, paid again at each start
without a warm compile cache, for kernels that at batch one mostly read weights as the eager ones do. What a
graph removes is the launching, and that is what the eager forward pays for on a GPU. `torch.compile` stays
here for what it proves on any machine: with `fullgraph=True, dynamic=False` a step traces without a graph
break and, once each shape has run, a whole generation never recompiles (tests/exact/test_static_compile.py),
which is what a graph needs too: no host read, no shape that depends on values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdecode.devices import to_device

RUNNERS = ("eager", "compile", "graphs", "compile-graphs")


class Runner:
    """Runs a step function as it is written (the base: the CPU, and the reference for the others)."""

    def __init__(self, fn: Callable, device: torch.device):
        self.fn, self.device = fn, device

    def __call__(self, inputs: Sequence[torch.Tensor], options: tuple = ()) -> Any:
        return self.fn(*[to_device(x, self.device, x.dtype) for x in inputs], *options)

    def reset(self) -> None:
        """What the function reads was reallocated: forget anything bound to the old storage."""


class Compiled(Runner):
    """`torch.compile(fullgraph=True, dynamic=False)` of the step: one graph per shape and options."""

    def __init__(self, fn: Callable, device: torch.device, backend: str = "inductor"):
        super().__init__(fn, device)
        self.backend = backend
        self.reset()

    def reset(self) -> None:
        import torch._dynamo

        # one graph per bucket and option is expected; past dynamo's default limit it would run eagerly
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.compiled = torch.compile(self.fn, fullgraph=True, dynamic=False, backend=self.backend)

    def __call__(self, inputs, options=()):
        return self.compiled(*[to_device(x, self.device, x.dtype) for x in inputs], *options)


@dataclass
class Captured:
    """One shape's step as a CUDA graph, with the static buffers it reads and the outputs it writes."""

    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: Any


class Graphs(Runner):
    """Each shape and options captured once as a CUDA graph, on first use (with that call's inputs: a step
    run again on the same inputs writes the same values, so the warm-up runs and the replay that follows agree)
    and replayed: the inputs are copied into the graph's buffers without waiting, one replay launches the whole
    step, and the outputs are copied out so that the next replay cannot overwrite them."""

    def __init__(self, fn: Callable, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        super().__init__(fn, device)
        self.reset()

    def reset(self) -> None:
        self.captured: dict[tuple, Captured] = {}
        self.pool: Any = None  # one memory pool for every graph: they never run at the same time

    def __call__(self, inputs, options=()):
        key = (tuple((tuple(x.shape), x.dtype) for x in inputs), options)
        captured = self.captured.get(key)
        if captured is None:
            captured = self._capture(key, inputs, options)
        for buffer, x in zip(captured.inputs, inputs):
            buffer.copy_(x.pin_memory() if x.device.type == "cpu" else x, non_blocking=True)
        captured.graph.replay()
        return _copied(captured.outputs)

    def _capture(self, key: tuple, inputs: Sequence[torch.Tensor], options: tuple) -> Captured:
        buffers = [to_device(x, self.device, x.dtype).clone() for x in inputs]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # lazy initialisations, before capture
            for _ in range(2):
                self.fn(*buffers, *options)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work meanwhile (the server's builders) neither breaks the capture nor
        # is captured
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self.fn(*buffers, *options)
        self.pool = graph.pool()
        captured = self.captured[key] = Captured(graph, buffers, outputs)
        return captured


class CompiledGraphs(Graphs):
    """inductor's kernels for the step (`Compiled`), each shape's then captured as a CUDA graph: fewer, fused kernels
    a step than the eager step's graph has, at the price of inductor's compilation for every shape (long for a deep
    model, and paid again at each start without a warm compile cache). An option to measure (`scripts/gpu-check
    --inductor`), not the default: see the module docstring."""

    def __init__(self, fn: Callable, device: torch.device, backend: str = "inductor"):
        self.compiled_step = Compiled(fn, device, backend)
        super().__init__(self.compiled_step.compiled, device)


def _copied(outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_copied(x) for x in outputs)
    return outputs


def make_runner(name: str, fn: Callable, device: torch.device, backend: str = "inductor") -> Runner:
    """The runner called `name` (`RUNNERS`) for step function `fn` on `device`."""
    if name == "eager":
        return Runner(fn, device)
    if name == "compile":
        return Compiled(fn, device, backend)
    if name == "graphs":
        return Graphs(fn, device)
    if name == "compile-graphs":
        return CompiledGraphs(fn, device, backend)
    raise ValueError(f"unknown runner {name!r}; choose one of {', '.join(RUNNERS)}")
