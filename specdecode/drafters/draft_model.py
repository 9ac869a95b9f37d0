"""An independent draft model: a smaller model of the same family drafts token by token.

The draft model keeps its own KV cache. Before each proposal it is brought in step with the context by
cropping its cache to the longest common prefix of what it has seen and the context, then feeding the
rest (usually the last accepted token and the correction), so no bookkeeping is shared with the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdecode.devices import to_device
from specdecode.drafters.base import Drafter, Outcome, RunningAcceptance
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.models import costs
from specdecode.models.costs import CostCurve
from specdecode.sampling import logits_to_probs, sample
from specdecode.types import Draft, SamplingParams, Verdict


UNSEEN = -1  # in `SyncedCache.seen`: a drafted token the draft model holds whose value the host has not read


def common_prefix_length(a: list[int], b: list[int], near_end: int = 64) -> int:
    """How many leading tokens `a` and `b` share. Called once a step on the whole context, so the lists are
    compared a slice at a time (in C, not a Python loop over every token): the first difference is
    usually among the last few (the draft the target rejected), so the prefix before the last `near_end`
    is checked whole, and a difference before it is found by halving."""
    n = min(len(a), len(b))
    lo, hi = 0, max(0, n - near_end)  # a[:lo] == b[:lo] is known; the first difference lies at or after lo
    if a[:hi] != b[:hi]:
        while hi - lo > near_end:  # keep a[:lo] == b[:lo] and a[:hi] != b[:hi]
            mid = (lo + hi) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
    else:
        lo, hi = hi, n
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


class SyncedCache:
    """A draft model's KV cache kept in step with the context by its longest common prefix."""

    def __init__(self, model: CausalLM, late_start: LateStart | None = None):
        self.model = model
        self.seen: list[int] = []  # the tokens whose keys and values the draft model holds
        self.late_start = late_start or LateStart()

    def reset(self, prompt_length: int = 0) -> None:
        """A new sequence whose prompt has `prompt_length` tokens."""
        self.model.reset()
        self.seen = []
        self.late_start.begin(prompt_length)

    def ready(self, context: list[int], room: int) -> bool:
        """Whether the draft model drafts after `context` (`room` more tokens allowed): once it has, always."""
        return bool(self.seen) or self.late_start.ready(len(context), room)

    def learn(self, verdict: Verdict) -> None:
        """Put the drafted tokens' values, as verification read them, in place of their UNSEEN marks: `verdict`
        judges the drafter's own tokens alone (`engine.forced.own_part`), which hold those places in turn."""
        drafted = list(verdict.tokens[: verdict.num_accepted]) + list(verdict.rejected)
        start = len(self.seen)  # the marks are the tail of `seen`: a draft appends them, `sync` crops before them
        while start > 0 and self.seen[start - 1] == UNSEEN:
            start -= 1
        for i, token in enumerate(drafted[: len(self.seen) - start]):
            self.seen[start + i] = token

    def sync(self, context: list[int]) -> list[int]:
        """Crop the draft cache to what it shares with `context`; return the tokens still to feed (at
        least one, so the next forward gives the distribution after the context)."""
        keep = min(common_prefix_length(self.seen, context), len(context) - 1)
        self.model.crop(keep)
        del self.seen[keep:]
        return context[keep:]


class LateStart:
    """When a draft model joins a sequence: not before the prompt's prefill on it can pay for itself.

    Bringing the draft model up to the context costs `prefill(n)` target forwards for n tokens: on a CPU
    where a 600-token prompt keeps a 0.5B draft model busy for as long as a dozen target steps, an answer of
    twenty tokens never earns that back. (Not `draft_curve(n)`: the curve's forwards ask every row's
    logits, a prefill one row, and the curve stops at 64 tokens: extrapolated to 600 it said 50.) Drafting
    saves at most `gain` of a target forward per output token (1 - 1 / its best speedup), so the prefill
    pays back after prefill(n) / gain tokens. The answer's
    length being unknown, this is the Bahncard problem (pay a fixed price to get a discount on every
    later trip): decode plainly until the tokens already generated reach that break-even count, then
    start drafting, which costs at most twice what knowing the length in advance would have (the
    classic rule: buy once the full fares paid would have paid for the card). Never start when fewer
    tokens than that are left to generate (`room`): the prefill could not pay back even then. With no
    `prefill` (its cost unknown: a fake model in a test) or no `gain`, the draft model starts at once."""

    def __init__(self, prefill: Callable[[int], float] | None = None, gain: float = 0.0):
        self.prefill, self.gain = prefill, gain
        self.begin(0)

    def begin(self, prompt_length: int) -> None:
        self.prompt_length = prompt_length

    def break_even(self, context_length: int) -> float:
        """Output tokens after which drafting would have paid for bringing the draft model up to the context."""
        if self.prefill is None or not self.gain > 0:
            return 0.0
        return self.prefill(context_length) / self.gain

    def ready(self, context_length: int, room: int) -> bool:
        tokens = self.break_even(context_length)
        return context_length - self.prompt_length >= tokens and room >= tokens


