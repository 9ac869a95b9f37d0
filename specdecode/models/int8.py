"""Batch-invariant int8 linear layers: the fast target path on CPUs without bf16 units.

Speculative decoding is exact only if the target scores a token the same whether its forward carries one
token or a whole draft. fbgemm's dynamic int8 matrix product (`torch.ops.quantized.linear_dynamic`, what
`torch.ao.quantization.quantize_dynamic` runs) is the fastest CPU kernel torch ships for small batches
(for 1 row and for 8 on AVX2 cores, against emulated bf16: docs/results/code-choices.md), but it
quantizes its input with one scale and zero point for the whole tensor, chosen from the tensor's minimum
and maximum: a row's result then depends on the other rows of the batch.

`InvariantInt8Linear` gets one scale per row out of that kernel:

1. each row x is mapped affinely onto [-1, 1]: x' = (x - low) / half - 1, with low and half the minimum
   and half-width of the row's own range (the per-token asymmetric quantization of SmoothQuant and
   LLM.int8()), computed so that the row's minimum becomes exactly -1 and its maximum exactly +1;
2. so every row, and the tensor, spans exactly [-1, 1], and the scale and zero point the kernel picks
   from the tensor's minimum and maximum are the same for every batch (a constant row, which spans
   nothing, travels with a guard row holding both ends);
3. the kernel multiplies with exact int32 accumulation, and each output element is rescaled on its own:
   y = W x = half W x' + (low + half) W 1, so row i of the output is a function of row i of the input
   only, bitwise.

Weights are int8 with one scale per output channel (symmetric). Activations get 7 bits (fbgemm's
`reduce_range`, which keeps its 8-bit x 8-bit products from saturating 16-bit sums on AVX2).

Quantized activations amplify any other difference: a float32 attention that rounds one part in 10^7
differently in a wide forward moves an activation across a rounding boundary now and then, and the
logits by a hundredth. So attention is made batch-invariant too (`invariant_attention`): each query row
is computed over exactly the keys it sees, in cache order, by arithmetic that depends on that row alone.
On x86 with AVX2 a compiled kernel does it (`kernels/attention.cpp`: the row's keys in fixed blocks of 64
by their order among the keys it sees, an online softmax, each row and head on one thread; rows of one
forward share each block of the cache as it is read); elsewhere each row is one attention call, the same
call one-token decoding makes for that token.
"""

from __future__ import annotations

import functools
import threading
import warnings
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdecode.errors import UserError

ATTENTION = "specdecode_invariant"  # the attention implementation's name in transformers' registry
_ATTENTION_SOURCE = Path(__file__).parent / "kernels" / "attention.cpp"



