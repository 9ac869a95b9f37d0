"""The quantized paths' decoder loop of our own: a forward of the Llama family without transformers' generic
machinery.

On the int4 path a one-token forward spends much of its time beside the quantized products, in
transformers' machinery around them, which a model of any kind needs and a decoding step of a known one
does not: the model's mask building and output capture, a keyword-argument journey through every layer,
the attention implementation looked up by name in each layer, module calls with their hooks (a profile:
docs/results/code-choices.md). `LeanDecoder` runs the same submodules' arithmetic in the same order on the
same tensors -- embedding, rotary embedding,
per layer RMSNorm, the query/key/value products, rotary positions, cache append, the batch-invariant
attention (`int8.invariant_attention`'s kernel), output product, residual, RMSNorm, gated MLP, residual,
then the final norm -- so its logits, hidden states and cache entries are transformers', bit for bit
(tests/exact/test_lean_decoder.py), on two-dimensional [tokens, features] tensors and with the quantized
layers' kernels called directly (`rows`).

It applies to what it knows (`lean_decoder`): a Llama, Mistral, Qwen2 or Qwen3 decoder whose every layer attends
to the whole context, on a quantized path (`int8.quantize_invariant`: every Linear an invariant int8 or
int4 layer, attention `int8.ATTENTION`). Anything else keeps transformers' forward.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdecode.models.int4 import InvariantInt4Linear
from specdecode.models.int8 import ATTENTION, InvariantInt8Linear, invariant_attention

# the decoder layers whose forward `LeanDecoder` writes out: pre-norm attention and gated MLP, RMSNorm (Qwen3's
# also on each head's queries and keys), rotary positions applied by rotating halves
LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})
NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
QUANTIZED_LAYERS = (InvariantInt8Linear, InvariantInt4Linear)  # the exact quantized paths' Linear layers


def lean_decoder(model: PreTrainedModel) -> LeanDecoder | None:
    """A LeanDecoder for `model` when its forward is one it writes out (module docstring), else None. The
    answer is kept on the model (looking takes a few hundred microseconds for a 28-layer model, and layer
    skipping asks every draft step) until its attention implementation changes, as quantization changes it."""
    implementation = model.config._attn_implementation
    kept = model.__dict__.get("_specdecode_lean")
    if kept is None or kept[0] != implementation:
        kept = (implementation, _lean_decoder(model))
        model.__dict__["_specdecode_lean"] = kept
    return kept[1]


def _lean_decoder(model: PreTrainedModel) -> LeanDecoder | None:
    decoder = getattr(model, "model", None)
    if decoder is None or not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None
    if model.config._attn_implementation != ATTENTION:
        return None
    if set(getattr(model.config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return None
    if any(type(layer).__name__ not in LAYERS or not hasattr(layer.mlp, "gate_up_proj") for layer in decoder.layers):
        return None  # (`int8.fuse_gate_up` made the gated MLP's one input product)
    norms = [decoder.norm] + [n for layer in decoder.layers for n in (
        layer.input_layernorm, layer.post_attention_layernorm, *_head_norms(layer.self_attn))]
    linears = [p for layer in decoder.layers for p in (layer.self_attn.q_proj, layer.self_attn.k_proj,
               layer.self_attn.v_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if (any(type(norm).__name__ not in NORMS for norm in norms)
            or not all(isinstance(p, QUANTIZED_LAYERS) for p in [*linears, model.get_output_embeddings()])):
        return None
    return LeanDecoder(model)


def _head_norms(attention) -> list:
    """The attention's per-head query and key norms (Qwen3), if any."""
    return [attention.q_norm, attention.k_norm] if hasattr(attention, "q_norm") else []


