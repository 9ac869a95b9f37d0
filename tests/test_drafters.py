"""Drafters on their own: prompt lookup against a slow obviously-correct search; draft length policy."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.drafters.draft_model import best_draft_length
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, find_continuation
from specdecode.types import SamplingParams


def slow_find_continuation(context: list[int], ngram: int, max_tokens: int) -> list[int] | None:
    """The most recent earlier occurrence of the last n-gram, by a plain loop."""
    if len(context) <= ngram:
        return None
    tail = context[-ngram:]
    for start in range(len(context) - ngram - 1, -1, -1):
        if context[start : start + ngram] == tail:
            return context[start + ngram : start + ngram + max_tokens]
    return None


@settings(max_examples=300, deadline=None)
@given(
    context=st.lists(st.integers(0, 4), min_size=0, max_size=40),
    ngram=st.integers(1, 4),
    max_tokens=st.integers(1, 8),
)
def test_prompt_lookup_matches_slow_reference(context, ngram, max_tokens):
    fast = find_continuation(np.array(context, dtype=np.int64), ngram, max_tokens)
    slow = slow_find_continuation(context, ngram, max_tokens)
    assert (None if fast is None else fast.tolist()) == slow


def test_prompt_lookup_prefers_longest_ngram_and_latest_match():
    drafter = PromptLookupDrafter(max_ngram=2, num_tokens=3)
    #          a  b  X  Y  Z  c  b  P  Q  ... then "a b" again: the 2-gram "a b" matched -> X Y Z
    context = [1, 2, 10, 11, 12, 3, 2, 20, 21, 1, 2]
    draft = drafter.propose(context, 8, SamplingParams(), None)
    assert draft.tokens.tolist() == [10, 11, 12] and draft.probs is None
    # only the unigram "2" matches: its latest earlier occurrence is followed by 20, 21
    context = [5, 2, 10, 11, 3, 2, 20, 21, 7, 2]
    assert drafter.propose(context, 8, SamplingParams(), None).tokens.tolist() == [20, 21, 7]
    assert drafter.propose(context, 1, SamplingParams(), None).tokens.tolist() == [20]
    assert len(drafter.propose([1, 2, 3], 8, SamplingParams(), None)) == 0


def test_best_draft_length():
    lengths = range(1, 17)
    assert best_draft_length(0.05, 0.4, lengths) == 1  # hopeless drafter: draft as little as possible
    assert best_draft_length(0.999, 0.01, lengths) == 16  # near-perfect, nearly free: draft the most
    mid = best_draft_length(0.9, 0.3, lengths)
    assert 3 <= mid <= 8
    assert best_draft_length(0.9, 0.6, lengths) < mid  # dearer drafts: shorter chains


def test_adaptive_length_follows_acceptance(tiny_target):
    from specdecode.drafters.draft_model import DraftModelDrafter
    from specdecode.models.hf import HFCausalLM
    from specdecode.types import StepStats, Verdict

    drafter = DraftModelDrafter(HFCausalLM(tiny_target), num_tokens=4, draft_cost=0.2)
    stats = StepStats(0, 0, 0, 0.0, 0.0, 0)
    for _ in range(10):
        drafter.update(Verdict(num_drafted=4, num_accepted=4, tokens=(1,) * 5), stats)
    long = drafter.num_tokens
    for _ in range(30):
        drafter.update(Verdict(num_drafted=4, num_accepted=0, tokens=(1,)), stats)
    assert long > 4 and drafter.num_tokens == 1


def test_draft_tree_scores_are_the_draft_models_path_probabilities(tiny_target):
    """Every node of a draft tree, grown several nodes per draft forward with a tree mask over the draft's
    own cache, scores exactly the product of the draft model's sequential next-token probabilities
    along its path (which also pins each node's position id: one off and this fails)."""
    from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
    from specdecode.models.costs import CostCurve
    from specdecode.models.hf import HFCausalLM
    from specdecode.tree import structure

    choices = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]
    drafter = DraftModelTreeDrafter(HFCausalLM(tiny_target), CostCurve.linear(0.1), choices=choices)
    context = [3, 14, 15, 92, 65, 35]
    drafter.begin(context)
    draft = drafter.propose(context, 10, SamplingParams(), None)
    assert len(draft) == len(choices)
    reference = HFCausalLM(tiny_target)
    for node in range(len(draft)):
        path = [int(i) for i in structure.ancestor_mask(draft.parents)[node].nonzero().flatten()]
        score = 1.0
        for depth, i in enumerate(path):
            reference.reset()
            prefix = context + draft.tokens[path[:depth]].tolist()
            probs = reference.forward(torch.tensor(prefix), num_logits=1).logits[0].softmax(-1)  # [vocab]
            score *= float(probs[draft.tokens[i]])
        assert abs(float(drafter.last_scores[node]) - score) < 1e-5, (node, path)
