"""One sequence's way through generation, whichever engine steps it (`loop.SpeculativeEngine` one at a
time, `batch.BatchEngine` several): its configuration, its progress (context, output, stopping, text,
statistics, random generator), what each step adds (`StepEvent`) and the result; and the parts of a step
both engines take for each sequence: its forward's inputs (`draft_inputs`), its verification
(`verify_draft`) and its conclusion (`conclude`: the tokens appended, the drafter told how it went)."""

from __future__ import annotations

import numbers
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field, replace

import torch

from specdecode import metrics, sampling
from specdecode.constraints import Constraint, Matcher, masked_logits
from specdecode.engine import forced, logprobs
from specdecode.engine.penalties import TokenHistory
from specdecode.drafters.base import Drafter, Outcome
from specdecode.engine.prompts import Prefilled
from specdecode.engine.stopping import TextTracker
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.types import (
    Draft, SamplingParams, StepStats, TokenLogprob, TokenOrigin, Verdict, check_types, frozen_items, is_whole,
)
from specdecode.tree import structure as tree

MAX_NEW_TOKENS_LIMIT = 1 << 20
# a 64-bit signed integer, as OpenAI's: torch's generators take [-2**63, 2**64) but read a negative seed s as
# s + 2**64, so the wider range would give two seeds one stream
SEED_RANGE = (-(2**63), 2**63)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings; the output text ends right before the first one
    seed: int | None = None  # seeds the one torch.Generator every random choice goes through
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the output as end-of-sequence ones do, ignore_eos or not
    # the language the output must belong to (`specdecode.constraints`); the sequence ends once it is complete
    constraint: Constraint | None = None
    # each output token's log-probability and this many alternatives' (`engine.logprobs`); None: none
    logprobs: int | None = None
    # the prompt's tokens' log-probabilities too (`logprobs` needed), from its prefill; max_new_tokens may then be 0
    echo: bool = False

    def __post_init__(self) -> None:
        check_types(self, whole=("max_new_tokens", "seed", "logprobs"), optional=("seed", "logprobs"))
        if not isinstance(self.sampling, SamplingParams):
            raise UserError(f"GenerationConfig: sampling must be a SamplingParams, got {self.sampling!r}")
        if not (0 if self.echo else 1) <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise UserError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}, got {self.max_new_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= logprobs.MAX_TOP:
            raise UserError(f"logprobs lists 0 to {logprobs.MAX_TOP} alternatives, got {self.logprobs}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise UserError(f"a seed lies in [-2**63, 2**63), a 64-bit signed integer; got {self.seed}")
        if self.echo and self.logprobs is None:
            raise UserError("echo gives the prompt's log-probabilities: it needs logprobs")
        if isinstance(self.stop, str) or self.stop is None:
            object.__setattr__(self, "stop", (self.stop,) if self.stop is not None else ())
        frozen_items(self, "stop", lambda s: isinstance(s, str) and bool(s),  # (the server's 400 says the same)
                     "texts (a stop string is text that is not empty)")
        frozen_items(self, "stop_token_ids", lambda t: is_whole(t, numbers.Integral) and t >= 0,
                     "token ids (whole numbers >= 0)", int)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise UserError(f"a constraint is made by Constraint.json_schema, .json_object, .regex or .grammar, got "
                            f"{self.constraint!r}")


@dataclass
class StepEvent:
    """What one step added to the output, for streaming."""

    token_ids: list[int]
    origins: list[TokenOrigin]  # how each token came about, parallel to token_ids
    text: str  # the new text (may be empty while a character is incomplete)
    stats: StepStats
    rejected_ids: list[int] = field(default_factory=list)  # a chain draft's tokens the target turned down
    logprobs: list[TokenLogprob] | None = None  # each token's, when the sequence asks for them


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only
    text: str
    steps: list[StepStats]
    seconds: float
    # "eos" (the model's end-of-sequence token, or the constraint complete), "length" (max_new_tokens or the context
    # is full) or "stop" (a stop string, or a token of `stop_token_ids` that is not the model's end)
    finish_reason: str
    method: str
    # Tree nodes verified per step: a fixed number, "auto" (chosen each step from the cost curve),
    # "whole" (a fixed shape verified whole); None for chains.
    tree_budget: int | str | None = None
    logprobs: list[TokenLogprob] | None = None  # each new token's, when asked for (`GenerationConfig.logprobs`)
    # each prompt token's but the first (which nothing scores), when asked for (`GenerationConfig.echo`)
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0  # prompt tokens not fed: their keys and values another sequence's (`engine.batch`)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def target_forwards(self) -> int:
        return len(self.steps)

    @property
    def mean_accepted_tokens(self) -> float:
        return metrics.mean_accepted_tokens(self.steps)

    @property
    def acceptance_rate(self) -> float | None:
        return metrics.acceptance_rate(self.steps)

    @property
    def accepted_per_position(self) -> list[float]:
        return metrics.accepted_per_position(self.steps)

    @property
    def tokens_per_second(self) -> float:
        return metrics.tokens_per_second(self.new_tokens, self.seconds)

    @property
    def draft_seconds(self) -> float:
        return sum(s.draft_seconds for s in self.steps)

    @property
    def verify_seconds(self) -> float:
        return sum(s.verify_seconds for s in self.steps)

    def summary(self) -> dict:
        """The figures the CLI's --json prints and the benchmark records."""
        return {
            "method": self.method,
            "text": self.text,
            "token_ids": self.token_ids,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "target_forwards": self.target_forwards,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "accepted_per_position": self.accepted_per_position,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "finish_reason": self.finish_reason,
            "cached_tokens": self.cached_tokens,
            "tree_budget": self.tree_budget,
            "mean_draft_tokens": metrics.mean_drafted(self.steps),
            "stepped_aside": metrics.stepped_aside(self.steps),
            "forced_share": metrics.forced_share(self.steps),
        }


class Stream:
    """Iterate for StepEvents; once exhausted, `result` holds the GenerationResult. `items` gives, before
    the first event, each chunk of a long prompt's prefill too."""

    def __init__(self, events: Generator[StepEvent | Prefilled, None, GenerationResult]):
        self._events = events
        self.result: GenerationResult | None = None
        self._done = False

    def __iter__(self) -> Iterator[StepEvent]:
        for item in self.items():
            if isinstance(item, StepEvent):
                yield item

    def items(self) -> Generator[StepEvent | Prefilled, None, None]:
        """What each forward did: a chunk of the prompt fed (`Prefilled`), or a step's event. For a caller
        that acts between any two forwards (the server's worker notices a client leaving there). Leaving a loop
        over it early leaves the rest to the next (`close` stops the generation)."""
        while not self._done:
            try:
                item = next(self._events)
            except StopIteration as end:
                self.result, self._done = end.value, True
                return
            yield item

    def close(self) -> None:
        """Stop early (a client went away): no more steps, no result."""
        self._events.close()


def _origins(verdict: Verdict) -> list[TokenOrigin]:
    last: TokenOrigin = "target" if verdict.num_drafted == 0 else "bonus" if verdict.bonus else "corrected"
    accepted: list[TokenOrigin] = ["accepted"] * verdict.num_accepted
    return accepted + [last]


class SequenceState:
    """One sequence's way through generation, whichever engine steps it: its context and output, EOS and
    stop strings, the text emitted so far, per-step statistics, and its random generator."""

    def __init__(self, prompt_ids: list[int], config: GenerationConfig, tokenizer, target: CausalLM):
        self.config, self.max_context = config, target.max_context
        self.model_eos = frozenset() if config.ignore_eos else target.eos_token_ids
        self.eos = self.model_eos | frozenset(config.stop_token_ids)
        # on the target's device, so that sampling draws there; its positions' uniforms make a draft without
        # distributions give plain decoding's sampled tokens under the seed, whatever the gate or timings chose
        # (`sampling`; docs/verification.md, "Randomness")
        seed = config.seed if config.seed is not None else int(torch.randint(2**62, (), device="cpu"))
        self.generator = sampling.seeded(target.device, seed)
        self.tracker = TextTracker(tokenizer, config.stop, config.sampling.min_tokens, config.stop_token_ids)
        self.prompt_ids = list(prompt_ids)
        self.context = list(prompt_ids)
        self.output: list[int] = []
        self.steps: list[StepStats] = []
        self.finish_reason = "length"  # until EOS or a stop string
        if config.constraint is not None and config.sampling.min_tokens:  # (its grammar may end before)
            raise UserError("min_tokens cannot hold open an output a constraint shapes")
        # the grammar state after the context (None: unconstrained)
        self.matcher = None if config.constraint is None else Matcher(
            config.constraint, tokenizer, target.vocab_size, target.eos_token_ids)
        # what the penalties count (None: no penalty or bias)
        if any(not 0 <= t < target.vocab_size for t in [*config.stop_token_ids, *dict(config.sampling.logit_bias)]):
            raise UserError(f"logit_bias or stop_token_ids name a token id out of the vocabulary ({target.vocab_size})")
        self.history = TokenHistory(prompt_ids, config.sampling, target.vocab_size, target.device, self.eos) \
            if config.sampling.penalised else None
        self.logprobs: list[TokenLogprob] | None = None if config.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprob] | None = None  # (`echo`: set once the prompt is fed)
        self.cached = 0  # prompt tokens whose keys and values another sequence's prefill had computed (`engine.batch`)
        self.start = time.perf_counter()

    def room(self) -> int:
        """Tokens it may still add (0: done)."""
        if self.finish_reason != "length":
            return 0
        return min(self.config.max_new_tokens - len(self.output), self.max_context - len(self.context))

    def advance(self, draft: Draft, verdict: Verdict, draft_seconds: float, verify_seconds: float,
                forward_tokens: int, stepped_aside: bool = False) -> StepEvent:
        """Append a step's tokens (cut at EOS, a stop string or the room left); forward_tokens: the context
        tokens the step's forward carried before the draft; stepped_aside: the drafter was not asked."""
        remaining = self.room()
        new = list(verdict.tokens[:remaining])
        origins = _origins(verdict)[: len(new)]
        hit_eos = next((i for i, t in enumerate(new) if t in self.eos), None)
        if hit_eos is not None:
            del new[hit_eos + 1 :], origins[hit_eos + 1 :]
            self.finish_reason = "eos" if new[hit_eos] in self.model_eos else "stop"
        if self.matcher is not None:  # up to where the constraint is complete: nothing may follow
            del new[self.matcher.consume(new) :], origins[len(new) :]
            if self.matcher.complete and self.finish_reason == "length":
                self.finish_reason = "eos"
        previous = len(self.output)
        self.output.extend(new)
        if self.history is not None:
            self.history.add(new)
        self.context.extend(new)
        text, keep = self.tracker.update(self.output, previous)
        if keep is not None:
            del self.output[keep:]
            self.finish_reason = "stop"
        kept = len(self.output) - previous
        stats = StepStats(
            drafted=verdict.num_drafted,
            accepted=min(verdict.num_accepted, kept),
            new_tokens=kept,
            draft_seconds=draft_seconds,
            verify_seconds=verify_seconds,
            forward_tokens=forward_tokens + verdict.num_drafted,
            draft_depth=int(tree.depths(draft.parents).max()) if draft.parents is not None and len(draft) else None,
            auxiliary_tokens=len(draft.auxiliary) if draft.auxiliary is not None else 0,
            stepped_aside=stepped_aside,
            forced=min(draft.forced, verdict.num_accepted, kept),
        )
        self.steps.append(stats)
        scored = None if self.logprobs is None or verdict.logprobs is None else list(verdict.logprobs[:kept])
        if scored is not None and self.logprobs is not None:
            self.logprobs.extend(scored)
        return StepEvent(token_ids=new[:kept], origins=origins[:kept], text=text, stats=stats,
                         rejected_ids=list(verdict.rejected), logprobs=scored)

    def propose(self, drafter: Drafter | None, room: int) -> Draft:
        """This sequence's draft of at most `room` tokens (`engine.forced.propose`: the grammar's forced run
        first under a constraint, nothing it forbids)."""
        return forced.propose(drafter, self.context, room, self.config.sampling, self.generator, self.matcher)

    def verify(self, verifier, draft: Draft, logits: torch.Tensor) -> Verdict:
        """`verify_draft` with this sequence's sampling, generator, constraint and penalties."""
        return verify_draft(verifier, draft, logits, self.config.sampling, self.generator, self.matcher, self.history,
                            self.config.logprobs, position=len(self.context))

    def tail(self) -> StepEvent | None:
        """Once done: the text held back so far (an incomplete character), if any."""
        tail = self.tracker.finish(self.output)
        return StepEvent(token_ids=[], origins=[], text=tail, stats=StepStats(0, 0, 0, 0.0, 0.0, 0)) if tail else None

    def result(self, method: str, tree_budget: int | str | None = None) -> GenerationResult:
        return GenerationResult(
            prompt_ids=self.prompt_ids,
            token_ids=self.output,
            text=self.tracker.text,
            steps=self.steps,
            seconds=time.perf_counter() - self.start,
            finish_reason=self.finish_reason,
            method=method,
            tree_budget=tree_budget,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            cached_tokens=self.cached,
        )


@dataclass
class VerifiedStep:
    """One sequence's step, verified: what both engines hand to `conclude`."""

    draft: Draft  # what the target verified
    verdict: Verdict
    logits: torch.Tensor  # [len(draft) + 1 (+ aux), vocab] the sequence's rows of the forward
    num_pending: int  # context tokens the forward fed before the draft
    draft_seconds: float
    verify_seconds: float
    hidden: torch.Tensor | None = None  # [num_pending + len(draft) (+ aux), d] when the drafter needs them


def draft_inputs(draft: Draft, num_pending: int, context_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [p + n] and attention mask [p + n, p + n] bool of a forward over a sequence's p pending
    context tokens and its draft of n nodes: a tree's through its ancestor mask, a chain's causal."""
    if draft.layout is not None:  # a tree whose structure is on the device
        return tree.inputs_of(draft.layout.ancestors, draft.layout.depths, num_pending, context_length)
    if draft.parents is not None:  # a tree
        return tree.verification_inputs(draft.parents, num_pending, context_length)
    return tree.chain_inputs(num_pending + len(draft), num_pending, context_length)


def verify_draft(verifier, draft: Draft, logits: torch.Tensor, params: SamplingParams, generator,
                 matcher: Matcher | None = None, history: TokenHistory | None = None,
                 top_logprobs: int | None = None, position: int | None = None) -> Verdict:
    """Accept the longest admissible prefix (or tree path) of a sequence's draft and add the correction or
    bonus token, with the method's verifier. logits: [len(draft) + 1 (+ aux), vocab], the sequence's rows.
    The one place the target's distributions at the drafted positions are formed: under a constraint
    (`matcher`), each row is masked by the grammar state after its prefix (`Matcher.draft_masks`); under
    penalties or a bias (`history`), each is first processed as plain decoding would process it at its
    position, after the tokens on its path (`TokenHistory.penalise`). `top_logprobs` (not None): the verdict
    carries each token's log-probability and that many alternatives' (`engine.logprobs`). `position`: the output
    position the step decides first (the context's length), where a seeded generator's uniforms start
    (`sampling.SeededGenerator`)."""
    if isinstance(generator, sampling.SeededGenerator):
        generator.position = position
    raw = rows = logits[: len(draft) + 1]  # [draft_len + 1, vocab]
    if history is not None:
        rows = history.penalise(rows, draft)
    if matcher is not None:
        rows = masked_logits(rows, matcher.draft_masks(draft))
    if top_logprobs is None:
        return verifier(rows, draft, params, generator)
    verdict = verifier(rows, draft, params, generator,
                       riders=logprobs.riders(raw, rows, top_logprobs) if params.greedy else ())
    return replace(verdict, logprobs=logprobs.emitted(raw, verdict, top_logprobs))


def after_prefill(step: VerifiedStep, prefilled: int, pieces: list[torch.Tensor]) -> VerifiedStep:
    """A sequence's first step after `prefilled` prompt tokens were fed in chunks (`prefill`, whose hidden
    states are `pieces`), as if its forward had fed them: they count among its pending tokens, and their
    hidden states come first."""
    hidden = None if step.hidden is None else torch.cat([*pieces, step.hidden])  # [prefilled + num_pending + ..., d]
    return replace(step, num_pending=prefilled + step.num_pending, hidden=hidden)


def conclude(state: SequenceState, drafter: Drafter | None, step: VerifiedStep,
             stepped_aside: bool = False) -> StepEvent:
    """A verified step's end for one sequence: append its tokens (`SequenceState.advance`) and tell the
    drafter how its draft fared (`Drafter.observe`, with what it `needs` of the forward)."""
    event = state.advance(step.draft, step.verdict, step.draft_seconds, step.verify_seconds, step.num_pending,
                          stepped_aside=stepped_aside)
    if drafter is not None:  # of its own part: a forced run put ahead of its draft is not the drafter's
        logits = step.logits if drafter.needs.logits else None
        draft, verdict = forced.own_part(step.draft, step.verdict)
        drafter.observe(Outcome(draft, verdict, event.stats, logits, step.hidden, step.num_pending))
    return event
