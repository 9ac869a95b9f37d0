"""Running a subset of the target's decoder layers over the target's own KV cache: `run_layers` and
the draft model it makes, `SkippedLayers`. Shared by the self-speculative drafters and `sparse_kv`.

How layers are skipped. `run_layers` calls the model's own submodules in the order its forward calls
them -- token embedding, rotary position embedding, the kept decoder layers, final norm -- with an explicit
position per token and an explicit attention mask; callers apply the LM head. Nothing is forked and
nothing on the model changes. The other way, swapping `model.model.layers` for a ModuleList of the kept
layers inside a context manager, goes wrong in transformers 5.23 in two ways: `Qwen2Model.forward`
sizes its causal mask from the cache length of the first full-attention layer
(`masking_utils.find_first_full_attention_index`), which is not the kept layers' length once layer 0
is skipped and draft tokens sit in the others' caches; and it looks each layer's attention type up by
the layer's place in the list (`config.layer_types[i]`), not by its own index. It would also mutate a
model the engine is using, which another thread, or an exception escaping the context, would see. What
calling the layers depends on -- the submodules `embed_tokens`, `layers`, `norm`, `rotary_emb` and the
decoder layer's keyword arguments -- is common to transformers' Llama family (Llama, Qwen2, Qwen3,
Mistral) and is checked when a drafter is made (`check_layer_skipping`).

KV cache. Draft forwards write into the target's own `DynamicCache`: each kept layer's attention appends
at its own `layer_idx` and attends to that layer's keys and values of the context, which the target
computed in earlier verification forwards -- no second cache, no second prefill. Skipped layers are not
touched. When the draft is done the kept layers are cropped back to the target's cache length
(`SkippedLayers.crop`), so the engine's verification forward finds the cache exactly as it left it.

The layer search (`search_skip`, `search_exit`) scores skip sets on a few calibration prompts by the
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import DynamicCache, PreTrainedModel

from specdecode.devices import to_device
from specdecode.errors import UserError
from specdecode.models.base import CausalLM, ForwardOutput
from specdecode.models.cache import attention_layer, cache_keyword
from specdecode.models.hf import HFCausalLM, module_bytes
from specdecode.models.lean import lean_decoder


def check_layer_skipping(model: PreTrainedModel) -> None:
    """Raise a UserError unless `run_layers` can run this model: a Llama-style decoder whose every layer
    attends to the whole context."""
    decoder = getattr(model, "model", None)
    missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(decoder, name)]
    if decoder is None or missing or model.get_output_embeddings() is None:
        raise UserError(
            f"layer skipping needs a Llama-style decoder (embed_tokens, layers, norm, rotary_emb, an LM head); "
            f"{type(model).__name__} has none of: {', '.join(missing) or 'an LM head'}"
        )
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise UserError(f"layer skipping supports full-attention layers only; this model has {sorted(kinds)}")


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, m] bool (True: may attend) -> the [1, 1, n, m] additive mask transformers' attention takes."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def causal_allowed(cached: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, cached + n] bool: n new tokens after `cached` ones, each seeing the cache and itself and before."""
    return torch.ones(n, cached + n, dtype=torch.bool, device=device).tril(cached)


def run_layers(
    model: PreTrainedModel,
    layers: Iterable[int],  # decoder layers to run, ascending
    token_ids: torch.Tensor,  # [n] int64
    positions: torch.Tensor,  # [n] int64
    allowed: torch.Tensor | None,  # [n, cached + n] bool, new token i may attend to key j; None only for n == 1
    cache: DynamicCache | None,  # each layer reads and appends at its own layer_idx; None: no cache
    trace: list[torch.Tensor] | None = None,  # if given, gets the residual stream entering each layer and the last
) -> torch.Tensor:
    """The model's final-norm hidden states after only `layers`: [n, hidden]. The caller applies the LM
    head, and wraps the call in torch.inference_mode when the cache holds inference tensors."""
    n = token_ids.numel()
    if allowed is None and n > 1:
        raise ValueError("several new tokens need an explicit attention mask")
    lean = lean_decoder(model)
    if lean is not None:  # the quantized Llama family: transformers' arithmetic without its machinery
        return lean.run(layers, token_ids.view(n), positions.view(n), allowed, cache, trace)
    decoder = model.model
    hidden = decoder.embed_tokens(token_ids.view(1, n))  # [1, n, hidden]
    position_ids = positions.view(1, n)
    rotary = decoder.rotary_emb(hidden, position_ids)  # (cos, sin), each [1, n, head_dim]
    mask = None if allowed is None else additive_mask(allowed, hidden.dtype)  # [1, 1, n, cached + n]
    for index in layers:
        if trace is not None:
            trace.append(hidden[0])
        layer = decoder.layers[index]
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            **{cache_keyword(layer): cache},
            use_cache=cache is not None,
            position_embeddings=rotary,
        )  # [1, n, hidden]
    if trace is not None:
        trace.append(hidden[0])
    return decoder.norm(hidden)[0]  # [n, hidden]


