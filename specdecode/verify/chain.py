"""Verification of a chain draft: greedy exact match and lossless speculative sampling (a seeded sequence's
matching by position, for a draft without distributions, is `verify.tree.verify`'s: `sampling`).

Pure functions over tensors, so the maths is tested without a model. Names follow the glossary in
`specdecode.types`; `target_probs` is the target model's distribution, `draft_probs` the drafter's.

Each verification decides on the device its logits live on and copies the outcome to the host once: the
accepted count, the tokens and the draft's tokens in one small tensor (`devices.to_host`). On a GPU every other
copy would stall the queue of launched kernels until they are done.
"""

from __future__ import annotations

import torch

from specdecode.devices import to_device, to_host
from specdecode.sampling import logits_to_probs, sample
from specdecode.types import Draft, SamplingParams, Verdict


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """How many leading entries of `accept` ([k] bool) are True, as a 0-d int64 tensor on its device."""
    return accept.long().cumprod(0).sum()


def _chain_verdict(num_accepted: int, tokens: list[int], drafted: list[int], riders: tuple = ()) -> Verdict:
    return Verdict(num_drafted=len(drafted), num_accepted=num_accepted, tokens=tuple(tokens),
                   rejected=tuple(drafted[num_accepted:]), riders=riders)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  riders: tuple[torch.Tensor, ...] = ()) -> Verdict:
    """Accept the longest prefix of the draft that matches the target's argmax.

    target_logits: [draft_len + 1, vocab], row i scores the token after draft position i - 1.
    draft_tokens: [draft_len]. riders: tensors whose values come to the host in the same transfer
    (`Verdict.riders`).
    """
    return match_chain(target_logits.argmax(-1), draft_tokens, riders)


def match_chain(target_tokens: torch.Tensor, draft_tokens: torch.Tensor,
                riders: tuple[torch.Tensor, ...] = ()) -> Verdict:
    """Accept the longest prefix of the draft that equals the target's tokens ([draft_len + 1]: the argmax of each
    row, or each row's token sampled with its position's uniform), then the target's token after it."""
    draft_tokens = to_device(draft_tokens, target_tokens.device)  # a host-made draft's through pinned memory
    k = draft_tokens.numel()
    num_accepted = accepted_prefix(target_tokens[:k] == draft_tokens)  # 0-d
    n, target_list, drafted, *extra = to_host(num_accepted, target_tokens, draft_tokens, *riders)
    return _chain_verdict(n, target_list[: n + 1], drafted, tuple(extra))  # the target's equal the draft's up to n


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)): what to sample from after a rejection. [..., vocab] -> [..., vocab].

    A rejection is only possible where target < draft for the drafted token, so some other token has
    target > draft and the residual has positive mass; if rounding leaves none, fall back to the target.
    Decided on the device, row by row (no host synchronisation).
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), target_probs)


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

    As vLLM's rejection sampler does, every uniform is drawn up front and the last token is sampled on
    the device from the row the accepted count picks, so the host learns the outcome in one transfer.
    """
    device = target_probs.device
    k = draft_tokens.numel()
    draft_tokens = to_device(draft_tokens, device)  # a host-made draft's through pinned memory
    uniforms = torch.rand(k, generator=generator, device=device)  # [draft_len]
    rows = torch.arange(k, device=device)
    p_target = target_probs[rows, draft_tokens]  # [draft_len]
    p_draft = draft_probs[rows, draft_tokens] if draft_probs is not None else torch.ones(k, device=device)
    num_accepted = accepted_prefix(uniforms * p_draft < p_target)  # u < target/draft, without dividing by zero
    # The last token's distribution: the residual at the first rejection, or the target's bonus row when
    # all k were accepted (the draft's row there is zero, so the residual is the target's row itself).
    at = num_accepted.view(1)
    target_row = target_probs.index_select(0, at)  # [1, vocab]
    draft_row = torch.zeros_like(target_row)  # [1, vocab]
    if k:
        safe, rejected = at.clamp_max(k - 1), (at < k).to(target_row.dtype).view(1, 1)
        if draft_probs is not None:
            draft_row = draft_probs.index_select(0, safe) * rejected
        else:  # one-hot at the rejected token
            draft_row.scatter_(1, draft_tokens.index_select(0, safe).view(1, 1), rejected)
    last = sample(residual_distribution(target_row, draft_row), generator)  # [1]
    n, drafted, (token,) = to_host(num_accepted, draft_tokens, last)
    return _chain_verdict(n, drafted[:n] + [token], drafted)


def verify_chain(
    target_logits: torch.Tensor,  # [draft_len + 1, vocab]
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    riders: tuple[torch.Tensor, ...] = (),
) -> Verdict:
    """Greedy exact match when decoding greedily (`riders` read with the verdict), speculative sampling
    otherwise (riders left unread; a seeded sequence's matching by position is `verify.tree.verify`'s)."""
    if params.greedy:
        return verify_greedy(target_logits, draft.tokens, riders)
    target_probs = logits_to_probs(target_logits, params)
    return verify_speculative_sampling(target_probs, draft.tokens, draft.probs, generator)