def late_start(draft_cost: float | None, draft_curve: CostCurve | None, curve: CostCurve | None,
               lengths: range) -> LateStart:
    """A draft model's LateStart from its forward's cost (in target forwards), its own cost curve and the
    target's: the prefill of n tokens costs n times the draft curve's measured prefill seconds per token,
    over the target's one-token forward, both read now, so the rule is fixed for the drafter's life (any of
    them not given or not measured, a fixed curve in a test: start at once); the best gain is a chain's at
    BEST_ACCEPTANCE."""
    if (draft_cost is None or curve is None or draft_curve is None
            or not (draft_curve.prefill > 0 and curve.seconds > 0)):
        return LateStart()
    per_token = draft_curve.prefill / curve.seconds  # target forwards per token of the draft model's prefill
    k = best_draft_length(BEST_ACCEPTANCE, draft_cost, lengths, curve)
    speedup = chain_rate(BEST_ACCEPTANCE, k, draft_cost, curve) if k else 1.0
    return LateStart(lambda n: n * per_token, 1.0 - 1.0 / speedup)


BEST_ACCEPTANCE = 0.95  # about the best a separate draft model reaches: a smaller model of the target's family
PROBE_EVERY = 8  # steps between one-token probes while drafting is off but might pay


def best_draft_length(acceptance: float, draft_cost: float, lengths: range, curve: CostCurve) -> int:
    """The draft length with the most expected tokens per unit of time (see DraftModelDrafter); 0 (no
    draft) when `lengths` offers it and no draft beats plain decoding."""
    return max(lengths, key=lambda k: chain_rate(acceptance, k, draft_cost, curve))


def chain_rate(acceptance: float, k: int, draft_cost: float, curve: CostCurve) -> float:
    """Expected output tokens per target forward's time of a step drafting k tokens, each accepted with
    chance `acceptance` given the ones before (k = 0: plain decoding, 1)."""
    acceptance = min(max(acceptance, 0.0), 0.999)
    tokens = (1 - acceptance ** (k + 1)) / (1 - acceptance)
    return tokens / (k * draft_cost + curve(k + 1))


