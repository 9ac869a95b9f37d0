"""Verification of a chain draft: greedy exact match and lossless speculative sampling.

Pure functions over tensors, so the maths is tested without a model. Names follow the glossary in
`specdecode.types`; `target_probs` is the target model's distribution, `draft_probs` the drafter's.
"""

from __future__ import annotations

import torch

from specdecode.sampling import logits_to_probs, sample
from specdecode.types import Draft, SamplingParams, Verdict


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """Accept the longest prefix of the draft that matches the target's argmax.

    target_logits: [draft_len + 1, vocab], row i scores the token after draft position i - 1.
    draft_tokens: [draft_len].
    """
    target_tokens = target_logits.argmax(-1)  # [draft_len + 1]
    k = draft_tokens.numel()
    mismatch = (target_tokens[:k] != draft_tokens).nonzero()
    num_accepted = int(mismatch[0]) if mismatch.numel() else k
    tokens = target_tokens[: num_accepted + 1].tolist()  # equal to the draft up to num_accepted
    return Verdict(num_drafted=k, num_accepted=num_accepted, tokens=tuple(tokens))


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)): what to sample from after a rejection. [vocab] -> [vocab].

    A rejection is only possible where target < draft for the drafted token, so some other token has
    target > draft and the residual has positive mass; if rounding leaves none, fall back to the target.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:
        return target_probs
    return residual / total


def verify_speculative_sampling(
    target_probs: torch.Tensor,  # [draft_len + 1, vocab] float32
    draft_tokens: torch.Tensor,  # [draft_len] int64
    draft_probs: torch.Tensor | None,  # [draft_len, vocab] float32; None: deterministic (one-hot) draft
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), lossless for any draft.

    For i = 0, 1, ...: accept draft token x_i with probability min(1, target(x_i) / draft(x_i)); at the
    first rejection take a correction token from the residual norm(max(0, target - draft)) and stop; if
    every token is accepted, sample a bonus token from the target's next distribution.
    """
    k = draft_tokens.numel()
    uniforms = torch.rand(k, generator=generator)  # [draft_len]
    rows = torch.arange(k)
    p_target = target_probs[rows, draft_tokens]  # [draft_len]
    p_draft = draft_probs[rows, draft_tokens] if draft_probs is not None else torch.ones(k)
    accept = uniforms * p_draft < p_target  # u < target/draft, without dividing by zero
    rejected = (~accept).nonzero()
    num_accepted = int(rejected[0]) if rejected.numel() else k
    tokens = draft_tokens[:num_accepted].tolist()
    if num_accepted < k:
        if draft_probs is not None:
            rejected_draft = draft_probs[num_accepted]
        else:
            rejected_draft = torch.zeros_like(target_probs[num_accepted])
            rejected_draft[draft_tokens[num_accepted]] = 1.0
        last_probs = residual_distribution(target_probs[num_accepted], rejected_draft)
    else:
        last_probs = target_probs[k]
    tokens.append(int(sample(last_probs, generator)))
    return Verdict(num_drafted=k, num_accepted=num_accepted, tokens=tuple(tokens))


def verify_chain(
    target_logits: torch.Tensor,  # [draft_len + 1, vocab]
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """Greedy exact match when decoding greedily, speculative sampling otherwise."""
    if params.greedy:
        return verify_greedy(target_logits, draft.tokens)
    target_probs = logits_to_probs(target_logits, params)
    return verify_speculative_sampling(target_probs, draft.tokens, draft.probs, generator)
