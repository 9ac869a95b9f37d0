"""Drafters on their own: prompt lookup against a slow obviously-correct search; draft length policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.drafters.draft_model import best_draft_length, common_prefix_length
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, find_continuation, find_starts
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
@given(shared=st.lists(st.integers(0, 3), max_size=300), a=st.lists(st.integers(0, 3), max_size=20),
       b=st.lists(st.integers(0, 3), max_size=20), near_end=st.sampled_from([1, 3, 64]))
def test_common_prefix_length_is_the_plain_loops(shared, a, b, near_end):
    """The draft model's sync compares slices rather than tokens: the length equals a token-by-token loop's
    wherever the first difference falls (a long shared prefix with short tails, as in decoding; a small
    `near_end` sends most differences through the halving)."""
    first, second = shared + a, shared + b
    plain = next((i for i, (x, y) in enumerate(zip(first, second)) if x != y), min(len(first), len(second)))
    assert common_prefix_length(first, second, near_end) == plain


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


@settings(max_examples=300, deadline=None)
@given(
    context=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    ngram=st.integers(1, 4),
    max_matches=st.integers(0, 6),
)
def test_every_earlier_occurrence_is_found_most_recent_first(context, ngram, max_matches):
    """`find_starts`: where the last n-gram occurred before (its window ending before the context's last token), most
    recent first, at most `max_matches`, as a plain loop finds them."""
    slow = [start for start in range(len(context) - ngram - 1, -1, -1)
            if len(context) > ngram and context[start : start + ngram] == context[-ngram:]][:max_matches]
    assert find_starts(np.array(context, dtype=np.int64), ngram, max_matches).tolist() == slow


def test_prompt_lookup_follows_a_growing_context_and_notices_another():
    """The drafter keeps the context's ids from step to step and adds what it gained (`_ids_of`): as it grows, each
    proposal is a fresh drafter's; handed another context (no `begin` between), it drafts from that one."""
    rng = np.random.default_rng(0)
    context = rng.integers(0, 6, size=300).tolist()
    kept = PromptLookupDrafter(ramp_up=False)
    for length in range(20, 300, 7):
        fresh = PromptLookupDrafter(ramp_up=False)
        assert (kept.propose(context[:length], 8, SamplingParams(), None).tokens.tolist()
                == fresh.propose(context[:length], 8, SamplingParams(), None).tokens.tolist())
    for size in (400, 200):  # longer than the context seen (its last tokens differ), then shorter
        other = rng.integers(0, 6, size=size).tolist()
        assert (kept.propose(other, 8, SamplingParams(), None).tokens.tolist()
                == PromptLookupDrafter(ramp_up=False).propose(other, 8, SamplingParams(), None).tokens.tolist())


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
    from specdecode.models.costs import CostCurve

    flat = CostCurve.linear(0.03)
    lengths = range(1, 17)
    assert best_draft_length(0.05, 0.4, lengths, flat) == 1  # hopeless drafter: draft as little as possible
    # near-perfect, nearly free: draft the most that fills a measured batch size (15 + 1 = 16 tokens;
    # 17 would be charged as 24)
    assert best_draft_length(0.999, 0.01, lengths, flat) == 15
    mid = best_draft_length(0.9, 0.3, lengths, flat)
    assert 3 <= mid <= 8
    assert best_draft_length(0.9, 0.6, lengths, flat) < mid  # dearer drafts: shorter chains
    assert best_draft_length(0.05, 0.4, range(0, 17), flat) == 0  # hopeless, and allowed to stop: stop
    # llama.cpp on this CPU: 2 tokens cost 1.66 forwards; a draft token 0.59. Even a 95% drafter loses.
    llama = CostCurve((1, 2, 4, 8, 16), (1.0, 1.66, 2.59, 4.63, 5.36))
    assert best_draft_length(0.95, 0.59, range(0, 17), llama) == 0
    assert best_draft_length(0.95, 0.59, range(0, 17), flat) >= 3


def test_adaptive_length_follows_acceptance(tiny_target):
    from specdecode.drafters.draft_model import PROBE_EVERY, DraftModelDrafter
    from specdecode.models.costs import CostCurve
    from specdecode.models.hf import HFCausalLM
    from specdecode.drafters.base import Outcome
    from specdecode.types import Draft, StepStats, Verdict

    drafter = DraftModelDrafter(HFCausalLM(tiny_target), num_tokens=4, draft_cost=0.2,
                                curve=CostCurve.linear(0.03))
    stats = StepStats(0, 0, 0, 0.0, 0.0, 0)
    for _ in range(10):
        drafter.observe(Outcome(Draft.empty(), Verdict(num_drafted=4, num_accepted=4, tokens=(1,) * 5), stats))
    long = drafter.num_tokens
    for _ in range(30):
        drafter.observe(Outcome(Draft.empty(), Verdict(num_drafted=4, num_accepted=0, tokens=(1,)), stats))
    assert long > 4 and drafter.num_tokens == 0  # off ...
    context, params = list(range(1, 9)), SamplingParams()
    lengths = [len(drafter.propose(context, 8, params, None)) for _ in range(3 * PROBE_EVERY)]
    assert lengths == ([0] * (PROBE_EVERY - 1) + [1]) * 3  # ... but probing now and then

    # where even a near-perfect draft could not pay, off means off: no probes
    drafter = DraftModelDrafter(HFCausalLM(tiny_target), num_tokens=4, draft_cost=0.59,
                                curve=CostCurve((1, 2, 4, 8, 16), (1.0, 1.66, 2.59, 4.63, 5.36)))
    drafter.observe(Outcome(Draft.empty(), Verdict(num_drafted=4, num_accepted=4, tokens=(1,) * 5), stats))
    assert drafter.num_tokens == 0
    assert all(len(drafter.propose(context, 8, params, None)) == 0 for _ in range(3 * PROBE_EVERY))


def test_prompt_lookup_scores_follow_the_match_length():
    """A continuation behind a long match is scored as likelier than one behind a short one, and every
    proposal, verified or not, is judged against the output as it arrives."""
    from specdecode.drafters.prompt_lookup import CopyAcceptance, match_length, match_length_forward

    ids = np.array([7, 1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 4, 5])
    assert match_length(ids, 6, 64) == 5 and match_length(ids, 6, 3) == 3 and match_length(ids, 2, 64) == 0
    assert match_length_forward(ids, 1, 8, 5) == 5 and match_length_forward(ids, 0, 8, 5) == 0
    drafter = PromptLookupDrafter(max_ngram=3)
    long = drafter.propose(ids.tolist(), 8, SamplingParams(), None)  # "1 2 3 4 5" matched
    short = drafter.propose([7, 1, 2, 3, 8, 8, 3], 8, SamplingParams(), None)  # only "3" matches
    assert long.tokens.tolist()[:2] == [9, 9] and short.tokens.tolist()[:2] == [8, 8]
    assert long.scores[0] > short.scores[0] and bool((long.scores[1:] < long.scores[:-1]).all())
    # learning: in a request whose copies keep failing, every kind of match scores lower than its prior
    acceptance, prior = CopyAcceptance(), CopyAcceptance()
    for _ in range(5):
        acceptance.record(3, 0, 16)
    for bucket in range(8):
        assert acceptance.scores(bucket, 1)[0] < prior.scores(bucket, 1)[0] / 1.5
    # copies that start right but break after 2 tokens: first tokens score higher, later ones lower
    acceptance = CopyAcceptance()
    for _ in range(5):
        acceptance.record(2, 2, 16)
    assert acceptance.scores(2, 4)[0] > prior.scores(2, 4)[0] and acceptance.scores(2, 4)[3] < prior.scores(2, 4)[3]
    # copies that run the whole judged length: later tokens score higher than the prior says
    acceptance = CopyAcceptance()
    for _ in range(5):
        acceptance.record(2, 16, 16)
    assert acceptance.scores(2, 16)[15] > prior.scores(2, 16)[15]
    # judging without verification: the drafter proposed [9, 9, 1, ...] after ids; the output went on 9, 9, 6
    drafter = PromptLookupDrafter(max_ngram=3)
    drafter.propose(ids.tolist(), 8, SamplingParams(), None)
    (bucket, _, _), = drafter._open
    before = drafter._acceptance.scores(bucket, 3)
    drafter.propose(ids.tolist() + [9, 9, 6], 8, SamplingParams(), None)
    after = drafter._acceptance.scores(bucket, 3)
    assert after[0] > before[0] and after[2] < before[2]  # the first was right; the third wrong


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


def test_prompt_lookup_copies_from_a_reference_document():
    """With a reference, a context n-gram found only there is continued from it; the separator keeps
    a match from running across the reference's end into the context."""
    drafter = PromptLookupDrafter(max_ngram=2, reference_ids=[40, 41, 42, 43, 44])
    draft = drafter.propose([1, 2, 41, 42], 8, SamplingParams(), None)
    assert draft.tokens.tolist() == [43, 44]
    assert len(PromptLookupDrafter(max_ngram=2).propose([1, 2, 41, 42], 8, SamplingParams(), None)) == 0
    # the reference's last tokens are not followed by the context's first ones
    drafter = PromptLookupDrafter(max_ngram=1, reference_ids=[7, 8])
    assert len(drafter.propose([9, 8], 8, SamplingParams(), None)) == 0


def test_draft_tree_size_does_not_grow_with_the_draft_models_catch_up():
    """The dynamic tree's size follows what its nodes promise against the target's cost curve, not the
    drafting already spent in the step: the same context gives the same tree whether the draft model
    first catches up on 300 tokens (a sequence's first step, or the first after plain steps) or on one.
    (When that catch-up counted, the real int4 target verified 47-64-node trees after every catch-up.)"""
    import fakes

    from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
    from specdecode.models.costs import CostCurve

    draft_model = fakes.FakeLM(fakes.ContextLogits(vocab=6, seed=11, scale=3.0), max_context=1024)
    # width dear, as on a CPU without bf16 units: 8 tokens cost 3.1 one-token forwards
    drafter = DraftModelTreeDrafter(draft_model, CostCurve.linear(0.3), draft_cost=0.4)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, 6, (300,), generator=generator).tolist()
    drafter.begin(context)
    cold = drafter.propose(context, 16, SamplingParams(), None)  # feeds all 300 context tokens first
    warm = drafter.propose(context, 16, SamplingParams(), None)  # feeds the last one only
    assert len(cold) > 0
    assert cold.tokens.tolist() == warm.tokens.tolist() and cold.parents.tolist() == warm.parents.tolist()