class DraftModelDrafter(Drafter):
    """Drafts up to `num_tokens` tokens autoregressively with a small model.

    Adaptive draft length (on by default) picks the length that maximises expected tokens per unit of
    time from the per-token acceptance probability a, estimated online (`RunningAcceptance`; a chain of k
    drafts then yields (1 - a^(k+1)) / (1 - a) tokens per step), the cost of one draft token relative to one target
    forward, `draft_cost`, and the target's cost curve (the step then costs k * draft_cost + curve(k + 1)
    target forwards). The length may be 0: where no draft beats plain decoding, drafting switches
    off, with a one-token probe every PROBE_EVERY steps to notice when it would pay again, and for good
    when it could not pay even at BEST_ACCEPTANCE (llama.cpp on a CPU, where a verification costs nearly
    one forward per token and a draft token a large share of one: docs/results/code-choices.md). The
    costs are fixed numbers during a run, so a seed still reproduces a sampled run: the methods registry
    takes them from the two models' cost
    curves, measured once per machine and cached (`models.costs`). Drafting also stops early when the drafter's own
    probability of its token falls under `confidence_threshold`: such a token is likely rejected, and
    drafting past it costs draft forwards for nothing. Given the draft model's own cost curve, adaptive
    drafting starts only once the draft model's prefill can pay for itself (`LateStart`).
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
        draft_cost: float | None = None,  # a draft forward in one-token target forwards (`for_models` measures it)
        curve: CostCurve | None = None,  # the target's (`for_models`: measured)
        draft_curve: CostCurve | None = None,  # the draft model's own (its prefill's cost); None: start at once
    ):
        if not 1 <= min_tokens <= num_tokens <= max_tokens:
            raise UserError(
                f"draft length needs 1 <= min ({min_tokens}) <= initial ({num_tokens}) <= max ({max_tokens})"
            )
        if draft_cost is not None and not draft_cost > 0:
            raise UserError(f"draft cost must be positive, got {draft_cost}")
        if adaptive and (draft_cost is None or curve is None):
            raise UserError("an adaptive draft length weighs a draft's cost against verification's: "
                            f"{type(self).__name__}.for_models(draft, target) measures both on this machine; "
                            "else pass draft_cost and curve (the target's cost curve), or adaptive=False")
        if not 0.0 <= confidence_threshold < 1.0:
            raise UserError(f"confidence threshold must be in [0, 1), got {confidence_threshold}")
        self.model = model
        self.initial_tokens, self.adaptive = num_tokens, adaptive
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.confidence_threshold = confidence_threshold
        self.num_tokens = num_tokens
        self.draft_cost = draft_cost
        self.curve = curve
        self._idle = 0  # steps since the last draft while drafting is off
        self._acceptance = RunningAcceptance()
        self._cache = SyncedCache(model, late_start(draft_cost, draft_curve, curve, self._lengths()))

    @classmethod
    def for_models(cls, draft: CausalLM, target: CausalLM, **options) -> DraftModelDrafter:
        """Priced from both models' cost curves, measured once per machine (`models.costs`): a draft
        forward in target forwards, the target's width costs, the draft model's prefill."""
        return cls(draft, draft_cost=costs.draft_cost(draft, target), curve=target.cost_curve(),
                   draft_curve=draft.cost_curve(), **options)

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        # where even a near-perfect draft could not pay, do not draft at all (not even the draft
        # model's prefill of the prompt)
        hopeless = self.adaptive and not self._best_length(BEST_ACCEPTANCE)
        self.num_tokens = 0 if hopeless else self.initial_tokens
        self._idle = 0
        self._acceptance.reset()
        self._cache.reset(len(prompt_ids))

    def _length(self) -> int:
        if self.num_tokens > 0:
            return self.num_tokens
        self._idle += 1
        best_case = self._best_length(BEST_ACCEPTANCE)
        return self.min_tokens if best_case and self._idle % PROBE_EVERY == 0 else 0

    def _lengths(self) -> range:
        return range(0, self.max_tokens + 1)

    def _best_length(self, acceptance: float) -> int:
        assert self.draft_cost is not None and self.curve is not None, "priced: adaptive drafters are (__init__)"
        return best_draft_length(acceptance, self.draft_cost, self._lengths(), self.curve)

    @property
    def stops_early(self) -> bool:
        """Whether drafting stops at the first token under the confidence threshold. Deciding that reads each
        token's probability on the host: free on a CPU, where it saves draft forwards, but a stall of the
        launch queue per token on a GPU, where the chain is drafted whole and left to verification."""
        return self.confidence_threshold > 0 and self.model.device.type == "cpu"

    def propose(self, context, max_tokens, params, generator) -> Draft:
        length = min(self._length(), max_tokens)
        if length <= 0 or not self._ready(context, max_tokens):
            return Draft.empty()
        pending = self._cache.sync(context)
        if not self.stops_early:
            return self._draft_on_device(pending, length, params, generator)
        tokens, rows = self._draft(pending, length, params, generator)
        probs = torch.stack(rows) if rows else None  # [draft_len, vocab] when sampling
        return Draft(tokens=torch.tensor(tokens, device="cpu"), probs=probs)

    def _draft_on_device(self, pending: list[int], length: int, params: SamplingParams,
                         generator: torch.Generator | None) -> Draft:
        """Feed `pending`, then draft `length` tokens, each fed back to the draft model where it was drawn,
        without reading one on the host. The draft model's cache then holds tokens whose values the host
        learns from the verdict (`observe`); until then they are UNSEEN in `seen`."""
        fed = to_device(pending, self.model.device)
        tokens, rows = [], []
        for i in range(length):
            logits = self.model.forward(fed, num_logits=1).logits  # [1, vocab_draft]
            self._cache.seen.extend(pending if i == 0 else [UNSEEN])
            if params.greedy:
                fed = logits.argmax(-1)  # [1]
            else:
                probs = logits_to_probs(logits, params)  # [1, vocab]
                fed = sample(probs, generator)  # [1]
                rows.append(probs[0])
            tokens.append(fed)
        return Draft(tokens=torch.cat(tokens), probs=torch.stack(rows) if rows else None)

    def _ready(self, context: list[int], room: int) -> bool:
        """Whether the draft model drafts now (`LateStart`; a fixed draft length, adaptive=False, drafts
        from the first step)."""
        return not self.adaptive or self._cache.ready(context, room)

    def _draft(self, pending: list[int], length: int, params: SamplingParams, generator: torch.Generator | None
               ) -> tuple[list[int], list[torch.Tensor]]:
        """Feed `pending` (what the cache lacks of the context), then draft up to `length` tokens one by
        one; returns them and, when sampling, the distribution [vocab] each was drawn from."""
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(length):
            logits = self.model.forward(torch.tensor(pending, device="cpu"), num_logits=1).logits[0]  # [vocab_draft]
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
        return tokens, rows

    def observe(self, outcome: Outcome) -> None:
        verdict = outcome.verdict  # of its own draft: the engine leaves a forced run put ahead of it out
        self._cache.learn(verdict)
        if not self.adaptive or verdict.num_drafted == 0:
            return
        self._acceptance.record(verdict)
        best = self._best_length(self._acceptance.value)
        self.num_tokens = best and max(best, self.min_tokens)
