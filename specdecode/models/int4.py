"""Batch-invariant 4-bit linear layers: the fastest target path on x86 CPUs (AVX2 and later).

The int8 path (`models/int8.py`) is exact and its width is cheap, but a 1.5B model's int8 weights are
1.5 GB and plain decoding reads them all for every token: memory bandwidth alone keeps it slower than
llama.cpp's 4-bit decoding. No kernel torch ships does 4-bit weights both fast and batch-invariantly (its
int4 weight-only product is compute-bound, slower than int8 at every width measured), so this one is
written by hand (`kernels/int4.cpp`, compiled on first use by torch's extension builder):

- weights: per output channel one float scale, per block of 32 inputs a 4-bit integer multiplier
  (1..15) and per weight a 4-bit value: w = scale * group * (nibble - 8), i.e. 4.125 bits a weight.
  group * (nibble - 8) is an int8, so one byte shuffle per block unpacks it (a 16-entry table per group);
- activations: each row on its own onto 7 bits (x = low + step * u, the per-token asymmetric
  quantization the int8 path uses);
- the product sums int8 x uint8 pairs exactly in int32 and rescales each output element on its own, so a
  row's result is bitwise the same whatever other rows the call carries (integer sums do not depend on
  their order), and rows of one call share each unpacked weight block: width costs compute, not bytes.
  One row takes the channels one at a time; several rows go in tiles of up to 8, each met by a group of
  2 or 4 channels whose products accumulate in registers, so each unpacked block and each loaded row
  serves a whole tile or group;
  with many rows (a prompt's prefill), AVX-512 VNNI first unpacks a few channels' weights into int8
  panels that every tile then reads, rather than unpacking them again for each tile;
- the products run on the best of three variants the CPU has (`KERNELS`, chosen at run time; per model,
  `use_kernel` runs another, as tests and measurements that compare them do): AVX2's
  u8 x s8 pair products take three instructions per 32 products and row, AVX-VNNI's dot-product
  instruction one, AVX-512 VNNI's one per 64. Exact integer sums make their outputs bitwise the same.

Attention stays the int8 path's `invariant_attention` (its kernel, `kernels/attention.cpp`, is compiled
the same way, by `compile_kernel`). Layers whose input size is not a multiple of 32 keep the int8 linear.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from specdecode.errors import UserError

BLOCK = 32
KERNEL_SOURCES = Path(__file__).parent / "kernels"  # the C++ kernels of the quantized paths (this one, attention)
_SOURCE = KERNEL_SOURCES / "int4.cpp"
# the kernel's variants, by the op's number for them: the same exact output from different instructions
# (AVX2: three instructions per 32 products and row; AVX-VNNI: one per 32; AVX-512 VNNI: one per 64)
KERNELS = ("avx2", "avx-vnni", "avx512-vnni")
ROW_SLICE_BYTES = 1 << 19  # the quantized rows one kernel call takes at most: about half an L2 cache
# rows from which the AVX-512 VNNI variant unpacks weights into panels once rather than once per tile of rows
# (fewer rows: the panels' stores and loads cost more than the repeated unpacking saves)
PANEL_ROWS = 48


def available() -> bool:
    """Whether this machine can run the kernel: an x86 CPU with AVX2 and a C++ compiler."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and _compiler() is not None


def usable() -> bool:
    """Whether the kernel runs here: `available`, and it compiles (a broken compiler or a build folder that cannot be
    written leaves int8 and the float paths, which `--dtype auto` and a drafter's `auto` then choose from)."""
    if not available():
        return False
    try:
        _ops()
    except UserError:
        return False
    return True


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


@functools.cache
def _inlining_flags() -> list[str]:
    """GCC stops inlining once a file has grown by its unit budget, and the 4-bit kernel's many template
    instances reach it: its `reduce` would then stay a call, and the accumulators it reads would live on the
    stack rather than in registers inside the products' loops. A larger budget keeps every instance inlined
    (Clang has no such budget and no such flag)."""
    compiler = _compiler()
    if compiler is None:
        return []
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [] if "clang" in version.lower() else ["--param=inline-unit-growth=400"]


COMPILE_ERRORS = (RuntimeError, OSError, subprocess.CalledProcessError)  # what a failed `compile_kernel` raises