def head_output(model: PreTrainedModel, hidden: torch.Tensor, num_logits: int, output_hidden: bool) -> ForwardOutput:
    """A view's ForwardOutput from `run_layers`' hidden states [n, hidden]: the LM head over the last
    `num_logits` of them."""
    hidden = hidden[hidden.shape[0] - num_logits :]  # [num_logits, hidden]
    logits = model.get_output_embeddings()(hidden)  # [num_logits, vocab]
    return ForwardOutput(logits=logits.float(), hidden=hidden if output_hidden else None)


def crop_layers(cache: DynamicCache, layers: Iterable[int], length: int) -> None:
    """Drop the entries past `length` of the given layers of the cache (the others are not touched)."""
    for index in layers:
        layer = attention_layer(cache.layers[index])
        surplus = layer.get_seq_length() - length
        if surplus > 0:
            layer.crop(-surplus)  # transformers takes minus the count to drop


def kv_cache(target: HFCausalLM) -> DynamicCache:
    """The target's own cache. HFCausalLM keeps it private; this module is the one other place that shares
    it. Read it afresh on every use: the target's reset() replaces it."""
    return target._cache


class SkippedLayers(CausalLM):
    """The target with the layers in `skip` left out, over the target's own KV cache: a draft model that
    costs no memory and needs no prefill.

    Its cache is the target's, for the context the target holds, followed by entries of its own for the
    tokens fed to it since (in the kept layers only). `crop` removes those and never the target's, so a
    crop to `target.cache_length` leaves the target's cache exactly as it was.
    """

    def __init__(self, target: HFCausalLM, skip: Iterable[int]):
        check_layer_skipping(target.model)
        num_layers = target.model.config.num_hidden_layers
        self.skip = tuple(sorted(set(int(i) for i in skip)))
        if any(not 0 <= i < num_layers for i in self.skip):
            raise UserError(f"skip layers must be in [0, {num_layers}), got {list(self.skip)}")
        self.kept = tuple(i for i in range(num_layers) if i not in self.skip)
        self.target = target
        self.vocab_size, self.max_context = target.vocab_size, target.max_context
        self.eos_token_ids = target.eos_token_ids
        layers = target.model.model.layers
        self._skipped_bytes = sum(module_bytes(layers[i]) for i in self.skip)
        self._own = 0  # tokens fed to the view since its cache last matched the target's

    @property
    def cache_length(self) -> int:
        return self.target.cache_length + self._own

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def weight_bytes_per_token(self) -> int:
        return self.target.weight_bytes_per_token - self._skipped_bytes

    @property
    def relative_cost(self) -> float:
        """A one-token forward of the view in one-token forwards of the target, by the weights read."""
        return self.weight_bytes_per_token / self.target.weight_bytes_per_token

    @property
    def cost_key(self) -> str:
        return f"{self.target.cost_key}|skip={','.join(map(str, self.skip))}"

    @torch.inference_mode()  # the cache holds inference tensors
    def forward(
        self,
        token_ids: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        num_logits: int | None = None,
        output_hidden: bool | tuple[int, ...] = False,
        rows: torch.Tensor | None = None,
    ) -> ForwardOutput:
        if rows is not None or isinstance(output_hidden, tuple):  # one sequence, the last layer's states
            raise ValueError("skipped layers give the last logits and the final hidden states only")
        n, device = token_ids.numel(), self.device
        cached = self.cache_length
        token_ids = to_device(token_ids, device)
        positions = (torch.arange(cached, cached + n, device=device) if positions is None
                     else to_device(positions, device))
        num_logits = n if num_logits is None else num_logits
        allowed: torch.Tensor | None  # [n, cached + n] bool; None: one token, which sees the whole cache
        if tree_mask is not None:  # [n, m] over the last m tokens -> [n, cached + n]
            m = tree_mask.shape[1]
            if m > cached + n:
                raise ValueError(f"a tree mask over {m} tokens, but the cache and the input hold {cached + n}")
            allowed = torch.ones(n, cached + n, dtype=torch.bool, device=device)
            allowed[:, cached + n - m :] = to_device(tree_mask, device)
        else:
            allowed = causal_allowed(cached, n, device) if n > 1 else None
        hidden = run_layers(self.target.model, self.kept, token_ids, positions, allowed, kv_cache(self.target))
        self._own += n
        return head_output(self.target.model, hidden, num_logits, output_hidden)

    def crop(self, length: int) -> None:
        start = self.target.cache_length
        if not start <= length <= self.cache_length:
            raise ValueError(f"the view can crop its own entries only: to [{start}, {self.cache_length}], not {length}")
        crop_layers(kv_cache(self.target), self.kept, length)
        self._own = length - start

    def reset(self) -> None:
        """Drop the view's own entries; the sequence itself is the target's to reset."""
        self.crop(self.target.cache_length)

