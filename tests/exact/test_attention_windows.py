"""A model whose layers attend to a window of the context (Mistral's `sliding_window`, Gemma's window layers) keeps
every sequence within its narrowest window (`HFCausalLM.max_context`): the masks of trees and batches, the lean and
static decoders and cropping by slot all see the whole context, which within the window is what the model sees. Past
it they ignored the window: a Mistral with `sliding_window` set gave other tokens than transformers' own forward, on
the lean (int8, int4) and static paths and under tree masks."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma2Config, MistralConfig, MistralForCausalLM, Qwen2Config

from conftest import FLAT, SIZES, LetterTokenizer, random_prompts
from specdecode.drafters.prompt_lookup import PromptLookupTreeDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine.batch import BatchEngine
from specdecode.errors import UserError
from specdecode.models.cache import GrowingLayer, attention_window
from specdecode.models.hf import HFCausalLM
from specdecode.models.int8 import quantize_invariant
from specdecode.models.static import StaticCausalLM

WINDOW = 24


def test_the_narrowest_window_of_each_kind_of_config():
    assert attention_window(MistralConfig(**SIZES, sliding_window=WINDOW)) == WINDOW
    assert attention_window(MistralConfig(**SIZES, sliding_window=4096)) is None  # wider than its 512 positions
    assert attention_window(MistralConfig(**SIZES, sliding_window=None)) is None
    assert attention_window(Qwen2Config()) is None  # a window only with use_sliding_window
    assert attention_window(Qwen2Config(use_sliding_window=True, num_hidden_layers=4, max_window_layers=2)) == 4096
    assert attention_window(Gemma2Config(num_hidden_layers=2)) == 4096  # window and full layers in turn


@pytest.fixture(scope="module")
def windowed():
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**SIZES, sliding_window=WINDOW)).eval()


def test_a_windowed_model_decodes_within_its_window_as_transformers_does(windowed):
    """Greedy decoding runs to the window's end and no further, and every path gives transformers' own tokens:
    plain, a tree drafter, the batch, the int8 lean decoder (against transformers' forward of the same weights) and
    the static decoder. A prompt the window cannot hold is refused in words."""
    prompt = (random_prompts(1, seed=4)[0] * 3)[:10]  # repeats: the tree drafter finds something to copy
    config = GenerationConfig(max_new_tokens=40)
    expected = windowed.generate(torch.tensor([prompt]), max_new_tokens=WINDOW - len(prompt), do_sample=False)
    expected = expected[0, len(prompt):].tolist()
    plain = HFCausalLM(windowed)
    assert plain.max_context == WINDOW and all(type(layer) is GrowingLayer for layer in plain._cache.layers)
    assert SpeculativeEngine(plain).generate(prompt, config).token_ids == expected
    tree = SpeculativeEngine(HFCausalLM(windowed), drafter=PromptLookupTreeDrafter(FLAT, budget=6), gate=False)
    result = tree.generate(prompt, config)
    assert result.token_ids == expected and sum(step.drafted for step in result.steps) > 0
    batch = BatchEngine(HFCausalLM(windowed), LetterTokenizer())
    ident, outputs = batch.add(prompt, config), []
    while batch.members:
        outputs += [t for i, event, _ in batch.step() if i == ident for t in event.token_ids]
    assert outputs == expected
    assert SpeculativeEngine(StaticCausalLM(windowed)).generate(prompt, config).token_ids == expected
    quantized = quantize_invariant(copy.deepcopy(windowed), bits=8)
    lean, reference = HFCausalLM(quantized), HFCausalLM(quantized)
    assert lean._lean is not None
    reference._lean = None
    assert SpeculativeEngine(lean).generate(prompt, config).token_ids == \
        SpeculativeEngine(reference).generate(prompt, config).token_ids
    with pytest.raises(UserError, match=f"attend to a window of {WINDOW} tokens"):
        SpeculativeEngine(HFCausalLM(windowed)).generate(random_prompts(1, seed=5)[0] * 9, config)