def compile_kernel(name: str, source: Path, what: str):
    """Compiles the C++ torch extension `source` as `name` (AVX2 and FMA; once per machine and torch
    version, torch keeps the build in its extensions folder) and returns its operator namespace. Raises
    one of COMPILE_ERRORS when it cannot."""
    from torch.utils import cpp_extension

    from specdecode.paths import console

    venv_bin = Path(sys.executable).parent  # the `ninja` dependency's binary, where PATH lacks the venv
    if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    build = Path(cpp_extension._get_build_directory(name, False))  # honours TORCH_EXTENSIONS_DIR
    if not (build / f"{name}.so").exists():
        console.print(f"[dim]compiling {what} for this machine (once, about half a minute)...[/dim]")
    cpp_extension.load(
        name=name, sources=[str(source)], is_python_module=False, verbose=False,
        # OpenMP for at::parallel_for (the soname resolves to the libgomp torch has loaded: one thread pool)
        extra_cflags=["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", *_inlining_flags()],
        extra_ldflags=["-fopenmp"],
    )
    return getattr(torch.ops, name)


@functools.cache
def _ops():
    """Compiles the kernel (`compile_kernel`) and returns its operator namespace."""
    try:
        return compile_kernel("specdecode_int4", _SOURCE, "the 4-bit kernel")
    except COMPILE_ERRORS as error:
        raise UserError(f"could not compile the int4 kernel ({str(error).strip().splitlines()[-1]}); "
                        "use --dtype int8, which needs no compiler") from error


def kernels() -> list[str]:
    """The kernel variants this machine runs, slowest first (the last is the one used). An AVX-512
    variant only where ATen runs its AVX-512 code too: `ATEN_CPU_CAPABILITY=avx2` makes a CPU with
    AVX-512 run as an AVX2 one for PyTorch's kernels and ours alike (how AVX2 figures are approximated there)."""
    capped = torch.backends.cpu.get_cpu_capability() != "AVX512"
    return [name for number, name in enumerate(KERNELS)
            if _ops().supported(number) and not (capped and name.startswith("avx512"))]


@functools.cache
def _best() -> int:
    """The number of the variant a layer runs unless its model says otherwise (`use_kernel`)."""
    return KERNELS.index(kernels()[-1])


@dataclasses.dataclass
class KernelChoice:
    """The kernel variant one layer runs (its number in `KERNELS`); None: the best this machine runs. Each layer
    holds its own, which a stacked layer shares with the first layer it stacks (`InvariantInt4Linear.stacked`),
    so that a model's setting (`use_kernel`) reaches it; no setting is process-wide."""

    number: int | None = None


def _layers(model: nn.Module) -> list[InvariantInt4Linear]:
    return [module for module in model.modules() if isinstance(module, InvariantInt4Linear)]


def use_kernel(model: nn.Module, name: str | None) -> None:
    """Run the int4 layers of `model` (a layer, or any module holding some) on variant `name`; None: the best this
    machine runs. Other models keep theirs (tests and measurements compare variants)."""
    if name is not None and name not in kernels():
        raise UserError(f"this CPU cannot run the int4 kernel {name!r}; it runs {', '.join(kernels())}")
    for layer in _layers(model):
        layer.kernel.number = None if name is None else KERNELS.index(name)


def kernel_name(model: nn.Module) -> str:
    """The variant the int4 layers of `model` run (its first one's; `use_kernel` sets them all)."""
    layers = _layers(model)
    number = layers[0].kernel.number if layers else None
    return kernels()[-1] if number is None else KERNELS[number]


