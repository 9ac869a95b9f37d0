"""Drafter configurations the equivalence tests run through the engine (`equivalence/
test_drafter_configurations.py`, and on the quantized target `reference_vs_fast/test_quantized.py`): an
independent draft model that is the target itself (everything accepted), a noisy copy of it (partial
acceptance) or an unrelated model (almost everything rejected), as chains and trees (dynamic, budgeted,
fixed shapes), and prompt lookup; each a factory given the target and the unrelated model."""

from __future__ import annotations

from conftest import DRAFT_PRICES, noisy_copy, random_prompts
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.drafters.options import DEFAULT_CHOICES
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupTreeDrafter
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM

PROMPTS = random_prompts(12, seed=3)
LENGTHS = [1, 2, 7, 40]
CURVE = CostCurve.linear(0.05)  # a fixed cost curve: tests do not time anything
KINDS = ["self", "noisy", "noisy-fixed", "unrelated", "pld", "pld-unigram", "tree-self", "tree-noisy",
         "tree-noisy-budget", "tree-unrelated", "tree-fixed", "pld-tree", "pld-tree-budget"]


def drafters(target_model, other_model):
    return {
        "self": lambda: DraftModelDrafter(HFCausalLM(target_model), num_tokens=3, confidence_threshold=0,
                                            **DRAFT_PRICES),
        "noisy": lambda: DraftModelDrafter(HFCausalLM(noisy_copy(target_model, 0.3, 1)), num_tokens=4,
                                             **DRAFT_PRICES),
        "noisy-fixed": lambda: DraftModelDrafter(
            HFCausalLM(noisy_copy(target_model, 0.3, 2)), num_tokens=5, adaptive=False, confidence_threshold=0
        ),
        "unrelated": lambda: DraftModelDrafter(HFCausalLM(other_model), num_tokens=2, **DRAFT_PRICES),
        "pld": lambda: PromptLookupDrafter(max_ngram=3, num_tokens=6),
        "pld-unigram": lambda: PromptLookupDrafter(max_ngram=1, num_tokens=3),
        # token trees
        "tree-self": lambda: DraftModelTreeDrafter(  # a fixed shape: always 4 deep
            HFCausalLM(target_model), CURVE, choices=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)]
        ),
        "tree-noisy": lambda: DraftModelTreeDrafter(HFCausalLM(noisy_copy(target_model, 0.3, 1)), CURVE,
                                                     draft_cost=0.4),
        "tree-noisy-budget": lambda: DraftModelTreeDrafter(
            HFCausalLM(noisy_copy(target_model, 0.5, 4)), CURVE, draft_cost=0.4, top_k=3, width=2, max_depth=5,
            budget=7
        ),
        "tree-unrelated": lambda: DraftModelTreeDrafter(HFCausalLM(other_model), CURVE, draft_cost=0.4, budget=10),
        "tree-fixed": lambda: DraftModelTreeDrafter(HFCausalLM(noisy_copy(target_model, 0.3, 2)), CURVE,
                                                    choices=DEFAULT_CHOICES),
        "pld-tree": lambda: PromptLookupTreeDrafter(CURVE, max_ngram=2, num_tokens=6),
        "pld-tree-budget": lambda: PromptLookupTreeDrafter(CURVE, max_ngram=1, num_tokens=4, budget=5),
    }
