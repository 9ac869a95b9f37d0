"""Statistical, end to end: sampled output through the engine follows the target's distribution, whatever
drafts it (chains and trees, sampled or fixed, merged by a composite, from trained heads); and a tree sent
with distributions its nodes were not drawn from is refused, since it would not."""

from __future__ import annotations

import pytest
import torch

from conftest import random_eagle3_head, random_medusa_heads, tiny_qwen2
import fakes
from fakes import FakeLM, IndependentTreeDrafter, TopKTreeDrafter
from goodness_of_fit import (
    assert_engine_follows_target, assert_follows, chi_square, continuations, engine_outcomes, model_logits,
)
from specdecode.drafters.composite import CompositeDrafter, Source
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.drafters.eagle import EagleTreeDrafter
from specdecode.drafters.eagle_head import EagleHead, head_config
from specdecode.drafters.eagle3 import Eagle3TreeDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupTreeDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.types import SamplingParams

# --- The output follows the target's distribution ------------------------------------------
#
# Each case counts the first tokens of thousands of seeded runs against their exact distribution,
# enumerated from the target's logits with temperature, top-k and top-p written plainly in the test
# (goodness_of_fit.continuations), and asserts a chi-square p-value above 1e-4 with power at least 0.9
# against any 5% total-variation error in those tokens (goodness_of_fit.assert_follows checks the power
# from the runs and the cells compared; each case's figure is in its comment).
#
# On fake models (fakes.py: 4 tokens, logits a fixed function of the context, a few milliseconds a run)
# three tokens are counted: the first step drafts two deep, so the third token is the bonus after a
# wholly accepted depth-2 draft or comes from a later step over the cache as a rejection left it. Each
# case asserts that deep drafts, bonus tokens after two accepted ones and corrections all happened.

FREE = CostCurve.linear(0.0)
FAKE_CASES = {  # kind: (drafter, sampling, runs); fakes.TARGET after fakes.PROMPT, fakes.DRAFT to draft from
    # a draft model's sampled chain, verified with its probs: 41 cells, power 0.91
    "chain": (lambda: DraftModelDrafter(FakeLM(fakes.DRAFT), num_tokens=2, adaptive=False, confidence_threshold=0),
              SamplingParams(0.8, top_p=0.9), 6600),
    # the same chain on the draft model's default CPU path (a confidence threshold: `DraftModelDrafter._draft`, which
    # may stop early), with top-k and top-p together (top-p after top-k: the other order moves 0.165 of the mass
    # here): 10 cells, power 0.92
    "chain-stops-early": (lambda: DraftModelDrafter(FakeLM(fakes.DRAFT), num_tokens=2, adaptive=False,
                                                    confidence_threshold=0.05),
                          SamplingParams(0.8, top_k=3, top_p=0.8), 4300),
    # a draft model's fixed-shape tree of top-k children (one-hot): 27 cells, power 0.91
    "draft-tree": (lambda: DraftModelTreeDrafter(FakeLM(fakes.DRAFT), CostCurve.linear(0.05),
                                                 choices=[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]),
                   SamplingParams(1.0, top_k=3), 5700),
    # a prompt-lookup trie (fixed branches), no truncation: 64 cells, power 0.90
    "pld-tree": (lambda: PromptLookupTreeDrafter(FREE, max_ngram=1, num_tokens=2), SamplingParams(1.0), 7700),
    # two children of the context and two of each drawn i.i.d. from the drafter, with probs: 27 cells, power 0.91
    "iid-tree": (lambda: IndependentTreeDrafter(fakes.DRAFT, widths=(2, 2)), SamplingParams(0.9, top_k=3), 5700),
    # three i.i.d. children of the context, one under each, with probs: 39 cells, power 0.90
    "iid-tree-wide": (lambda: IndependentTreeDrafter(fakes.DRAFT, widths=(3, 1)),
                      SamplingParams(1.2, top_p=0.85), 6400),
    # prompt lookup merged with a draft model's sampled chain, submitted as fixed nodes (probs dropped,
    # `exact/test_composite.py`): 27 cells, power 0.91
    "composite": (lambda: CompositeDrafter(
        [PromptLookupTreeDrafter(FREE, max_ngram=1, num_tokens=2),
         Source(DraftModelDrafter(FakeLM(fakes.DRAFT), num_tokens=2, adaptive=False, confidence_threshold=0),
                "expensive")], FREE, fallback_below=float("inf")),
        SamplingParams(1.0, top_k=3), 5700),
}


