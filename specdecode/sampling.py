"""Turning logits into distributions and tokens. Pure functions; probability maths in float32."""

from __future__ import annotations

import torch

from specdecode.types import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits and normalise.

    logits: [..., vocab] in any dtype. Returns [..., vocab] float32 that sums to 1 over the last axis.
    Under greedy decoding (temperature 0) the result is one-hot at the argmax, so the same verification
    maths covers both modes.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [..., vocab]
        sorted_probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
        # already reaches top_p. The most likely token is always kept.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. probs: [..., vocab] float32, non-negative (they need not sum to 1) ->
    [...] int64.

    By inverting the cumulative distribution, summed in float64 (an error of about 1e-11 over a 150k
    vocabulary, where float32 would reach 1e-5): a uniform u in [0, total) picks the first token whose
    cumulative mass exceeds u, so a token of zero probability is never drawn. Far faster than
    `torch.multinomial` over a 150k vocabulary on a CPU, which draws an exponential per token, a cost every
    sampled step pays (docs/results/code-choices.md). On the device of `probs`, with no host synchronisation
    (`generator` must live there too)."""
    flat = probs.reshape(-1, probs.shape[-1])  # [rows, vocab]
    wide = torch.float32 if flat.device.type == "mps" else torch.float64  # MPS has no float64
    cumulative = torch.cumsum(flat, dim=-1, dtype=wide)  # [rows, vocab]
    total = cumulative[:, -1:].contiguous()  # [rows, 1]
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=wide, device=flat.device) * total  # [rows, 1]
    tokens = torch.searchsorted(cumulative, u, right=True)
    # never past the last token of positive probability, where the sum ends (u < total under round-to-nearest;
    # a uniform draw of exactly 1 would otherwise give a zero-weight tail token, or an index past the end)
    last = torch.searchsorted(cumulative, total, right=False)
    return torch.minimum(tokens, last).squeeze(-1).reshape(probs.shape[:-1])
