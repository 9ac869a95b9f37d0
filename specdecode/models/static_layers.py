"""The arithmetic of the static-shape path's layers (`models.static`): transformers' forward of a Llama-family
decoder written out over a KV cache of fixed capacity, in few kernels, because on a GPU at batch one a forward costs
its number of kernels more than its arithmetic. The target's and the draft model's static decoder run it, and so does
the EAGLE head's one Qwen2 layer (`drafters.static_heads`); EAGLE-3's own layer (`drafters.eagle3.StaticEagle3State`) is
written with the same pieces (`fuse_layer`, `rotate`, `grouped_attention`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def empty_cache(decoder, capacity: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The keys and values of a Llama-family decoder's layers (`decode_layers`' `kv`) over `capacity` slots:
    zeros [2, layers, kv_heads, capacity, head_dim], so that a pad's or a masked slot's garbage is always finite."""
    attention = decoder.layers[0].self_attn
    kv_heads = attention.k_proj.out_features // attention.head_dim
    return torch.zeros(2, len(decoder.layers), kv_heads, capacity, attention.head_dim, dtype=dtype, device=device)


def fuse_projections(decoder) -> None:
    """Give each layer of a Llama-family `decoder` one matrix for its query, key and value projections and one for
    its MLP's gate and up projections (non-persistent buffers `qkv_weight`, `gate_up_weight` and their biases, where
    every projection of the group has one), the layers' own weights becoming views of them: `decode_layers` then
    runs one product where transformers runs three and two, in the same memory. A forward on a GPU at batch one is
    bound by its number of kernels, not by their arithmetic. Done again where a weight is no longer a view (the model
    moved since, say); a no-op otherwise."""
    for layer in decoder.layers:
        fuse_layer(layer.self_attn, layer.mlp)


def fuse_layer(attention: torch.nn.Module, mlp: torch.nn.Module) -> None:
    """`fuse_projections` for one layer's attention (its `q_proj`, `k_proj`, `v_proj`) and MLP (its `gate_proj` and
    `up_proj`, where it has them): the EAGLE-3 head's layer too, whose modules are its own."""
    _stack(attention, "qkv", [attention.q_proj, attention.k_proj, attention.v_proj])
    if hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj"):
        _stack(mlp, "gate_up", [mlp.gate_proj, mlp.up_proj])


def _stack(owner: torch.nn.Module, name: str, linears: list) -> None:
    if not all(type(linear) is torch.nn.Linear for linear in linears):
        return
    with_bias = [linear.bias is not None for linear in linears]
    if any(with_bias) and not all(with_bias):
        return
    for part in ("weight", "bias") if all(with_bias) else ("weight",):
        stacked = getattr(owner, f"{name}_{part}", None)
        tensors = [getattr(linear, part) for linear in linears]
        if stacked is not None and _views(stacked, tensors):
            continue
        with torch.no_grad():
            stacked = torch.cat([t.detach() for t in tensors])
        owner.register_buffer(f"{name}_{part}", stacked, persistent=False)
        start = 0
        for linear, tensor in zip(linears, tensors):
            rows = tensor.shape[0]
            setattr(linear, part, torch.nn.Parameter(stacked[start : start + rows], requires_grad=tensor.requires_grad))
            start += rows