@pytest.mark.parametrize("kind", list(FAKE_CASES))
def test_sampled_output_follows_target_distribution(kind, one_thread):
    make, params, runs = FAKE_CASES[kind]
    assert_engine_follows_target(make(), params, runs, kind)


def test_tree_probs_need_independently_drawn_nodes(one_thread):
    """A tree of the drafter's top-2 children sent with the distributions they were ranked by: the
    engine refuses it (Draft.drawn_independently); a drafter that claims independence anyway produces
    output far from the target's (total variation 0.73 in the first three tokens), which is why."""
    params = SamplingParams(1.0)
    config = GenerationConfig(max_new_tokens=3, sampling=params, seed=0)
    with pytest.raises(ValueError, match="drawn_independently"):
        SpeculativeEngine(FakeLM(fakes.TARGET), drafter=TopKTreeDrafter(fakes.DRAFT)).generate(fakes.PROMPT, config)
    liar = SpeculativeEngine(FakeLM(fakes.TARGET), drafter=TopKTreeDrafter(fakes.DRAFT, claim_independent=True))
    outcomes = engine_outcomes(liar, fakes.PROMPT, 3, params, 1000)
    expected = continuations(fakes.TARGET, fakes.PROMPT, 3, params).flatten()
    assert 0.5 * float((outcomes.counts / outcomes.runs - expected).abs().sum()) > 0.4
    assert chi_square(outcomes.counts, expected)[0] < 1e-12


# On the tiny Qwen2 (the real architecture), the drafters that need its hidden states: an EAGLE head's
# dynamic tree and Medusa heads' tree, both from the second step on (they draft from the first forward's
# features), so four tokens are generated and the tree verified at the second step makes the second
# (and more). A run costs several milliseconds here, so these check the integration with power 0.9
# against a 10% error: the first two tokens over a vocabulary of 3, 1,200 runs over 9 cells, chi-square
# at 1e-4, power 0.97 against 10% (0.08 against 5%, which the fake-model cases above carry for the
# same verification of one-hot trees).
REAL_VOCAB, REAL_RUNS = 3, 1200


@pytest.mark.parametrize("kind", ["eagle-tree", "medusa-tree", "auto"])
def test_sampled_output_of_trained_heads_follows_target_distribution(kind, one_thread):
    """`auto`: the composite `auto` builds where heads ship (prompt lookup, the suffix cache, Medusa's and
    EAGLE-3's trees), its sources as `drafters.auto` gives them."""
    target_model = tiny_qwen2(seed=21, layers=3 if kind == "auto" else 2, hidden=32, vocab=REAL_VOCAB)
    with torch.no_grad():  # flatten the distributions so every pair has mass
        target_model.lm_head.weight.mul_(0.15)
    prompt = [1, 0, 2, 1, 0, 2, 2, 0, 2]
    params = SamplingParams(temperature=1.0)
    drafter = {
        "eagle-tree": lambda: EagleTreeDrafter(
            EagleHead(head_config(target_model.config, 16), torch.arange(REAL_VOCAB)).eval(), target_model,
            FREE, draft_cost=1e-3, top_k=2, width=2, max_depth=2),
        "medusa-tree": lambda: MedusaDrafter(random_medusa_heads(target_model), target_model, FREE,
                                             tree=True, top_k=2, max_nodes=6, draft_cost=1e-3),
        "auto": lambda: CompositeDrafter([
            PromptLookupDrafter(), SuffixDrafter(FREE, tree=True),
            MedusaDrafter(random_medusa_heads(target_model), target_model, FREE, tree=True, top_k=2, max_nodes=6,
                          draft_cost=1e-3),
            Eagle3TreeDrafter(random_eagle3_head(target_model), target_model, FREE, draft_cost=1e-3, top_k=2,
                              width=2, max_depth=2)], FREE, final_layer=3),
    }[kind]()
    engine = SpeculativeEngine(HFCausalLM(target_model), drafter=drafter)
    engine.curve = FREE  # nothing timed
    outcomes = engine_outcomes(engine, prompt, 2, params, REAL_RUNS, max_new_tokens=4)
    assert outcomes.deep_drafts > REAL_RUNS // 2  # the second token came through a verified tree
    assert_follows(outcomes.counts, continuations(model_logits(target_model), prompt, 2, params), kind, tv=0.1)