def _rms_norm(norm, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm forward on float32 states (its casts to and from float32 are then no-ops)."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return norm.weight * (hidden * torch.rsqrt(variance + norm.variance_epsilon))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb` for one tensor: x [n, heads, d], cos and sin [n, 1, d]."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _fuse_projections(layers: list) -> InvariantInt4Linear | None:
    """The layers as one int4 product (`InvariantInt4Linear.stacked`) when every one is int4 with or without a
    bias alike, else None."""
    if not all(isinstance(layer, InvariantInt4Linear) for layer in layers):
        return None
    if len({layer.bias is None for layer in layers}) != 1:
        return None
    return InvariantInt4Linear.stacked(layers)


class LeanDecoder:
    """The forward of a quantized Llama-family model, written out (module docstring). On the int4 path each
    attention's query, key and value products run as one (`_fuse_projections`)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.decoder = model.model
        self.head = model.get_output_embeddings()
        # kept here, not on the modules: module_bytes and state dicts see the three layers only
        self.qkv = []
        for layer in self.decoder.layers:
            attention = layer.self_attn
            self.qkv.append(_fuse_projections([attention.q_proj, attention.k_proj, attention.v_proj]))

    def run(
        self,
        layers,  # the decoder layers to run, ascending (all of them: the model's forward)
        token_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        allowed: torch.Tensor | None,  # [n, cached + n] bool (True: may attend), or None: causal
        cache,  # transformers' DynamicCache (or a subclass): each layer reads and appends at its own index; or None
        trace: list[torch.Tensor] | None = None,  # if given, gets the states entering each layer and the last
    ) -> torch.Tensor:
        """The final-norm hidden states [n, hidden] after `layers`, as `self_speculative.layers.run_layers`
        (which calls this for lean models) and transformers' forward compute them. The caller holds
        torch.inference_mode when the cache holds inference tensors."""
        n = token_ids.numel()
        decoder = self.decoder
        hidden = decoder.embed_tokens(token_ids)  # [n, hidden]
        cos, sin = decoder.rotary_emb(hidden, positions.view(1, n))  # each [1, n, d]
        cos, sin = cos[0, :, None], sin[0, :, None]  # [n, 1, d]
        mask = None if allowed is None else allowed[None, None]  # one object for every layer: the rows are planned once
        for index in layers:
            if trace is not None:
                trace.append(hidden)
            layer = decoder.layers[index]
            attention = layer.self_attn
            states = _rms_norm(layer.input_layernorm, hidden)
            head_dim = attention.head_dim
            fused = self.qkv[index]
            if fused is not None:  # [n, q + k + v]
                both = fused.rows(states)
                widths = (attention.q_proj.out_features, attention.k_proj.out_features)
                query = both[:, : widths[0]].view(n, -1, head_dim)  # [n, heads, d]
                key = both[:, widths[0] : widths[0] + widths[1]].view(n, -1, head_dim)  # [n, kv_heads, d]
                value = both[:, widths[0] + widths[1] :].view(n, -1, head_dim)
            else:
                query = attention.q_proj.rows(states).view(n, -1, head_dim)  # [n, heads, d]
                key = attention.k_proj.rows(states).view(n, -1, head_dim)  # [n, kv_heads, d]
                value = attention.v_proj.rows(states).view(n, -1, head_dim)
            if hasattr(attention, "q_norm"):  # Qwen3: each head's query and key normalised
                query, key = _rms_norm(attention.q_norm, query), _rms_norm(attention.k_norm, key)
            query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
            key, value = key.transpose(0, 1)[None], value.transpose(0, 1)[None]  # [1, kv_heads, n, d]
            if cache is not None:
                key, value = cache.update(key, value, index)
            out, _ = invariant_attention(attention, query.transpose(0, 1)[None], key, value, mask, attention.scaling)
            hidden = hidden + attention.o_proj.rows(out.reshape(n, -1))  # out: [1, n, heads, d]
            mlp = layer.mlp
            gate, up = mlp.gate_up_proj.rows(_rms_norm(layer.post_attention_layernorm, hidden)).chunk(2, dim=-1)
            hidden = hidden + mlp.down_proj.rows(mlp.act_fn(gate) * up)
        if trace is not None:
            trace.append(hidden)
        return _rms_norm(decoder.norm, hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[m, hidden] final-norm states -> [m, vocab] float32 logits."""
        return self.head.rows(hidden)
