"""The static path's stacked projections (`models.static_layers.fuse_projections`): one product for a layer's query, key
and value projections and one for its MLP's gate and up, over the same memory as the model's own weights, and the
same function as transformers' forward."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import VOCAB, Dispatched, tiny_architecture, tiny_qwen2
from specdecode.models.hf import HFCausalLM
from specdecode.models.static import StaticCausalLM
from specdecode.models.static_layers import decode_layers, empty_cache, fuse_projections

pytestmark = pytest.mark.usefixtures("one_thread")


def storages(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind a model's parameters and buffers."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*model.parameters(), *model.buffers()]}
    return sum(seen.values())


def test_the_layers_weights_become_views_of_the_stacked_ones_in_the_same_memory():
    model = tiny_qwen2(seed=0, layers=2)
    before = storages(model)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        expected = model(ids).logits
    fuse_projections(model.model)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        stacked = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
        assert torch.equal(attention.qkv_weight, stacked)
        assert attention.q_proj.weight.data_ptr() == attention.qkv_weight.data_ptr()
        assert attention.v_proj.weight.untyped_storage().data_ptr() == attention.qkv_weight.untyped_storage().data_ptr()
        assert torch.equal(attention.qkv_bias, torch.cat([attention.q_proj.bias, attention.k_proj.bias,
                                                         attention.v_proj.bias]))
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
        assert not hasattr(mlp, "gate_up_bias")  # Qwen2's MLP has no bias
    assert storages(model) == before  # nothing kept twice
    assert "qkv_weight" not in model.state_dict() and not any("gate_up" in key for key in model.state_dict())
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, expected)  # transformers' own forward reads the same weights
    ptr = model.model.layers[0].self_attn.qkv_weight.data_ptr()
    fuse_projections(model.model)  # a no-op on a fused decoder
    assert model.model.layers[0].self_attn.qkv_weight.data_ptr() == ptr


def test_a_moved_model_stays_consistent_and_is_fused_again():
    """`.to()` converts the weights and the stacked buffers apart (the views broken, the values still alike); fusing
    again makes them one memory."""
    model = tiny_qwen2(seed=1, layers=1)
    fuse_projections(model.model)
    model.to(torch.float64)
    attention = model.model.layers[0].self_attn
    assert attention.qkv_weight.dtype == torch.float64
    assert torch.equal(attention.qkv_weight[: attention.q_proj.out_features], attention.q_proj.weight)
    fuse_projections(model.model)
    assert attention.q_proj.weight.data_ptr() == attention.qkv_weight.data_ptr()


def test_fused_layers_compute_what_the_separate_projections_do():
    """`decode_layers` over stacked projections against the same layers unfused (three products and two): the
    same function (to float32 rounding: a product of another width may sum in another order)."""
    model = tiny_qwen2(seed=2, layers=3)
    fused, plain = model.model, copy.deepcopy(model.model)
    fuse_projections(fused)
    assert not hasattr(plain.layers[0].self_attn, "qkv_weight")
    generator = torch.Generator().manual_seed(0)
    n = 12
    states = torch.randn(n, model.config.hidden_size, generator=generator)
    positions = slots = torch.arange(n)
    allowed = torch.ones(n, 32, dtype=torch.bool).tril()
    with torch.inference_mode():
        outs = [decode_layers(decoder, states, positions, slots, allowed,
                              empty_cache(decoder, 32, torch.float32, torch.device("cpu")))
                for decoder in (fused, plain)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert outs[0].abs().max() > 0.1  # not a degenerate output


def test_the_static_path_fuses_the_model_it_is_given():
    model = tiny_qwen2(seed=3, layers=2)
    StaticCausalLM(model, capacity=64)
    assert all(hasattr(layer.self_attn, "qkv_weight") and hasattr(layer.mlp, "gate_up_weight")
               for layer in model.model.layers)


@pytest.mark.parametrize("width", [1, 16])
def test_a_static_forward_runs_few_operations_a_layer(width):
    """At batch one a GPU forward costs about its number of kernels, whatever their size: the static decoder's
    step runs 19 computing operations per layer in float32 (at most 22 allowed here); before `fuse_projections` and
    its companions it ran 41, and transformers' eager forward runs 36 (`past_key_values` over a one-token step)."""
    from specdecode.models.static import pack

    counts = {}
    for layers in (2, 4):
        lm = StaticCausalLM(tiny_qwen2(seed=4, layers=layers), capacity=128)
        lm.forward(torch.tensor([1, 2, 3, 4, 5]))
        with torch.inference_mode(), Dispatched() as dispatched:
            packed = pack(lm.cache_length, width, width, None, None)
            lm.decoder.step(packed, torch.zeros(width, dtype=torch.long), False)
        counts[layers] = dispatched.count
    per_layer = (counts[4] - counts[2]) / 2
    assert 10 <= per_layer <= 22, counts


@pytest.mark.parametrize("kind", ["qwen2", "llama", "llama-mlp-bias", "mistral", "qwen3"])
def test_the_static_path_computes_transformers_forward_on_each_architecture_it_claims(kind):
    """Logits of the static path (stacked projections where the biases allow, query and key rotated together, Qwen3's
    per-head norms) against transformers' forward of the same model, through a prefill, decoding steps, a tree with
    explicit positions, a move of its accepted path and a crop: equal to float32 rounding, and the same greedy token."""
    model = tiny_architecture(kind)
    static, dynamic = StaticCausalLM(model, capacity=128), HFCausalLM(model)
    generator = torch.Generator().manual_seed(5)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    prompt = torch.randint(0, VOCAB, (40,), generator=generator)
    steps = [torch.randint(0, VOCAB, (n,), generator=generator) for n in (1, 1, 3, 5, 2)]
    outputs = []
    for lm in (static, dynamic):
        out = [lm.forward(prompt, num_logits=3).logits]
        for tokens in steps[:3]:
            out.append(lm.forward(tokens).logits)
        start = lm.cache_length
        out.append(lm.forward(steps[3], positions=torch.tensor([0, 1, 1, 2, 2]) + start, tree_mask=tree).logits)
        lm._move(start, [0, 2, 4])
        lm.crop(start + 3)
        out.append(lm.forward(steps[4]).logits)
        outputs.append(out)
    assert hasattr(model.model.layers[0].self_attn, "qkv_weight")
    assert hasattr(model.model.layers[0].mlp, "gate_up_bias") == (kind == "llama-mlp-bias")
    for ours, theirs in zip(*outputs, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
