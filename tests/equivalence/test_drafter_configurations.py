"""Equivalence, drafter by configuration: greedy speculative output == plain greedy output of the target.

Tiny randomly initialised Qwen2 models in float32 (exact arithmetic comparisons are meaningful there).
The configurations (`configurations.py`) go beyond each method's defaults, which `test_every_method.py`
covers: three kinds of draft model exercise every path of the loop, the target itself (everything
accepted), a noisy copy of it (partial acceptance) and an unrelated model (almost everything rejected).
"""

from __future__ import annotations

import copy

import pytest
import torch

from configurations import KINDS, LENGTHS, PROMPTS, drafters
from conftest import DRAFT_PRICES, greedy_references, greedy_runs, noisy_copy
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.models.hf import HFCausalLM


@pytest.fixture(scope="module")
def reference(tiny_target):
    """Plain greedy continuations from transformers' own generate()."""
    return dict(enumerate(greedy_references(tiny_target, PROMPTS, max(LENGTHS))))


def test_plain_decoding_equals_transformers_generate(tiny_target, reference):
    engine = SpeculativeEngine(HFCausalLM(tiny_target))
    for i, prompt in enumerate(PROMPTS):
        for n in LENGTHS:
            result = engine.generate(prompt, GenerationConfig(max_new_tokens=n))
            assert result.token_ids == reference[i][:n]
            assert result.target_forwards == n and result.mean_accepted_tokens == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_equals_plain(kind, tiny_target, tiny_drafter, reference):
    drafter = drafters(tiny_target, tiny_drafter)[kind]()
    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=drafter)
    *_, (_, _, result) = greedy_runs(engine, PROMPTS, reference, LENGTHS)  # checked as it runs; the last kept
    if kind == "self":  # a perfect drafter: every draft accepted, several tokens per forward
        assert result.acceptance_rate == 1.0 and result.mean_accepted_tokens > 3
    if kind == "tree-self":  # the target's own argmax path is in every tree: several tokens per forward
        assert result.mean_accepted_tokens > 3


def test_engine_reused_across_prompts_and_methods_share_target(tiny_target, tiny_drafter, reference):
    """One target model object serves several engines in turn; caches never leak between runs."""
    target = HFCausalLM(tiny_target)
    engines = [SpeculativeEngine(target, drafter=make()) for make in drafters(tiny_target, tiny_drafter).values()]
    for i in [0, 5, 0]:
        for engine in engines:
            assert engine.generate(PROMPTS[i], GenerationConfig(max_new_tokens=25)).token_ids == reference[i][:25]


def test_bfloat16_models_run_and_mostly_agree(tiny_target):
    """bf16 is the CPU default: the loop runs there too (exactness is only asserted in float32)."""
    model = copy.deepcopy(tiny_target).to(torch.bfloat16)
    drafter = DraftModelDrafter(HFCausalLM(noisy_copy(model.float(), 0.1, 3).to(torch.bfloat16)),
                                **DRAFT_PRICES)
    plain = SpeculativeEngine(HFCausalLM(model)).generate(PROMPTS[1], GenerationConfig(max_new_tokens=30))
    spec = SpeculativeEngine(HFCausalLM(model), drafter=drafter).generate(PROMPTS[1],
                                                                          GenerationConfig(max_new_tokens=30))
    assert len(spec.token_ids) == 30
    assert spec.token_ids[:5] == plain.token_ids[:5]
