"""Jacobi decoding (Santilli et al. 2023, "Accelerating Transformer Inference for Translation via
Parallel Decoding"): guess a block of tokens, let one target forward score the whole block, and take the
target's own predictions as the next guesses.

Greedy decoding of n tokens y_1..y_n after a context x is the solution of the n equations
y_i = argmax p(. | x, y_1..y_{i-1}). Jacobi iteration solves them all at once: from guesses y^(0), one
forward over x, y^(k) gives every right-hand side, y^(k+1)_i = argmax p(. | x, y^(k)_1..y^(k)_{i-1}).
Position i is exact as soon as the positions before it are, so y^(k) agrees with greedy decoding on its
first k tokens and the iteration reaches the greedy block, a fixed point, in at most n updates
(`jacobi_fixed_point`, the plain iteration, shows it in the tests).

As a drafter the iteration runs inside the engine: each step the block is the draft, the engine's
verification keeps the exact prefix (the accepted tokens plus the correction), and the target's
predictions for the positions after those, read off the same forward's logits, are the next guesses,
padded back to the block size. Under sampling the guesses are still the target's argmax: a deterministic
draft, which speculative sampling verifies losslessly as one-hot.

Guesses where the iteration has none yet (the first block, the tail after an accepted prefix) are copied
prompt-lookup style: what followed the most recent earlier occurrence of the last two tokens (else the
last one) of the context and guesses so far, and the last token repeated when it never occurred. A
block of copies costs nothing to make, is right whenever the text repeats itself, and gives the
iteration a plausible start otherwise (Santilli et al. start from padding tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdecode.drafters.base import Drafter, Memory, Needs, Outcome
from specdecode.drafters.prompt_lookup import find_continuation
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.types import Draft, SamplingParams

LOOKUP_NGRAM = 2  # the longest n-gram matched when copying guesses (down to 1)

# A block of 4 guesses keeps the verification forward at 5 tokens, barely dearer than one token on a
# CPU's cost curve (docs/results/code-choices.md). Jacobi guesses past the first few are
# rarely right except while the text repeats itself, where the copies are; the lead tunes this by
# benchmark.
DEFAULT_BLOCK = 4
# Before any evidence a guess counts as accepted 1 time in 4: Jacobi's guesses are rarely right but where
# the text repeats itself, so where verification width is dear the gate (which cuts the block by these
# scores) verifies none until the probes of the live cost curve or a cheap curve let it try.
PRIOR_HELD, PRIOR_TRIED = 1.0, 4.0


def extend_guesses(context: list[int], guesses: list[int], size: int) -> list[int]:
    """`guesses` (to follow `context`) padded to `size` tokens by copying what followed an earlier
    occurrence of the last tokens of context + guesses; the last token repeated where nothing matches."""
    out = list(guesses[:size])
    while len(out) < size:
        seq = np.asarray(context + out, dtype=np.int64)
        copied = None
        for ngram in range(LOOKUP_NGRAM, 0, -1):
            copied = find_continuation(seq, ngram, size - len(out))
            if copied is not None and copied.size:
                break
        out += copied.tolist() if copied is not None and copied.size else [int(seq[-1])]
    return out


@dataclass(frozen=True)
class JacobiSolution:
    tokens: list[int]  # the fixed point (or the last iterate when `converged` is False)
    iterations: int  # updates until the fixed point: y^(iterations) is the first iterate equal to it
    trajectory: list[list[int]]  # y^(0), y^(1), ..., y^(iterations)
    converged: bool


def jacobi_fixed_point(
    model: CausalLM, context: list[int], guesses: list[int], max_iterations: int | None = None
) -> JacobiSolution:
    """Plain Jacobi iteration on a block after `context`: y <- argmax f(context, y) until y stops
    changing (at most len(guesses) + 1 forwards: n updates and one that confirms). The context is
    prefilled once; each iteration is one forward over the block, then a crop back to the context."""
    n = len(guesses)
    if not context or n == 0:
        raise UserError("Jacobi iteration needs a non-empty context and at least one guess")
    limit = n + 1 if max_iterations is None else max_iterations
    model.reset()
    if len(context) > 1:
        model.forward(torch.tensor(context[:-1], device="cpu"), num_logits=1)
    block = list(guesses)
    trajectory = [block]
    for _ in range(limit):
        fed = torch.tensor([context[-1], *block[:-1]], device="cpu")  # [n] the last context token, then guesses 1..n-1
        logits = model.forward(fed, num_logits=n).logits  # [n, vocab], row i: after context + block[:i]
        model.crop(len(context) - 1)
        update = logits.argmax(-1).tolist()
        if update == block:
            return JacobiSolution(block, len(trajectory) - 1, trajectory, converged=True)
        block = update
        trajectory.append(block)
    return JacobiSolution(block, len(trajectory) - 1, trajectory, converged=False)


class JacobiDrafter(Drafter):
    """Drafts a block of `block_size` Jacobi guesses; after verification the target's predictions at
    the positions past the accepted prefix become the next guesses (one Jacobi update per step)."""

    name = "jacobi"
    needs = Needs(logits=True)
    batchable = True  # it reads its sequence's rows of the target's logits and runs no model (`for_sequence`)

    def __init__(self, block_size: int = DEFAULT_BLOCK):
        if block_size < 1:
            raise UserError(f"Jacobi decoding needs a block of at least 1 token, got {block_size}")
        self.block_size = block_size
        self.begin([])

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self._guesses: list[int] = []  # the next guesses, to follow a context of length self._follows
        self._follows = -1
        # per block position k: steps that verified a guess there, and those that accepted it (with the
        # guesses before it), for the scores the engine's gate cuts the block by
        self._tried = np.zeros(self.block_size)
        self._held = np.zeros(self.block_size)

    def for_sequence(self, memory: Memory | None = None) -> JacobiDrafter:
        return JacobiDrafter(self.block_size)

    def _scores(self, n: int) -> torch.Tensor:
        """The chance that guesses 1..k are all accepted, for k = 1..n: the running rates, 1 in 4 before
        any evidence, non-increasing."""
        rates = (self._held[:n] + PRIOR_HELD) / (self._tried[:n] + PRIOR_TRIED)
        return torch.from_numpy(np.minimum.accumulate(rates)).float()

    def propose(self, context: list[int], max_tokens: int, params: SamplingParams, generator) -> Draft:
        kept = self._guesses if self._follows == len(context) else []
        guesses = extend_guesses(context, kept, self.block_size)
        self._guesses, self._follows = guesses, len(context)
        n = min(self.block_size, max_tokens)
        return Draft(tokens=torch.tensor(guesses[:n], dtype=torch.long, device="cpu"), scores=self._scores(n))

    def observe(self, outcome: Outcome) -> None:
        """logits: [len(draft) + 1, vocab] (rows past those, if any, are not ours). Row a + 1 onwards,
        after the accepted a tokens and the rejected guess, are the Jacobi update of the later guesses."""
        verdict, accepted = outcome.verdict, outcome.verdict.num_accepted
        if outcome.logits is not None:
            rows = outcome.logits[accepted + 1 : len(outcome.draft) + 1]  # [len(draft) - accepted, vocab]
            self._guesses = rows.argmax(-1).tolist()
            self._follows += accepted + 1
        self._tried[: verdict.num_drafted] += 1
        self._held[: verdict.num_accepted] += 1


def build_jacobi(target: CausalLM, draft: CausalLM | None, options) -> Drafter:
    """The `jacobi` method: no draft model, no options."""
    return JacobiDrafter()
