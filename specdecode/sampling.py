"""Turning logits into distributions and tokens. Pure functions; probability maths in float32.

Randomness, and what a seed reproduces (docs/verification.md, "Randomness"): a sequence's `SeededGenerator` is a
torch generator, the stream sampled drafts and draft distributions draw from, and it also names one uniform for
each output position (`position_uniforms`): a counter-based number (a hash of the seed and the position, not the
next draw of a stream), so the token plain decoding samples at a position is the same whatever was drawn before
it. A draft without distributions (a copy, a head's top-k, a trie) is then verified by sampling every row of the
step with its position's uniform and matching the draft against those tokens as greedy matching does against
the argmax: the output is plain decoding's sampled output under that seed, token for token, whatever the draft was
or how long the gate let it be.
"""

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


def sample(probs: torch.Tensor, generator: torch.Generator | None, uniforms: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Draw one token per row. probs: [..., vocab] float32, non-negative (they need not sum to 1) ->
    [...] int64. `uniforms` ([...] in [0, 1), on the device of `probs`): the rows' uniforms, else drawn
    from `generator`.

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
    if uniforms is None:
        uniforms = torch.rand(flat.shape[0], 1, generator=generator, dtype=wide, device=flat.device)
    u = uniforms.reshape(-1, 1).to(wide) * total  # [rows, 1]
    tokens = torch.searchsorted(cumulative, u, right=True)
    # never past the last token of positive probability, where the sum ends (u < total under round-to-nearest;
    # a uniform draw of exactly 1 would otherwise give a zero-weight tail token, or an index past the end)
    last = torch.searchsorted(cumulative, total, right=False)
    return torch.minimum(tokens, last).squeeze(-1).reshape(probs.shape[:-1])


# --- Counter-based uniforms: one per output position of a seeded sequence -----------------------------

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 over the golden ratio)
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64's two multipliers


def _signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shifted(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z's bits shifted right as unsigned: torch's >> on int64 copies the sign bit."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser over int64 tensors (products wrap modulo 2^64, as on every device torch runs on)."""
    z = (z ^ _shifted(z, 30)) * _signed(_MIX[0])
    z = (z ^ _shifted(z, 27)) * _signed(_MIX[1])
    return z ^ _shifted(z, 31)


def seed_key(seed: int) -> int:
    """The 64-bit key a seed's positions are hashed with (splitmix64 of the seed, as an int64)."""
    return int(_mix(torch.tensor(_signed((seed + _GOLDEN) & _MASK), dtype=torch.int64, device="cpu")))


def position_uniforms(key: int, positions: torch.Tensor) -> torch.Tensor:
    """The uniforms in [0, 1) of a key's output positions ([...] int64, on any device): splitmix64 of the key's
    `positions`-th step, its top 53 bits as a float64 (on MPS, which has none, 24 bits as a float32). The same
    numbers on every device and whatever was drawn before: a function of the key and the position alone.
    -> [...] float64"""
    z = _mix(key + (positions + 1) * _signed(_GOLDEN))
    if positions.device.type == "mps":  # no float64 there: the top 24 bits, exact in a float32
        return _shifted(z, 40).to(torch.float32) * 2.0**-24
    return _shifted(z, 11).to(torch.float64) * 2.0**-53


class SeededGenerator(torch.Generator):
    """A sequence's randomness (the module docstring): a torch generator seeded with `seed` for whatever draws from a
    stream, whose `key` names one uniform per output position (`position_uniforms`). `position` is the output
    position the next verification decides first (the context's length), set by the engine before each; None
    outside an engine, where verifiers draw from the stream."""

    key: int
    position: int | None


def seeded(device: torch.device | str, seed: int) -> SeededGenerator:
    """A sequence's `SeededGenerator` on `device` (where sampling draws)."""
    generator = SeededGenerator(device=device)
    generator.manual_seed(seed)
    generator.key = seed_key(seed)
    generator.position = None
    return generator


def step_uniforms(generator: torch.Generator | None, depths: torch.Tensor) -> torch.Tensor | None:
    """The uniforms of a step's rows, whose depths below the context are `depths` ([rows] int64: 0 for the context's
    row, a node's depth for its row), where `generator` names them (a `SeededGenerator` at a position), else None.
    -> [rows] float64 on the device of `depths`"""
    if not isinstance(generator, SeededGenerator) or generator.position is None:
        return None
    return position_uniforms(generator.key, depths + generator.position)


def matched(params: SamplingParams, generator: torch.Generator | None) -> bool:
    """Whether an engine verifies a draft without distributions by matching it against tokens the target's rows alone
    decide (greedy decoding's argmax; a seeded sequence's tokens by position: `verify.tree.verify`), reading the draft's
    riders in the same transfer as its verdict: a drafter may then leave such a draft on the device until then."""
    return params.greedy or isinstance(generator, SeededGenerator)
