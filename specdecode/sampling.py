"""Turning logits into distributions and tokens. Pure functions; probability maths in float32."""

from __future__ import annotations

import torch

from specdecode.types import SamplingParams


def penalise(
    logits: torch.Tensor,  # [rows, vocab]
    params: SamplingParams,
    ids: torch.Tensor,  # [cols] int64, the tokens a penalty may touch (repeats allowed)
    generated: torch.Tensor,  # [rows, cols] float32, how often ids[c] was generated before row r's position
    seen: torch.Tensor,  # [rows, cols] bool, whether ids[c] is in the prompt or was generated before it
) -> torch.Tensor:
    """The logits a sequence samples from before temperature: OpenAI's `logit_bias` added, then vLLM's
    repetition penalty (a seen token's logit divided by it where positive, multiplied where not), then
    OpenAI's frequency and presence penalties (minus the penalty times the count, minus the presence penalty
    once generated), as vLLM applies them. -> [rows, vocab] float32.

    Only the columns of `ids` change (a token of no column was neither seen nor generated); a token in
    several columns gets the same counts in each, so each writes the same value."""
    logits = logits.float()
    rows = logits.shape[0]
    if params.logit_bias:
        bias_ids = torch.tensor([token for token, _ in params.logit_bias], device=logits.device)  # [b]
        bias = torch.tensor([value for _, value in params.logit_bias], device=logits.device)  # [b] float32
        logits = logits.index_add(-1, bias_ids, bias.expand(rows, -1))
    if params.counts_tokens and ids.numel():
        columns = ids.expand(rows, -1)  # [rows, cols]
        values = logits.gather(-1, columns)  # [rows, cols]
        penalty = params.repetition_penalty
        values = torch.where(seen, torch.where(values > 0, values / penalty, values * penalty), values)
        values = values - params.frequency_penalty * generated - params.presence_penalty * (generated > 0).float()
        logits = logits.scatter(-1, columns, values)
    return logits


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k, min-p and top-p to logits and normalise (min-p and top-k commute: each keeps
    the likeliest tokens down to a threshold the other does not move).

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
    if params.min_p > 0.0:
        probs = logits.softmax(-1)  # [..., vocab]
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
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