def _views(stacked: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    """Whether `tensors` are `stacked`'s consecutive row blocks, in order."""
    start = 0
    for tensor in tensors:
        if tensor.device != stacked.device or tensor.data_ptr() != stacked[start:].data_ptr():
            return False
        start += tensor.shape[0]
    return start == stacked.shape[0]


def decode_layers(decoder, states: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  allowed: torch.Tensor, kv: torch.Tensor, trace: list[torch.Tensor] | None = None) -> torch.Tensor:
    """transformers' forward of a Llama-family decoder (`decoder`: its `*Model`, a causal LM's `model` or the EAGLE
    head's one-layer Qwen2Model) from its input states [n, d] at rotary `positions` [n] through its layers and
    final norm -> [n, d]: each layer's keys and values written at cache `slots` [n] of kv[:, layer] (`empty_cache`),
    token i attending to the slots where allowed[i] [n, capacity] is True. `trace` gets each layer's input.

    Written for few kernels (`fuse_projections`' stacked products where the decoder has them; query and key
    rotated together; the mask made an additive bias once for every layer): the same sums as transformers' except
    the RMS norms, whose weight is multiplied in float32 before the one rounding to the model's dtype (a last-bit
    difference from transformers' product in bfloat16; none in float32)."""
    n = states.shape[0]
    cos, sin = decoder.rotary_emb(states, positions.view(1, n))  # each [1, n, head_dim]
    half = cos.shape[-1] // 2
    # rotate_half(x) * sin == roll(x, half) * sin with its first half negated (negation is exact)
    cos, sin = cos[0, :, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[0, :, None]  # [n, 1, head_dim]
    attention = decoder.layers[0].self_attn
    heads = attention.q_proj.out_features // attention.head_dim
    bias = attention_bias(allowed)
    for index, layer in enumerate(decoder.layers):
        if trace is not None:
            trace.append(states)
        attention = layer.self_attn
        normed = _rms_norm(layer.input_layernorm, states)
        if hasattr(attention, "qkv_weight"):
            qkv = F.linear(normed, attention.qkv_weight, getattr(attention, "qkv_bias", None))
            qkv = qkv.view(n, -1, attention.head_dim)  # [n, heads + 2 kv_heads, head_dim]
        else:
            qkv = torch.cat([linear(normed).view(n, -1, attention.head_dim)
                             for linear in (attention.q_proj, attention.k_proj, attention.v_proj)], dim=1)
        kv_heads = (qkv.shape[1] - heads) // 2
        value = qkv[:, heads + kv_heads :]  # [n, kv_heads, head_dim]
        if hasattr(attention, "q_norm"):  # Qwen3: each head's query and key normalised
            query = rotate(attention.q_norm(qkv[:, :heads]), cos, sin, half)
            key = rotate(attention.k_norm(qkv[:, heads : heads + kv_heads]), cos, sin, half)
        else:
            rotated = rotate(qkv[:, : heads + kv_heads], cos, sin, half)
            query, key = rotated[:, :heads], rotated[:, heads:]
        kv[0, index].index_copy_(1, slots, key.transpose(0, 1))  # [kv_heads, capacity, head_dim]
        kv[1, index].index_copy_(1, slots, value.transpose(0, 1))
        out = grouped_attention(query.transpose(0, 1), kv[0, index], kv[1, index], allowed, attention.scaling,
                                bias)  # [heads, n, head_dim]
        states = states + attention.o_proj(out.transpose(0, 1).reshape(n, -1))
        states = states + _mlp(layer.mlp, _rms_norm(layer.post_attention_layernorm, states))
    return _rms_norm(decoder.norm, states)


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """A Llama-family RMS norm (`lean.NORMS`) in one kernel where torch has a fused one."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb` for x [n, heads, d] with cos [n, 1, d] and `sin` [n, 1, d] whose first
    half is negated (`decode_layers`)."""
    return (x * cos) + (torch.roll(x, half, dims=-1) * sin)


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """A Llama-family MLP, down(act(gate(x)) * up(x)), gate and up in one product where `fuse_projections` stacked
    them."""
    if not hasattr(mlp, "gate_up_weight"):
        return mlp(x)
    gate, up = F.linear(x, mlp.gate_up_weight, getattr(mlp, "gate_up_bias", None)).chunk(2, dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


def attention_bias(allowed: torch.Tensor) -> torch.Tensor:
    """`allowed` [n, capacity] -> the additive float32 bias [n, capacity] `grouped_attention` adds to its scores (each
    group of query heads alike): 0 where allowed, -inf elsewhere."""
    return torch.where(allowed, 0.0, float("-inf"))


def grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                      scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of queries [heads, n, d] over keys and values [kv_heads, capacity, d] where allowed [n, capacity]
    is True -> [heads, n, d]. Each group of heads that shares a key head is one matrix product over that head's keys,
    read once: torch's fused kernels take a mask with grouped heads only by copying every key head for each query
    head, the whole capacity at every step (its math fallback). Scores and softmax in float32. `bias`:
    `attention_bias(allowed)`, made once where many layers share the mask."""
    heads, n, d = query.shape
    kv = keys.shape[0]
    group = heads // kv  # head h reads key head h // group, as transformers' repeat_kv lays them out
    if bias is None:
        bias = attention_bias(allowed)
    scores = torch.matmul(query.reshape(kv, group * n, d), keys.transpose(1, 2))  # [kv, group * n, capacity]
    # bias + scale * scores in one kernel, in float32, the bias broadcast over each group's rows: 0 + x is x, and
    # -inf + x is -inf, as a masked fill gives
    scores = torch.add(bias, scores.view(kv, group, n, -1), alpha=scale)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs.view(kv, group * n, -1), values).view(heads, n, d)