def test_a_draft_model_is_priced_by_measurement_or_by_the_caller(tiny_target):
    """An adaptive chain and a growing tree weigh a draft forward's cost against verification's: without
    prices given (nor measured, `for_models`) they refuse to start, saying so; a fixed length or shape needs
    none. `for_models` prices from the two models' measured curves."""
    from specdecode.drafters.draft_model import DraftModelDrafter
    from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
    from specdecode.errors import UserError
    from specdecode.models import costs
    from specdecode.models.costs import CostCurve
    from specdecode.models.hf import HFCausalLM

    draft = HFCausalLM(tiny_target)
    with pytest.raises(UserError, match="for_models"):
        DraftModelDrafter(draft)
    with pytest.raises(UserError, match="for_models"):
        DraftModelDrafter(draft, draft_cost=0.3)  # no curve to weigh it against
    with pytest.raises(UserError, match="for_models"):
        DraftModelTreeDrafter(draft, CostCurve.linear(0.1))
    assert DraftModelDrafter(draft, adaptive=False).draft_cost is None
    assert DraftModelTreeDrafter(draft, CostCurve.linear(0.1), choices=[(0,), (0, 0)]).draft_cost is None
    target = HFCausalLM(tiny_target)
    chain = DraftModelDrafter.for_models(draft, target)
    assert chain.draft_cost == pytest.approx(costs.draft_cost(draft, target)) and chain.curve == target.cost_curve()


def test_prompt_lookup_judges_copies_from_a_short_loop():
    """An output looping with a period shorter than the judged window copies fewer tokens than the window:
    each such proposal is judged once the output has gone as far as it could offer, so the proposals left
    to judge stay a period's worth however long the loop runs (they piled up, and judging them grew with every step),
    and a loop that keeps repeating raises what later copies score."""
    drafter = PromptLookupDrafter(max_ngram=3)
    loop = [5, 6, 7, 8]
    context = [1, 2, 3] + loop * 2
    first = drafter.propose(context, 8, SamplingParams(), None)
    assert first.tokens.tolist() == loop
    for _ in range(60):
        context += loop[:1]
        loop = loop[1:] + loop[:1]
        drafter.propose(context, 8, SamplingParams(), None)
    assert len(drafter._open) <= len(loop)  # those the output has not yet gone a period past
    later = drafter.propose(context, 8, SamplingParams(), None)
    assert later.scores[-1] > first.scores[-1]
