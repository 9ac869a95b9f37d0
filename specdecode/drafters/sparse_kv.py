"""Self-speculation with a compressed KV cache (StreamingLLM's cache as the drafter, as in TriForce and
MagicDec): the target drafts with all its layers over a few *sink* entries at the start of its cache and
a *window* of the most recent ones, then verifies the draft over its whole cache.

On a long input the attention over the cache is a growing part of a decoding step: each new token reads
every cached key and value. A draft forward over sinks and window reads a fixed number of them, so it
costs the weights plus a constant, where a target forward costs the weights plus the whole cache. The
draft's distributions are close to the target's where the next token depends on recent text, which is
most of the time; where it needs something far back, verification rejects it. Verification is the
target's own, so the output is exact whatever the draft.

Cost, by the bytes a one-token forward reads (decoding is bound by memory bandwidth): the target reads its
weights W and b bytes of keys and values per cached token, W + b L at context L; the draft W + b (sinks +
window). With grouped-query attention the cache is small beside the weights (the default 1.5B target:
57 KB per token in float32 against ~0.9 GB of 4-bit weights), so the draft stays above W / (W + b L)
of a target forward; the drafter's adaptive length reads the ratio at each step and drafts only where it pays.

The compressed cache is a copy: the sinks and the window of every layer of the target's cache, taken
afresh before each draft (a few megabytes), then the draft tokens appended to it; the target's own cache
is never written. Positions stay the true ones: cached keys already carry their rotary positions, and the
draft tokens get theirs explicitly.
"""

from __future__ import annotations


import torch
from transformers import DynamicCache

from specdecode.devices import to_device
from specdecode.drafters.options import DrafterOptions
from specdecode.drafters.composite import CompositeDrafter, Source
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.self_speculative.layers import (
    causal_allowed, check_layer_skipping, crop_layers, head_output, kv_cache, run_layers,
)
from specdecode.errors import UserError
from specdecode.models.base import CausalLM, ForwardOutput
from specdecode.models.costs import CostCurve
from specdecode.models.cache import keys_values
from specdecode.models.hf import HFCausalLM, torch_target
from specdecode.types import Draft

SINKS = 4  # StreamingLLM's attention sinks: the first few entries draw attention whatever the text
WINDOW = 512  # the most recent entries the draft sees


def kv_bytes_per_token(target: HFCausalLM) -> int:
    """Bytes of keys and values one cached token takes over all layers."""
    config = target.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element = torch.finfo(target.model.dtype).bits // 8
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element


class CompressedView(CausalLM):
    """The target over a copy of its cache cut down to `sinks` entries at the start and the last `window`
    ones: a draft model that needs no weights of its own and no prefill.

    `refresh` takes the copy from the target's cache as it stands; the view's cache is then the target's
    context (compressed) followed by entries of its own for the tokens fed to it since. `crop` removes
    those and never goes below the target's length.
    """

    def __init__(self, target: HFCausalLM, sinks: int = SINKS, window: int = WINDOW):
        check_layer_skipping(target.model)
        if sinks < 0 or window < 1:
            raise UserError(f"a compressed cache needs sinks >= 0 and window >= 1, got {sinks} and {window}")
        self.target, self.sinks, self.window = target, sinks, window
        self.vocab_size, self.max_context = target.vocab_size, target.max_context
        self.eos_token_ids = target.eos_token_ids
        self._layers = tuple(range(target.model.config.num_hidden_layers))
        self._cache = DynamicCache(config=target.model.config)
        self._base = 0  # the target's cache length the copy was taken at
        self._kept = 0  # entries of the target's cache in the copy
        self._own = 0  # tokens fed to the view since

    @property
    def weight_bytes_per_token(self) -> int:
        return self.target.weight_bytes_per_token

    def kept(self, length: int) -> int:
        """Entries of a `length`-token context the view keeps."""
        return min(length, self.sinks + self.window)

    def relative_cost(self, length: int) -> float:
        """A one-token forward of the view in one-token forwards of the target, at context `length`, by
        the bytes each reads."""
        weights, per_token = self.target.weight_bytes_per_token, kv_bytes_per_token(self.target)
        return (weights + per_token * self.kept(length)) / (weights + per_token * length)

    @torch.inference_mode()  # the target's cache holds inference tensors
    def refresh(self) -> None:
        """Take the sinks and the window of the target's cache as it stands now."""
        length = self.target.cache_length
        self._cache = DynamicCache(config=self.target.model.config)
        if length:
            for index, layer in enumerate(kv_cache(self.target).layers):
                keys, values = keys_values(layer)
                self._cache.update(self._select(keys, length), self._select(values, length), index)
        self._base, self._kept, self._own = length, self.kept(length), 0

    def _select(self, entries: torch.Tensor, length: int) -> torch.Tensor:  # [1, kv_heads, length, d]
        if length <= self.sinks + self.window:
            return entries[:, :, :length]
        return torch.cat([entries[:, :, : self.sinks], entries[:, :, length - self.window : length]], dim=2)

    @property
    def cache_length(self) -> int:
        """In the target's positions: the context the copy stands for, then the view's own tokens."""
        return self._base + self._own

    @property
    def device(self) -> torch.device:
        return self.target.device

    @torch.inference_mode()
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
        if tree_mask is not None:
            raise ValueError("the compressed view drafts chains")
        if rows is not None or isinstance(output_hidden, tuple):  # one sequence, the last layer's states
            raise ValueError("the compressed view gives the last logits and the final hidden states only")
        n, device = token_ids.numel(), self.device
        token_ids = to_device(token_ids, device)
        if positions is None:
            positions = torch.arange(self.cache_length, self.cache_length + n, device=device)
        positions = to_device(positions, device)
        allowed = causal_allowed(self._kept + self._own, n, device) if n > 1 else None
        hidden = run_layers(self.target.model, self._layers, token_ids, positions, allowed, self._cache)
        self._own += n
        return head_output(self.target.model, hidden, n if num_logits is None else num_logits, output_hidden)

    def crop(self, length: int) -> None:
        if not self._base <= length <= self.cache_length:
            raise ValueError(f"the view can crop its own entries only: to [{self._base}, {self.cache_length}], "
                             f"not {length}")
        crop_layers(self._cache, self._layers, self._kept + length - self._base)
        self._own = length - self._base

    def reset(self) -> None:
        self._cache = DynamicCache(config=self.target.model.config)
        self._base = self._kept = self._own = 0


