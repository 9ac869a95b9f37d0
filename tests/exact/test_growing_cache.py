"""The KV cache that grows in place (`models.cache`) holds what transformers' concatenating cache holds, bit
for bit, through appends, crops, tree compaction and growth past its room, on the float and the quantized
paths (whose attention kernel now reads the cache's heads at a stride)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import VOCAB, tiny_qwen2
from specdecode.models import cache, int4
from specdecode.models.hf import HFCausalLM
from specdecode.models.int8 import quantize_invariant

PATHS = ["float32", "int8",
         pytest.param("int4", marks=pytest.mark.skipif(not int4.available(), reason="no int4 kernel"))]


def _model(path: str):
    model = tiny_qwen2(seed=11, layers=2, max_positions=1024)
    return model if path == "float32" else quantize_invariant(model, bits=int(path[3:]))


def _session(lm: HFCausalLM) -> list[torch.Tensor]:
    """Forwards, crops and a tree compaction that cross the cache's room (ROOM positions) twice."""
    g = torch.Generator().manual_seed(3)
    tokens = lambda n: torch.randint(0, VOCAB, (n,), generator=g)  # noqa: E731
    rows = [lm.forward(tokens(cache.ROOM - 3), num_logits=1).logits]
    for width in (1, 5, 2, 8, 1):  # the third forward crosses the room
        rows.append(lm.forward(tokens(width)).logits)
        lm.crop(lm.cache_length - width // 2)
    lm._move(lm.cache_length - 4, [1, 3])  # keep two of the last four entries, as tree verification does
    lm.crop(lm.cache_length - 2)
    rows.append(lm.forward(tokens(cache.ROOM)).logits)  # grows again
    rows.append(lm.forward(tokens(1)).logits)
    return rows


@pytest.mark.parametrize("path", PATHS)
def test_the_growing_cache_gives_the_concatenating_caches_logits(path):
    model = _model(path)
    growing = HFCausalLM(model)
    assert all(isinstance(layer, cache.GrowingLayer) for layer in growing._cache.layers)
    concatenating = HFCausalLM(model)
    concatenating._cache = DynamicCache(config=model.config)
    for ours, theirs in zip(_session(growing), _session(concatenating), strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(growing._cache.layers, concatenating._cache.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_appends_write_into_the_room_and_a_replaced_tensor_is_adopted():
    layer = cache.GrowingLayer()
    keys = torch.randn(1, 2, 10, 8)
    layer.update(keys, keys + 1)
    buffer = layer._key_buffer
    assert buffer.shape[-2] >= 10 + cache.ROOM - 10 and layer.keys.shape == (1, 2, 10, 8)
    layer.update(keys[:, :, :3], keys[:, :, :3] + 1)
    assert layer._key_buffer is buffer  # no copy: written in place
    assert torch.equal(layer.keys, torch.cat([keys, keys[:, :, :3]], dim=-2))
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # someone replaced them
    layer.update(keys[:, :, :1], keys[:, :, :1] + 1)
    assert torch.equal(layer.keys[..., :13, :], torch.cat([keys, keys[:, :, :3]], dim=-2))
    assert torch.equal(layer.values[..., 13:, :], keys[:, :, :1] + 1)
