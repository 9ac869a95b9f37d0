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
from transformers.cache_utils import DynamicLayer

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
        if not self._holds_views() or total > self._key_buffer.shape[-2]:
            self._key_buffer = self._regrow(self.keys, key_states, length, total)
            self._value_buffer = self._regrow(self.values, value_states, length, total)
        self._key_buffer[..., length:total, :] = key_states
        self._value_buffer[..., length:total, :] = value_states
        self.keys = self._key_buffer[..., :total, :]
        self.values = self._value_buffer[..., :total, :]
        return self.keys, self.values

    def _holds_views(self) -> bool:
        """Whether `keys` and `values` are still views of the buffers (something may have replaced them)."""
        return (
            self._key_buffer is not None
            and self.keys.data_ptr() == self._key_buffer.data_ptr()
            and self.values.data_ptr() == self._value_buffer.data_ptr()
        )

    @staticmethod
    def _regrow(old: torch.Tensor, new: torch.Tensor, length: int, total: int) -> torch.Tensor:
        """A buffer with room for `total` positions and a quarter more (at least ROOM), rounded up to ROOM,
        holding the first `length` positions of `old`."""
        room = -(-(total + max(ROOM, total // 4)) // ROOM) * ROOM
        buffer = new.new_empty((*new.shape[:-2], room, new.shape[-1]))
        if length:
            buffer[..., :length, :] = old[..., :length, :]
        return buffer


def growing_cache(config: PretrainedConfig) -> DynamicCache:
    """transformers' `DynamicCache` for `config`, its full-attention layers `GrowingLayer`s (sliding-window
    and other kinds of layer stay as transformers builds them)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@functools.cache
def _keyword(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_keyword(module: torch.nn.Module) -> str:
    """The name under which `module`'s forward takes its KV cache: `cache` from transformers 5.24 on (which
    deprecates `past_key_values` and drops it in 5.40), `past_key_values` before."""
    return _keyword(type(module).forward)