def _quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """float [out, in] -> qint8 [out, in], one symmetric scale per output channel."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()  # [out]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        return torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)


def _guard(in_features: int) -> torch.Tensor:
    """The row [1, in] of alternating +1 and -1 that spans [-1, 1] beside a constant row."""
    guard = torch.ones(1, in_features)
    guard[0, 1::2] = -1.0
    return guard


M = TypeVar("M", bound=nn.Module)  # a module quantized in place, returned as it came


class InvariantInt8Linear(nn.Module):
    """y = x W^T + b with int8 weights and per-row int8 activations; each output row depends on its input
    row alone (bitwise), whatever else the batch holds."""

    # buffers (register_buffer), declared for the type checker
    weight_sums: torch.Tensor
    bias: torch.Tensor | None
    guard: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        qweight = _quantize_weight(weight)  # [out, in]
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        # W 1 of the int8 weights as the kernel sees them: the term the row centres bring back
        self.register_buffer("weight_sums", qweight.dequantize().sum(dim=1), persistent=False)  # [out]
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)
        if self.in_features == 1:  # one column cannot hold both ends of the range
            raise ValueError("an int8 linear layer needs at least two input features")
        self.register_buffer("guard", _guard(self.in_features), persistent=False)

    @staticmethod
    def from_linear(linear: nn.Linear) -> InvariantInt8Linear:
        return InvariantInt8Linear(linear.weight, linear.bias)

    def state(self) -> dict[str, torch.Tensor]:
        """Plain tensors `from_state` rebuilds this layer from, bit for bit (the prepared-weights cache,
        `models.prepared`): the int8 weights [out, in], their per-channel scales [out] as the kernel holds
        them, W 1 [out] and the bias [out] if any."""
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        state = {"weight_int8": qweight.int_repr(), "weight_scales": qweight.q_per_channel_scales(),
                 "weight_sums": self.weight_sums}
        return state if self.bias is None else state | {"bias": self.bias}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> InvariantInt8Linear:
        """The layer `state()` described, without quantizing anything again."""
        scales = state["weight_scales"]
        with warnings.catch_warnings():  # (torch 2.13 marks its quantized tensors deprecated, as `_quantize_weight`)
            warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
            qweight = torch._make_per_channel_quantized_tensor(
                state["weight_int8"], scales, torch.zeros_like(scales, dtype=torch.long), 0)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = qweight.shape
        layer._packed = torch.ops.quantized.linear_prepack(qweight, None)
        layer.register_buffer("weight_sums", state["weight_sums"], persistent=False)
        layer.register_buffer("bias", state.get("bias"), persistent=False)
        layer.register_buffer("guard", _guard(layer.in_features), persistent=False)
        return layer

    @property
    def weight_bytes(self) -> int:
        return self.in_features * self.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weights dequantized, [out, in] float32 (for heads that read the target's LM head)."""
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.dequantize()

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """`weight[ids]` ([k] output channels -> [k, in] float32), dequantizing those rows alone: a head's draft
        vocabulary is a fifth of a 151,936-row LM head, whose float32 copy whole would take four times its int8
        bytes for a moment."""
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        ids = ids.to(torch.long)
        scales = qweight.q_per_channel_scales()[ids].to(torch.float32)  # (zero points are 0: symmetric)
        return qweight.int_repr()[ids].to(torch.float32) * scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.rows(x.reshape(-1, self.in_features).float()).reshape(*x.shape[:-1], self.out_features)

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The product for float32 rows [m, in] -> [m, out] (`forward` without its reshapes)."""
        low, high = torch.aminmax(rows, dim=1, keepdim=True)  # [m, 1] each
        half = (high - low).mul_(0.5)  # [m, 1], exact: halving a float is
        if not bool(half.all()):  # a constant row spans nothing: it becomes -1s, and a guard row holds +1
            return self._with_guard(rows, low, half)
        # each row onto [-1, 1] with its minimum exactly -1 and its maximum exactly +1 (x - low for x = high
        # is the very float high - low, twice half): every row spans the same range, so the scale and zero
        # point fbgemm picks for the tensor are those of each row alone
        scaled = (rows - low).div_(half).sub_(1.0)  # [m, in]
        out = torch.ops.quantized.linear_dynamic(scaled, self._packed, True)  # [m, out]
        return self._restore(out, low, half)

    def _restore(self, out: torch.Tensor, low: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
        """W x from W x', x = (low + half) + half x': one scale and one offset per row."""
        out = out.mul_(half).addcmul_(low + half, self.weight_sums)  # [m, out]
        return out if self.bias is None else out.add_(self.bias)

    def _with_guard(self, rows: torch.Tensor, low: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
        half = torch.where(half > 0, half, torch.ones_like(half))
        scaled = torch.cat([self.guard, (rows - low).div_(half).sub_(1.0)])  # [1 + m, in]
        out = torch.ops.quantized.linear_dynamic(scaled, self._packed, True)[1:]  # [m, out]
        return self._restore(out, low, half)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_invariant(model: PreTrainedModel, bits: int = 8, progress: bool = False) -> PreTrainedModel:
    """Every nn.Linear of `model` (the LM head included) replaced, in place, by an InvariantInt8Linear
    (bits=8) or an `int4.InvariantInt4Linear` (bits=4; layers whose input size the 4-bit kernel cannot
    take stay int8) computing in float32, the other parameters (embeddings, norms) in float32, and
    attention computed row by row (`invariant_attention`). A gated MLP's two input projections become one
    layer first (`fuse_gate_up`). progress=True: a bar over the layers (a large model takes a while). A model with
    projections of another kind (GPT-2's Conv1D) is refused: they would stay float, batch-dependent."""
    from transformers.pytorch_utils import Conv1D

    if any(isinstance(module, Conv1D) for module in model.modules()):
        raise UserError(f"int{bits} replaces nn.Linear layers, and this model's projections are Conv1D layers "
                        "(GPT-2's), which would stay float and batch-dependent: use --dtype float32 or bfloat16")
    # attention the row-by-row kernels do not compute: Gemma-2's capped scores, attention sinks
    capped = ["attn_logit_softcapping"] if getattr(model.config, "attn_logit_softcapping", None) else []
    if capped or any(hasattr(module, "sinks") for module in model.modules()):
        raise UserError(f"int{bits} computes attention row by row without this model's "
                        f"{', '.join(capped) or 'attention sinks'}: use --dtype float32 or bfloat16")
    for name, tensor in model.state_dict().items():  # one NaN row's range would spoil a product's shared scale
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise UserError(f"the checkpoint's {name} holds NaN or infinite values: it is damaged")
    fuse_gate_up(model)
    quantize_linears(model, bits, progress)
    model.float()
    model.set_attn_implementation(ATTENTION)
    return model


def quantize_linears(module: M, bits: int = 8, progress: bool = False) -> M:
    """Every nn.Linear within `module` replaced, in place, by an InvariantInt8Linear (bits=8) or an
    `int4.InvariantInt4Linear` (bits=4; a layer whose input size the 4-bit kernel cannot take stays int8)."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from specdecode.models import int4
    from specdecode.paths import console
    from specdecode.progress import Progress

    # names only: each float layer is let go as soon as it is replaced (one float32 copy of a weight at a time)
    places = [(parent, name) for parent in module.modules()
              for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, disable=not progress)
    with bar:
        task = bar.add_task(f"Quantizing to int{bits}", total=len(places))
        for parent, name in places:
            child = getattr(parent, name)
            four = bits == 4 and child.in_features % int4.BLOCK == 0
            setattr(parent, name, (int4.InvariantInt4Linear if four else InvariantInt8Linear).from_linear(child))
            bar.advance(task)
    return module


# the MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)), the one `fuse_gate_up` rewrites
GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


def fuse_gate_up(model: nn.Module) -> nn.Module:
    """Each gated MLP of a known kind (GATED_MLPS) computes its gate and up projections as one linear layer,
    `gate_up_proj` (their weights stacked), in place. Quantization is per output channel, so the quantized
    layer holds exactly the two layers' quantized weights, and the outputs are the same, bit for bit; one
    product over both costs less than two (on the 4-bit kernel: docs/results/code-choices.md)."""
    for module in list(model.modules()):  # the list first: the loop replaces modules' children
        gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
        if (type(module).__name__ not in GATED_MLPS or not isinstance(gate, nn.Linear) or not isinstance(up, nn.Linear)
                or gate.out_features != up.out_features):  # the fused output is cut in two halves
            continue
        fused = nn.Linear(gate.in_features, gate.out_features + up.out_features, bias=gate.bias is not None,
                          dtype=gate.weight.dtype, device=gate.weight.device)
        fused.weight = nn.Parameter(torch.cat([gate.weight, up.weight]), requires_grad=False)
        if gate.bias is not None:
            fused.bias = nn.Parameter(torch.cat([gate.bias, up.bias]), requires_grad=False)
        module.gate_up_proj = fused
        del module.gate_proj, module.up_proj
        module.forward = _fused_mlp_forward.__get__(module)
    return model


def _fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _visible(attention_mask: torch.Tensor | None, n: int, length: int) -> list[torch.Tensor | int]:
    """For each of n query rows, the keys it sees among `length`: a count when they are the first ones
    (a slice, as one-token decoding sees its cache), else their indices. attention_mask: [1, 1, n, length],
    additive (0 where allowed) or bool (True where allowed), or None: causal, the queries last."""
    if attention_mask is None:
        return [length - n + i + 1 for i in range(n)]
    allowed = attention_mask[0, 0] if attention_mask.dtype == torch.bool else attention_mask[0, 0] == 0  # [n, length]
    counts = allowed.sum(dim=1)  # [n]
    prefix = allowed[:, 0] & (allowed.cumsum(dim=1)[torch.arange(n), (counts - 1).clamp_min(0)] == counts)
    return [int(c) if p else allowed[i].nonzero().flatten()
            for i, (c, p) in enumerate(zip(counts.tolist(), prefix.tolist()))]


def _csr(rows: list[torch.Tensor | int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_visible`'s rows as the attention kernel takes them: per row a prefix count p (keys 0..p-1) and its
    other keys, sorted, all >= p: (prefix [n], offsets [n + 1], indices [offsets[n]]), int64."""
    prefix, extras = [], []
    for seen in rows:
        if isinstance(seen, int):
            prefix.append(seen)
            extras.append(torch.empty(0, dtype=torch.long))
        else:  # the longest run 0, 1, 2, ... that the indices start with is the prefix
            starts = (seen == torch.arange(len(seen), device=seen.device)).cumprod(dim=0).sum()
            prefix.append(int(starts))
            extras.append(seen[int(starts):].long().cpu())
    offsets = torch.tensor([0] + [len(e) for e in extras]).cumsum(dim=0)
    return torch.tensor(prefix), offsets, torch.cat(extras)


@functools.cache
def _kernel():
    """The compiled attention kernel's operator namespace (`kernels/attention.cpp`), or None where it cannot
    be built (not x86 with AVX2, no compiler): attention then runs `_attention_by_rows`."""
    from specdecode.models import int4

    if not int4.available():
        return None
    try:
        return int4.compile_kernel("specdecode_attention", _ATTENTION_SOURCE, "the attention kernel")
    except int4.COMPILE_ERRORS:
        return None


# .key, .rows, .csr: the last mask seen (or causal shape) and its rows' visible keys (every layer shares one)
_PLAN = threading.local()


def invariant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query [1, heads, n, d], key and value [1, kv_heads, length, d]
    (cache and new tokens), mask [1, 1, n, length] or None (causal). Returns ([1, n, heads, d], None).

    Each row over exactly the keys it sees, by a computation that depends on that row alone, so a row's
    output does not depend on how many rows the forward carries (a wide attention call blocks and sums
    differently from a one-row call): the compiled kernel where it builds (`kernels/attention.cpp`: each
    row's keys in fixed blocks by their order among the keys it sees, an online softmax, one thread per row
    and head), else one attention call per row (`_attention_by_rows`)."""
    _, heads, n, d = query.shape
    length = key.shape[2]
    key_of_plan = (n, length) if attention_mask is None else attention_mask  # a causal plan depends on these alone
    planned = getattr(_PLAN, "key", None)
    if not (planned is key_of_plan or isinstance(planned, tuple) and planned == key_of_plan):
        _PLAN.key, _PLAN.rows, _PLAN.csr = key_of_plan, _visible(attention_mask, n, length), None
    kernel = _kernel() if query.dtype == torch.float32 and d % 8 == 0 and query.device.type == "cpu" else None
    if kernel is None:
        return _attention_by_rows(query, key, value, _PLAN.rows, scaling), None
    if _PLAN.csr is None:
        _PLAN.csr = _csr(_PLAN.rows)
    scale = scaling if scaling is not None else d ** -0.5
    out = kernel.attention(query[0], key[0], value[0], scale, *_PLAN.csr)  # [heads, n, d]
    return out.transpose(0, 1)[None], None


def _attention_by_rows(query, key, value, rows: list[torch.Tensor | int], scaling) -> torch.Tensor:
    """One attention call per query row over exactly the keys it sees (`_visible`'s rows), the same call
    one-token decoding makes for that token. query [1, heads, n, d], key and value [1, kv_heads, length, d];
    returns [1, n, heads, d]."""
    _, heads, n, d = query.shape
    kv_heads = key.shape[1]
    out_rows = []
    for i, seen in enumerate(rows):
        keys, values = (key[:, :, :seen], value[:, :, :seen]) if isinstance(seen, int) else (
            key[:, :, seen], value[:, :, seen])
        # the query heads that share a key head are that head's query rows (head h reads key head
        # h // group): one call, no copy of the keys per query head as enable_gqa makes (slower per
        # row at long contexts: docs/results/code-choices.md)
        grouped = query[:, :, i].reshape(1, kv_heads, heads // kv_heads, d)
        out_rows.append(F.scaled_dot_product_attention(grouped, keys, values, scale=scaling).reshape(1, heads, 1, d))
    out = out_rows[0] if n == 1 else torch.cat(out_rows, dim=2)  # [1, heads, n, d]
    return out.transpose(1, 2)


AttentionInterface.register(ATTENTION, invariant_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
