"""Shared fixtures: tiny randomly initialised Qwen2 models (the real architecture, no download)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdecode.models.hf import HFCausalLM

VOCAB = 97


def tiny_qwen2(seed: int, layers: int = 2, hidden: int = 64, vocab: int = VOCAB, dtype=torch.float32) -> Qwen2ForCausalLM:
    """A tiny Qwen2 with peaky enough logits that greedy continuations are varied but not degenerate."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # larger output weights make the distributions less flat
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


@pytest.fixture(scope="session")
def tiny_target() -> Qwen2ForCausalLM:
    return tiny_qwen2(seed=0, layers=3)


@pytest.fixture(scope="session")
def tiny_drafter() -> Qwen2ForCausalLM:
    return tiny_qwen2(seed=1, layers=1, hidden=32)


@pytest.fixture
def target_lm(tiny_target) -> HFCausalLM:
    return HFCausalLM(tiny_target)


def random_prompts(count: int, seed: int = 0, low: int = 3, high: int = 24, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lengths]


class LetterTokenizer:
    """A stand-in tokenizer for engine tests: token i decodes to one letter (a..z, cycling)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)
