"""An independent draft model: a smaller model of the same family drafts token by token.

The draft model keeps its own KV cache. Before each proposal it is brought in step with the context by
cropping its cache to the longest common prefix of what it has seen and the context, then feeding the
rest (usually the last accepted token and the correction), so no bookkeeping is shared with the engine.
"""

from __future__ import annotations

import torch

from specdecode.drafters.base import Drafter
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.sampling import logits_to_probs, sample
from specdecode.types import Draft, SamplingParams, StepStats, Verdict


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SyncedCache:
    """A draft model's KV cache kept in step with the context by its longest common prefix."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.seen: list[int] = []  # the tokens whose keys and values the draft model holds

    def reset(self) -> None:
        self.model.reset()
        self.seen = []

    def sync(self, context: list[int]) -> list[int]:
        """Crop the draft cache to what it shares with `context`; return the tokens still to feed (at
        least one, so the next forward gives the distribution after the context)."""
        keep = min(common_prefix_length(self.seen, context), len(context) - 1)
        self.model.crop(keep)
        del self.seen[keep:]
        return context[keep:]


VERIFY_SLOPE = 0.03  # extra cost of verifying one more token, relative to a 1-token target forward
DECAY = 0.9  # weight of the past in the running estimates


def best_draft_length(acceptance: float, draft_cost: float, lengths: range) -> int:
    """The draft length with the most expected tokens per unit of time (see DraftModelDrafter)."""
    acceptance = min(max(acceptance, 0.0), 0.999)

    def rate(k: int) -> float:
        tokens = (1 - acceptance ** (k + 1)) / (1 - acceptance)
        return tokens / (k * draft_cost + 1 + VERIFY_SLOPE * k)

    return max(lengths, key=rate)


class DraftModelDrafter(Drafter):
    """Drafts up to `num_tokens` tokens autoregressively with a small model.

    Adaptive draft length (on by default) picks the length that maximises expected tokens per unit of
    time from the per-token acceptance probability a, estimated online (a chain of k drafts then yields
    (1 - a^(k+1)) / (1 - a) tokens per step), and the cost of one draft token relative to one target
    forward, `draft_cost` (the step then costs k * draft_cost + 1 + VERIFY_SLOPE * k target forwards).
    The cost is a fixed number during a run, so a seed still reproduces a sampled run: the methods
    registry takes it from the two models' cost curves, measured once per machine and cached
    (`models.costs.draft_cost`). Drafting also stops early when the drafter's own
    probability of its token falls under `confidence_threshold`: such a token is likely rejected, and
    drafting past it costs draft forwards for nothing.
    """

    name = "draft"

    def __init__(
        self,
        model: CausalLM,
        num_tokens: int = 4,
        adaptive: bool = True,
        min_tokens: int = 1,
        max_tokens: int = 16,
        confidence_threshold: float = 0.4,
        draft_cost: float = 0.4,
    ):
        if not 1 <= min_tokens <= num_tokens <= max_tokens:
            raise UserError(
                f"draft length needs 1 <= min ({min_tokens}) <= initial ({num_tokens}) <= max ({max_tokens})"
            )
        if not draft_cost > 0:
            raise UserError(f"draft cost must be positive, got {draft_cost}")
        if not 0.0 <= confidence_threshold < 1.0:
            raise UserError(f"confidence threshold must be in [0, 1), got {confidence_threshold}")
        self.model = model
        self.initial_tokens, self.adaptive = num_tokens, adaptive
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.confidence_threshold = confidence_threshold
        self.num_tokens = num_tokens
        self.draft_cost = draft_cost
        self._accepted = self._rejected = 0.0  # decayed counts of accepted and rejected draft tokens
        self._cache = SyncedCache(model)

    def begin(self, prompt_ids: list[int]) -> None:
        self.num_tokens = self.initial_tokens
        self._accepted = self._rejected = 0.0
        self._cache.reset()

    def propose(self, context, max_tokens, params, generator) -> Draft:
        length = min(self.num_tokens, max_tokens)
        if length <= 0:
            return Draft.empty()
        pending = self._cache.sync(context)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(length):
            logits = self.model.forward(torch.tensor(pending), num_logits=1).logits[0]  # [vocab_draft]
            self._cache.seen.extend(pending)
            if params.greedy:
                token = int(logits.argmax())
                confidence = float(torch.softmax(logits, -1)[token]) if self.confidence_threshold else 1.0
            else:
                probs = logits_to_probs(logits, params)  # [vocab]
                token = int(sample(probs, generator))
                confidence = float(probs[token])
                rows.append(probs)
            tokens.append(token)
            pending = [token]
            if confidence < self.confidence_threshold:
                break
        probs = torch.stack(rows) if rows else None  # [draft_len, vocab] when sampling
        return Draft(tokens=torch.tensor(tokens), probs=probs)

    def update(self, verdict: Verdict, stats: StepStats) -> None:
        if not self.adaptive or verdict.num_drafted == 0:
            return
        self._accepted = DECAY * self._accepted + verdict.num_accepted
        self._rejected = DECAY * self._rejected + (0 if verdict.bonus else 1)
        acceptance = (self._accepted + 1) / (self._accepted + self._rejected + 2)  # with a uniform prior
        lengths = range(self.min_tokens, self.max_tokens + 1)
        self.num_tokens = best_draft_length(acceptance, self.draft_cost, lengths)
