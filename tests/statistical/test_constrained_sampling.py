"""Statistical, end to end: under a constraint, sampled output follows the constrained target distribution
(the target's logits with what the grammar forbids after each prefix at -inf), whatever drafts it: a
sampled chain with its probabilities (a forbidden draft token stays, to be rejected with its residual), a
tree of i.i.d. children with theirs, and fixed one-hot branches (forbidden ones pruned).

The fake models' four tokens are given a tokenizer: a, b, c and an end token. The regular expression
`[ab][ac][abc]+` allows {a, b} first, {a, c} second, {a, b, c} third (the end only after three letters), so
the exact distribution of the first three tokens is the fake target's, masked by those sets: written here
by hand, without the grammar engine under test.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

import fakes
from fakes import FakeLM, IndependentTreeDrafter
from goodness_of_fit import assert_follows, continuations, engine_outcomes
from specdecode.constraints import Constraint
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupTreeDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.models.costs import CostCurve
from specdecode.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

# regular expression: the tokens (a=0, b=1, c=2) it allows at each of the first three positions
ALLOWED = {"[ab][ac][abc]+": [{0, 1}, {0, 2}, {0, 1, 2}],
           "[ab]c[abc]+": [{0, 1}, {2}, {0, 1, 2}]}  # c forced second: drafted from the grammar (`engine.forced`)
FREE = CostCurve.linear(0.0)


def four_token_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "c": 2}, merges=[]))
    backend.decoder = decoders.ByteLevel()  # (a, b and c are their own byte-level symbols)
    backend.add_special_tokens([AddedToken("<end>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<end>")


def constrained_target(regex: str):
    """The fake target's logits after a sequence (the prompt, then generated tokens), masked by hand."""

    def logits(sequence: tuple[int, ...]) -> torch.Tensor:
        masked = fakes.TARGET(sequence).clone()
        position = len(sequence) - len(fakes.PROMPT)
        allowed = ALLOWED[regex][min(position, 2)]
        masked[[t for t in range(fakes.VOCAB) if t not in allowed]] = float("-inf")
        return masked

    return logits


def chain():
    return DraftModelDrafter(FakeLM(fakes.DRAFT), num_tokens=2, adaptive=False, confidence_threshold=0)


CASES = {  # kind: (drafter, regular expression, sampling, runs); 12 cells at most (2 x 2 x 3), power 0.9 at
    # a total variation of 0.08
    "chain": (chain, "[ab][ac][abc]+", SamplingParams(0.9), 2000),
    "iid-tree": (lambda: IndependentTreeDrafter(fakes.DRAFT, widths=(2, 2)), "[ab][ac][abc]+",
                 SamplingParams(1.0, top_k=3), 2000),
    "pld-tree": (lambda: PromptLookupTreeDrafter(FREE, max_ngram=1, num_tokens=2), "[ab][ac][abc]+",
                 SamplingParams(1.0), 2000),
    "chain-after-forced": (chain, "[ab]c[abc]+", SamplingParams(0.9), 2000),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_sampled_output_follows_the_constrained_target(kind):
    make, regex, params, runs = CASES[kind]
    engine = SpeculativeEngine(FakeLM(fakes.TARGET), four_token_tokenizer(), drafter=make())
    outcomes = engine_outcomes(engine, fakes.PROMPT, 3, params, runs, constraint=Constraint.regex(regex))
    assert outcomes.corrections > 0.05 * runs  # forbidden or disagreeing drafts were rejected
    assert outcomes.deep_drafts > 0.05 * runs
    expected = continuations(constrained_target(regex), fakes.PROMPT, 3, params)
    assert_follows(outcomes.counts, expected, kind, tv=0.08)


def test_every_sampled_output_matches_the_constraint():
    """Longer sampled outputs, ended by the end token once the grammar allows it: each matches the regex."""
    import re

    engine = SpeculativeEngine(FakeLM(fakes.TARGET), four_token_tokenizer(),
                               drafter=IndependentTreeDrafter(fakes.DRAFT, widths=(2, 2)))
    pattern = "[ab][ac][abc]{0,3}"  # a finite language: every run ends by the grammar, not by length
    ended = 0
    for seed in range(40):
        config = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(1.0), seed=seed,
                                  constraint=Constraint.regex(pattern))
        result = engine.generate(fakes.PROMPT, config)
        assert result.finish_reason == "eos"
        text = "".join("abc"[t] for t in result.token_ids if t < 3)
        assert re.fullmatch(pattern, text), text
        ended += 1
    assert ended == 40