@contextlib.contextmanager
def forced_kernel(model: nn.Module, name: str):
    """Run the int4 layers of `model` on variant `name` inside the block, each back to its own after it."""
    layers = _layers(model)
    previous = [layer.kernel.number for layer in layers]
    use_kernel(model, name)
    try:
        yield
    finally:
        for layer, number in zip(layers, previous):
            layer.kernel.number = number


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [out, in] -> (nibbles uint8 [out, padded / 2], groups uint8 [out, padded / 32], scales float32
    [out]), padded = in rounded up to a multiple of 64 (the kernel takes blocks in pairs).

    Each block's ideal step is its largest magnitude over 8 (or 7 when that value is positive, which
    maps onto +7); the channel's scale is the largest ideal step over 15, and each block's multiplier is
    the integer 1..15 (of the rounded one and its neighbours) that reconstructs the block best. Computed
    1024 channels at a time (faster than all at once, docs/results/code-choices.md: the temporaries stay in cache)."""
    parts = [_quantize_rows(rows) for rows in weight.detach().split(1024)]
    nibbles, groups, scales = (torch.cat(part) for part in zip(*parts))
    return nibbles, groups, scales


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_features, in_features = weight.shape
    blocks = weight.float().reshape(out_features, in_features // BLOCK, BLOCK)  # [o, b, 32]
    extreme = blocks.gather(2, blocks.abs().argmax(dim=2, keepdim=True)).squeeze(2)  # [o, b], signed
    ideal = torch.where(extreme > 0, extreme / 7, -extreme / 8)  # [o, b]
    scales = (ideal.amax(dim=1) / 15).clamp_min(1e-12)  # [o]
    rounded = (ideal / scales[:, None]).round()

    def error_of(group: torch.Tensor) -> torch.Tensor:  # [o, b] multipliers -> [o, b] squared error
        step = (scales[:, None] * group)[..., None]  # [o, b, 1]
        return (blocks - (blocks / step).round().clamp(-8, 7) * step).square().sum(dim=2)

    best_group = (rounded - 1).clamp(1, 15)  # [o, b]
    best_error = error_of(best_group)
    for shift in (0, 1):  # a later multiplier wins only if strictly better
        group = (rounded + shift).clamp(1, 15)
        error = error_of(group)
        better = error < best_error
        best_error, best_group = torch.where(better, error, best_error), torch.where(better, group, best_group)
    step = (scales[:, None] * best_group)[..., None]
    values = ((blocks / step).round().clamp(-8, 7) + 8).to(torch.uint8)  # [o, b, 32], 0..15
    groups = best_group.to(torch.uint8)
    if values.shape[1] % 2:  # the kernel takes blocks in pairs: a zero block (nibbles 8) completes the last
        values = torch.cat([values, torch.full_like(values[:, :1], 8)], dim=1)
        groups = torch.cat([groups, torch.ones_like(groups[:, :1])], dim=1)
    pairs = values.reshape(out_features, -1, 2, BLOCK)  # [o, b / 2, 2, 32]
    nibbles = pairs[:, :, 0] | (pairs[:, :, 1] << 4)  # [o, b / 2, 32]
    return nibbles.reshape(out_features, -1), groups, scales


def dequantize(nibbles: torch.Tensor, groups: torch.Tensor, scales: torch.Tensor, in_features: int = 0) -> torch.Tensor:
    """The float [out, in] weights the kernel multiplies by."""
    out_features = nibbles.shape[0]
    packed = nibbles.reshape(out_features, -1, 1, BLOCK)
    values = torch.cat([packed & 0x0F, packed >> 4], dim=2).reshape(out_features, -1, BLOCK).float() - 8
    weight = values * groups[..., None].float() * scales[:, None, None]  # [o, b, 32]
    return weight.reshape(out_features, -1)[:, :in_features] if in_features else weight.reshape(out_features, -1)


class InvariantInt4Linear(nn.Module):
    """y = x W^T + b with 4-bit weights and per-row 7-bit activations; each output row depends on its
    input row alone (bitwise), whatever else the batch holds."""

    # buffers (register_buffer), declared for the type checker
    nibbles: torch.Tensor
    groups: torch.Tensor
    scales: torch.Tensor
    weight_sums: torch.Tensor
    bias: torch.Tensor | None
    kernel: KernelChoice  # the variant it runs (`use_kernel` sets a model's)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % BLOCK:
            raise ValueError(f"a 4-bit linear layer needs in_features divisible by {BLOCK}, not {self.in_features}")
        nibbles, groups, scales = quantize_weight(weight)
        self.register_buffer("nibbles", nibbles, persistent=False)
        self.register_buffer("groups", groups, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        integer = (dequantize(nibbles, groups, torch.ones_like(scales))).sum(dim=1)  # sum of the int8 weights
        self.register_buffer("weight_sums", integer, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)
        self.kernel = KernelChoice()
        _ops()

    @staticmethod
    def from_linear(linear: nn.Linear) -> InvariantInt4Linear:
        return InvariantInt4Linear(linear.weight, linear.bias)

    _STATE = ("nibbles", "groups", "scales", "weight_sums", "bias")

    def state(self) -> dict[str, torch.Tensor]:
        """Plain tensors `from_state` rebuilds this layer from, bit for bit (the prepared-weights cache,
        `models.prepared`): its buffers (the bias only if it has one)."""
        return {name: getattr(self, name) for name in self._STATE if getattr(self, name) is not None}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], in_features: int) -> InvariantInt4Linear:
        """The layer `state()` described, taking `in_features` inputs (the nibbles are padded past them),
        without quantizing anything again."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = state["nibbles"].shape[0], in_features
        if state["nibbles"].shape[1] * 2 < in_features:
            raise ValueError(f"4-bit weights of {state['nibbles'].shape[1] * 2} inputs for a layer of {in_features}")
        for name in cls._STATE:
            layer.register_buffer(name, state.get(name), persistent=False)
        layer.kernel = KernelChoice()
        _ops()
        return layer

    @classmethod
    def stacked(cls, layers: list[InvariantInt4Linear]) -> InvariantInt4Linear:
        """One layer computing `layers`' outputs side by side (their rows stacked; same inputs, all with a bias
        or none), whose buffers the given layers then view: one kernel call instead of several, no weights held
        twice. Each output channel is computed alone (its own weights and scale, the input's quantization
        shared), so the stacked product is the separate ones, bit for bit."""
        whole = cls.__new__(cls)
        nn.Module.__init__(whole)
        whole.in_features, whole.out_features = layers[0].in_features, sum(layer.out_features for layer in layers)
        whole.kernel = layers[0].kernel  # (shared: the model's setting reaches the stacked layer too)
        for name in ("nibbles", "groups", "scales", "weight_sums", "bias"):
            parts = [getattr(layer, name) for layer in layers]
            buffer = None if parts[0] is None else torch.cat(parts)
            whole.register_buffer(name, buffer, persistent=False)
            start = 0
            for layer in layers:  # each layer's buffer becomes a view of its rows of the stacked one
                if buffer is not None:
                    setattr(layer, name, buffer[start : start + layer.out_features])
                start += layer.out_features
        return whole

    @property
    def weight_bytes(self) -> int:
        return self.nibbles.numel() + self.groups.numel() + 4 * self.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The 4-bit weights dequantized, [out, in] float32 (for heads that read the target's LM head)."""
        return dequantize(self.nibbles, self.groups, self.scales, self.in_features)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """`weight[ids]` ([k] output channels -> [k, in] float32), dequantizing those rows alone: a head's draft
        vocabulary reads a fifth of a 151,936-row LM head, which dequantized whole takes seconds."""
        ids = ids.to(self.nibbles.device)
        return dequantize(self.nibbles[ids], self.groups[ids], self.scales[ids], self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.rows(x.reshape(-1, self.in_features).float()).reshape(*x.shape[:-1], self.out_features)

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The product for float32 rows [m, in] -> [m, out]: `forward` without its reshapes, one kernel call
        for decoding's few rows (`models.lean` calls it directly: a module call costs several microseconds,
        197 times a token)."""
        # The kernel meets every row with each group of channels, so a long prefill's rows would stream from
        # memory once per group: they go in slices of rows that stay in cache (each row's result is its own,
        # so slicing changes no bit of it), of equal size and at least `step` (up to twice it): no short last
        # slice falls below PANEL_ROWS.
        step = max(8, ROW_SLICE_BYTES // self.in_features // 8 * 8)
        m, number = rows.shape[0], self.kernel.number
        slices = max(1, m // step)
        parts = [_ops().linear(rows[i * m // slices : (i + 1) * m // slices], self.nibbles, self.groups, self.scales,
                               self.weight_sums, self.bias, _best() if number is None else number, PANEL_ROWS)
                 for i in range(slices)]
        return parts[0] if slices == 1 else torch.cat(parts)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
