"""The quantized paths' own decoder loop (`models.lean`) computes what transformers' forward computes, bit for
bit: logits, hidden states and cache entries, through prefill, decoding, tree masks with explicit positions,
chosen logit rows, crops and layer subsets (layer skipping), on each architecture it claims, int8 and int4."""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from conftest import SIZES, VOCAB, tiny_architecture, tiny_qwen2
from specdecode.drafters.self_speculative import layers as skipping
from specdecode.models import int4
from specdecode.models.hf import HFCausalLM
from specdecode.models.int8 import quantize_invariant
from specdecode.models.lean import LeanDecoder, lean_decoder

BITS = [8, pytest.param(4, marks=pytest.mark.skipif(not int4.available(), reason="no int4 kernel"))]
def _pair(kind: str, bits: int) -> tuple[HFCausalLM, HFCausalLM]:
    """The same quantized model twice: through the lean loop, and through transformers' forward."""
    model = quantize_invariant(tiny_architecture(kind), bits=bits)
    lean, reference = HFCausalLM(model), HFCausalLM(model)
    assert isinstance(lean._lean, LeanDecoder)
    reference._lean = None
    return lean, reference


def _session(lm: HFCausalLM) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tokens = lambda n: torch.randint(0, VOCAB, (n,), generator=g)  # noqa: E731
    out = [lm.forward(tokens(40), num_logits=3).logits]
    for _ in range(3):
        step = lm.forward(tokens(1), output_hidden=True)
        out += [step.logits, step.hidden]
    # a tree of 5 over the last 5 positions: two branches from the root, explicit positions
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    start = lm.cache_length
    verified = lm.forward(tokens(5), positions=torch.tensor([0, 1, 1, 2, 2]) + start, tree_mask=tree,
                          rows=torch.tensor([0, 3, 4]), output_hidden=(0, 2, -1))
    out += [verified.logits, verified.hidden]
    lm._move(start, [0, 2, 4])
    lm.crop(start + 3)
    out.append(lm.forward(tokens(2), num_logits=1).logits)
    return out


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", ["qwen2", "llama", "mistral", "qwen3"])
def test_the_lean_loop_gives_transformers_logits_hidden_states_and_cache(kind, bits):
    lean, reference = _pair(kind, bits)
    for ours, theirs in zip(_session(lean), _session(reference), strict=True):
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    for ours, theirs in zip(lean._cache.layers, reference._cache.layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@pytest.mark.parametrize("bits", BITS)
def test_a_layer_subset_runs_as_transformers_layers_run(bits, monkeypatch):
    """Layer skipping's `run_layers` on a lean model equals the same layers called through transformers."""
    lean, reference = _pair("qwen2", bits)
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1))
    lean.forward(prompt)
    reference.forward(prompt)
    new, allowed = torch.tensor([5, 9, 11]), skipping.causal_allowed(12, 3)
    results = []
    for lm in (lean, reference):
        if lm is reference:
            monkeypatch.setattr(skipping, "lean_decoder", lambda model: None)
        trace: list[torch.Tensor] = []
        with torch.inference_mode():
            hidden = skipping.run_layers(lm.model, [0, 2], new, torch.arange(12, 15), allowed, lm._cache, trace)
        results.append([hidden, *trace,
                        *(t for i in (0, 2) for t in (lm._cache.layers[i].keys, lm._cache.layers[i].values))])
    for ours, theirs in zip(*results, strict=True):
        assert torch.equal(ours, theirs)


def test_only_the_quantized_llama_family_is_lean():
    model = tiny_qwen2(seed=2, layers=2)
    assert lean_decoder(model) is None  # float: transformers' forward
    quantize_invariant(model, bits=8)  # in place: the kept answer follows the attention implementation
    assert lean_decoder(model) is not None
    phi3 = Phi3ForCausalLM(Phi3Config(**SIZES, pad_token_id=0)).eval()
    assert lean_decoder(quantize_invariant(phi3, bits=8)) is None  # a layer it does not write out


@pytest.mark.skipif(not int4.available(), reason="no int4 kernel")
def test_int4_query_key_value_run_as_one_product_on_shared_buffers():
    """On the int4 path each attention's three input products are one (`_fuse_projections`): its output is the
    three products side by side, bit for bit, and the three layers keep working on views of its buffers (no
    weights held twice)."""
    model = quantize_invariant(tiny_architecture("qwen2"), bits=4)
    attention = model.model.layers[1].self_attn
    states = torch.randn(5, SIZES["hidden_size"], generator=torch.Generator().manual_seed(3))
    separate = torch.cat([attention.q_proj.rows(states), attention.k_proj.rows(states),
                          attention.v_proj.rows(states)], 1)
    decoder = lean_decoder(model)
    fused = decoder.qkv[1]
    assert torch.equal(fused.rows(states), separate)
    assert torch.equal(torch.cat([p.rows(states) for p in (attention.q_proj, attention.k_proj, attention.v_proj)], 1),
                       separate)  # the views compute what the layers computed
    assert attention.k_proj.nibbles.untyped_storage().data_ptr() == fused.nibbles.untyped_storage().data_ptr()
    model = quantize_invariant(tiny_architecture("qwen2"), bits=8)
    assert lean_decoder(model).qkv == [None] * 3  # int8: three products