class SparseKVDrafter(DraftModelDrafter):
    """Drafts a chain with the target over its compressed cache (`CompressedView`): DraftModelDrafter's
    loop (greedy or sampled drafts with their distributions; adaptive length) with the draft cost taken
    at each step from the context length (`CompressedView.relative_cost`), so it drafts on long inputs
    and stays out of the way on short ones, where the view is the whole cache and costs a full forward.

    `target` must be the very HFCausalLM the engine verifies with: the view copies its cache. The step
    that prefills a prompt does not draft (the cache is not there yet); every later step feeds the one
    token the target has not seen.
    """

    name = "sparse-kv"

    def __init__(self, target: HFCausalLM, sinks: int = SINKS, window: int = WINDOW, num_tokens: int = 4,
                 adaptive: bool = True, max_tokens: int = 16, confidence_threshold: float = 0.4,
                 curve: CostCurve | None = None):
        if not isinstance(target, HFCausalLM):
            raise UserError("sparse-kv drafting runs the target's layers itself: it needs the torch backend")
        view = CompressedView(target, sinks, window)
        super().__init__(view, num_tokens=num_tokens, adaptive=adaptive, max_tokens=max_tokens,
                         confidence_threshold=confidence_threshold, draft_cost=1.0,  # priced in begin
                         curve=target.cost_curve() if curve is None else curve)  # None: the target's measured one
        self.target, self.view = target, view

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self.draft_cost = self.view.relative_cost(len(prompt_ids))
        super().begin(prompt_ids, forget)

    def propose(self, context, max_tokens, params, generator):
        start = self.target.cache_length
        self.draft_cost = self.view.relative_cost(max(start, 1))
        if not start or len(context) - start > 1:  # the prompt's prefill: nothing to draft from yet
            return Draft.empty()
        self.view.refresh()
        self._cache.seen = list(context[:start])  # the view stands for the target's context
        try:
            return super().propose(context, max_tokens, params, generator)
        finally:
            self.view.crop(start)  # the draft's own entries go; the copy is retaken next step
            del self._cache.seen[start:]


def build_sparse_kv(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> SparseKVDrafter:
    """`sparse-kv`: the target drafts over StreamingLLM's cache (sinks and a recent window)."""
    target = torch_target(target, "method 'sparse-kv'")
    return SparseKVDrafter(target, curve=target.cost_curve())


def under_lookup(target: HFCausalLM, reference_ids=None, curve: CostCurve | None = None,
                 **view_options) -> CompositeDrafter:
    """Two tiers, as TriForce stacks a cheap drafter on the compressed-cache one: prompt lookup first (free;
    long inputs are full of text an answer copies), the compressed-cache self-draft (`SparseKVDrafter`,
    given `view_options`) only where lookup promises less than one token (the composite's fallback rule),
    verified as one chain."""
    curve = curve or target.cost_curve()
    sources = [Source(PromptLookupDrafter(reference_ids=reference_ids), "free"),
               Source(SparseKVDrafter(target, curve=curve, **view_options), "expensive")]
    return CompositeDrafter(sources, curve, tree=False, device=target.device)


def build_sparse_kv_lookup(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> CompositeDrafter:
    """`sparse-kv-pld`: `under_lookup` with the default sinks and window."""
    return under_lookup(torch_target(target, "method 'sparse-kv-pld'"), options.reference_ids)
