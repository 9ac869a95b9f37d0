"""A KV cache that grows in place: transformers' `DynamicCache` with its full-attention layers appending into
preallocated room instead of concatenating.

transformers' `DynamicLayer` appends a forward's keys and values with `torch.cat`, which copies the whole
cache every forward, a cost that grows with the context and shows in a one-token forward at long
contexts (docs/results/code-choices.md). `GrowingLayer`
keeps each layer's keys and values in buffers with room to spare and writes new entries into the room;
`keys` and `values` stay what every reader expects, tensors [batch, kv_heads, length, head_dim], now
views of the buffers' first `length` positions. Cropping (transformers' own `crop`) shortens the views;
the next append overwrites what was cropped. Values are the same as the concatenating layer's, bit for bit:
only where they are stored changes.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

ROOM = 256  # positions a buffer is rounded up to, and the least it grows by


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose appends write into preallocated room (module docstring)."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._key_buffer = self._value_buffer = None
        length = self.get_seq_length()
        total = length + key_states.shape[-2]
        keys, values = self._key_buffer, self._value_buffer
        if keys is None or values is None or not self._holds_views() or total > keys.shape[-2]:
            keys = self._key_buffer = self._regrow(self.keys, key_states, length, total)
            values = self._value_buffer = self._regrow(self.values, value_states, length, total)
        keys[..., length:total, :] = key_states
        values[..., length:total, :] = value_states
        self.keys, self.values = keys[..., :total, :], values[..., :total, :]
        return self.keys, self.values

    def _holds_views(self) -> bool:
        """Whether `keys` and `values` are still views of the buffers (something may have replaced them)."""
        keys, values = self._key_buffer, self._value_buffer
        return (
            keys is not None and values is not None and self.keys is not None and self.values is not None
            and self.keys.data_ptr() == keys.data_ptr()
            and self.values.data_ptr() == values.data_ptr()
        )

    @staticmethod
    def _regrow(old: torch.Tensor | None, new: torch.Tensor, length: int, total: int) -> torch.Tensor:
        """A buffer with room for `total` positions and a quarter more (at least ROOM), rounded up to ROOM,
        holding the first `length` positions of `old`."""
        room = -(-(total + max(ROOM, total // 4)) // ROOM) * ROOM
        buffer = new.new_empty((*new.shape[:-2], room, new.shape[-1]))
        if length and old is not None:  # None: nothing cached yet
            buffer[..., :length, :] = old[..., :length, :]
        return buffer


def attention_window(config: PretrainedConfig) -> int | None:
    """The narrowest window of the context that some layer of a model of `config` attends to; None when every layer
    sees the whole context (a window as wide as the context is none). Mistral keeps its window in `sliding_window`
    alone; Gemma mixes window and full layers in `layer_types`; Qwen2's window is None unless `use_sliding_window`;
    Llama 4's chunked attention, as wide as its chunk, is one too."""
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    kinds = set(getattr(config, "layer_types", None) or [])
    if window is None or (kinds and kinds <= {"full_attention"}) or getattr(config, "use_sliding_window", 1) is False:
        return None
    context = getattr(config, "max_position_embeddings", None)
    return None if context is not None and window >= context else int(window)


def growing_cache(config: PretrainedConfig) -> DynamicCache:
    """transformers' `DynamicCache` for `config`, its full-attention layers `GrowingLayer`s; a model whose layers
    attend to a window has its sequences kept within it (`HFCausalLM.max_context`), where a window layer holds what
    a full one holds, so its window layers are `GrowingLayer`s too (transformers' drops entries past the window, which
    cropping and moving entries by their slots cannot follow). Other kinds of layer stay as transformers builds them."""
    cache = DynamicCache(config=config)
    kinds = (DynamicLayer, DynamicSlidingWindowLayer) if attention_window(config) is not None else (DynamicLayer,)
    cache.layers = [GrowingLayer() if type(layer) in kinds else layer for layer in cache.layers]
    return cache


@functools.cache
def _keyword(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_keyword(module: torch.nn.Module) -> str:
    """The name under which `module`'s forward takes its KV cache: `cache` from transformers 5.24 on (which
    deprecates `past_key_values` and drops it in 5.40), `past_key_values` before."""
    return _keyword(type(module).forward)


def keys_values(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values, each [batch, kv_heads, length, head_dim]. transformers types a cache's
    layers as any kind; the code that moves, crops or copies entries runs on attention layers, which hold
    both once anything is cached (a layer of another kind, such as linear attention's, is refused)."""
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise TypeError(f"a {type(layer).__name__} holds no keys and values")
    return keys, values


def attention_layer(layer: object) -> DynamicLayer:
    """A cache layer that can be cropped: an attention layer (`DynamicLayer`, `GrowingLayer`...); see
    `keys_values` for why another kind is refused."""
    if not isinstance(layer, DynamicLayer):
        raise TypeError(f"a {type(layer).__name__} cannot be cropped here")
    return layer
