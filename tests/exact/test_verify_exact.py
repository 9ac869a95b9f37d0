"""Exact cases: peaked logits whose verdict is known by hand."""

import pytest
import torch

from specdecode.sampling import logits_to_probs
from specdecode.types import Draft, SamplingParams
from specdecode.verify.chain import residual_distribution, verify_chain, verify_greedy, verify_speculative_sampling

V = 6


def peaked(tokens: list[int], height: float = 20.0) -> torch.Tensor:
    """[len(tokens), V] logits with a sharp peak at each given token."""
    logits = torch.zeros(len(tokens), V)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = height
    return logits


def test_greedy_accepts_matching_prefix_then_corrects():
    verdict = verify_greedy(peaked([1, 2, 5, 0]), torch.tensor([1, 2, 3]))
    assert (verdict.num_accepted, verdict.tokens, verdict.bonus) == (2, (1, 2, 5), False)


def test_greedy_all_accepted_gives_bonus():
    verdict = verify_greedy(peaked([1, 2, 3, 4]), torch.tensor([1, 2, 3]))
    assert (verdict.num_accepted, verdict.tokens, verdict.bonus) == (3, (1, 2, 3, 4), True)


def test_greedy_first_token_rejected():
    verdict = verify_greedy(peaked([4, 2]), torch.tensor([1]))
    assert (verdict.num_accepted, verdict.tokens) == (0, (4,))


def test_greedy_empty_draft_is_plain_decoding():
    verdict = verify_greedy(peaked([3]), torch.tensor([], dtype=torch.long))
    assert (verdict.num_drafted, verdict.num_accepted, verdict.tokens) == (0, 0, (3,))


def test_sampling_accepts_when_target_dominates_draft():
    # target puts all mass on the drafted tokens: min(1, target/draft) = 1 -> always accepted
    target_probs = torch.softmax(peaked([2, 3, 1], height=50.0), -1)
    draft_probs = torch.full((2, V), 1.0 / V)
    for seed in range(20):
        verdict = verify_speculative_sampling(
            target_probs, torch.tensor([2, 3]), draft_probs, torch.Generator().manual_seed(seed)
        )
        assert verdict.tokens == (2, 3, 1) and verdict.bonus


def test_sampling_rejects_token_target_excludes_and_resamples_from_residual():
    target_probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0], [1.0 / V] * V])
    draft_probs = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    seen = set()
    for seed in range(50):
        verdict = verify_speculative_sampling(
            target_probs, torch.tensor([3]), draft_probs, torch.Generator().manual_seed(seed)
        )
        assert verdict.num_accepted == 0
        seen.add(verdict.tokens[0])
    assert seen == {1, 2}


def test_one_hot_draft_is_accepted_with_target_probability():
    # deterministic draft (no probs): accept token x with probability target(x)
    target_probs = torch.tensor([[0.25, 0.75, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1.0]])
    accepted = sum(
        verify_speculative_sampling(target_probs, torch.tensor([1]), None,
                                    torch.Generator().manual_seed(s)).num_accepted
        for s in range(4000)
    )
    assert abs(accepted / 4000 - 0.75) < 0.03


def test_residual_distribution_by_hand():
    target = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0])
    draft = torch.tensor([0.2, 0.6, 0.2, 0, 0, 0])
    assert torch.allclose(residual_distribution(target, draft), torch.tensor([1.0, 0, 0, 0, 0, 0]))


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0 + 1e-9, 1e-9]))
    top2 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([2 / 3, 1 / 3, 0, 0, 0, 0]), atol=1e-6)
    nucleus = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.25 < 0.8 -> 3 kept
    assert torch.allclose(nucleus, torch.tensor([0.5, 0.25, 0.15, 0, 0, 0]) / 0.9, atol=1e-6)
    greedy = logits_to_probs(logits, SamplingParams())
    assert greedy.tolist() == [1.0, 0, 0, 0, 0, 0]


def test_verify_chain_dispatches_on_temperature():
    logits = peaked([1, 2])
    draft = Draft(tokens=torch.tensor([1]))
    assert verify_chain(logits, draft, SamplingParams(), None).tokens == (1, 2)
    sampled = verify_chain(logits, draft, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert sampled.tokens == (1, 2)


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2},
                                    {"temperature": 1e9}])
def test_bad_sampling_params_are_user_errors(kwargs):
    from specdecode.errors import UserError

    with pytest.raises(UserError):
        SamplingParams(**kwargs)


def test_top_k_keeps_the_tokens_tied_with_the_kth():
    """Ties at the k-th logit are all kept (as plain decoding keeps them: the rule does not depend on how topk
    breaks ties, which may differ between shapes and devices)."""
    kept = logits_to_probs(torch.tensor([[2.0, 1.0, 1.0, 0.0, 1.0, -1.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert (kept > 0).tolist() == [[True, True, True, False, True, False]]


def test_a_draft_token_the_target_gives_no_chance_is_never_accepted(monkeypatch):
    """Even at a uniform of exactly 0 (a draw of one in 2**24), acceptance is u * q < p, never u * q <= p: a token of
    zero target probability (cut by top-k, top-p or a grammar) is rejected, for a sampled draft and a one-hot one."""
    target_probs = torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0], [1.0 / V] * V])
    zeros = torch.zeros
    monkeypatch.setattr(torch, "rand", lambda *size, generator=None, **kwargs: zeros(*size, **kwargs))
    for draft_probs in (torch.tensor([[0.5, 0.5, 0, 0, 0, 0]]), None):
        verdict = verify_speculative_sampling(target_probs, torch.tensor([0]), draft_probs,
                                              torch.Generator().manual_seed(0))
        assert verdict.num_accepted == 0 and verdict.tokens[0] in (1, 2)
