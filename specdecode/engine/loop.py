"""The draft-then-verify loop (Algorithm 2 of the survey), with plain decoding as its zero-draft case."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from specdecode import metrics
from specdecode.drafters.base import Drafter
from specdecode.engine.payoff import StepAside
from specdecode.engine.stopping import TextTracker
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.models.costs import CostCurve, LiveCurve
from specdecode.types import AuxiliaryTokens, Draft, SamplingParams, StepStats, TokenOrigin, Verdict
from specdecode.tree import structure as tree
from specdecode.tree.budget import cut_chain
from specdecode.verify.tree import verify

MAX_NEW_TOKENS_LIMIT = 1 << 20


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings; the output text ends right before the first one
    seed: int | None = None  # seeds the one torch.Generator every random choice goes through
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise UserError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))


@dataclass
class StepEvent:
    """What one step added to the output, for streaming."""

    token_ids: list[int]
    origins: list[TokenOrigin]  # how each token came about, parallel to token_ids
    text: str  # the new text (may be empty while a character is incomplete)
    stats: StepStats
    rejected_ids: list[int] = field(default_factory=list)  # a chain draft's tokens the target turned down


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only
    text: str
    steps: list[StepStats]
    seconds: float
    finish_reason: str  # "eos", "length" (max_new_tokens or the context is full) or "stop" (a stop string)
    method: str
    # Tree nodes verified per step: a fixed number, "auto" (chosen each step from the cost curve),
    # "whole" (a fixed shape verified whole); None for chains.
    tree_budget: int | str | None = None

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
            "tree_budget": self.tree_budget,
            "mean_draft_tokens": metrics.mean_drafted(self.steps),
            "stepped_aside": metrics.stepped_aside(self.steps),
        }


class Stream:
    """Iterate for StepEvents; once exhausted, `result` holds the GenerationResult."""

    def __init__(self, events: Iterator[StepEvent]):
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[StepEvent]:
        self.result = yield from self._events

    def close(self) -> None:
        """Stop early (a client went away): no more steps, no result."""
        self._events.close()


def with_auxiliary(
    fed: torch.Tensor,  # [p + n] the pending context tokens, then the draft's
    positions: torch.Tensor | None,  # [p + n]; None: consecutive after the cache
    mask: torch.Tensor | None,  # [p + n, p + n] bool; None: causal
    auxiliary: AuxiliaryTokens,
    num_pending: int,
    context_length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forward's inputs with auxiliary tokens appended: each sees every context token (the cache and
    the pending ones) and the auxiliary tokens its row allows, no draft node; no draft node sees them.
    Returns (tokens [p + n + m], positions [p + n + m], mask [p + n + m, p + n + m] bool)."""
    length, m = fed.numel(), len(auxiliary)
    if positions is None:  # a chain
        start = context_length - num_pending  # the cache length
        positions = torch.arange(start, start + length)
        mask = torch.ones(length, length, dtype=torch.bool).tril()
    full = torch.zeros(length + m, length + m, dtype=torch.bool)
    full[:length, :length] = mask
    full[length:, :num_pending] = True
    full[length:, length:] = auxiliary.mask
    return torch.cat([fed, auxiliary.tokens]), torch.cat([positions, auxiliary.positions]), full


def _origins(verdict: Verdict) -> list[TokenOrigin]:
    last: TokenOrigin = "target" if verdict.num_drafted == 0 else "bonus" if verdict.bonus else "corrected"
    return ["accepted"] * verdict.num_accepted + [last]


def check_prompt(target: CausalLM, prompt_ids: list[int]) -> None:
    """A UserError for a prompt the target cannot take."""
    if not prompt_ids:
        raise UserError("the prompt is empty")
    if len(prompt_ids) >= target.max_context:
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; the model's context holds {target.max_context}")
    bad = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
    if bad:
        raise UserError(f"token ids out of the vocabulary (size {target.vocab_size}): {bad[:5]}")


class Progress:
    """One sequence's way through generation, whichever engine steps it: its context and output, EOS and
    stop strings, the text emitted so far, per-step statistics, and its random generator."""

    def __init__(self, prompt_ids: list[int], config: GenerationConfig, tokenizer, target: CausalLM):
        self.config = config
        self.max_context = target.max_context
        self.eos = frozenset() if config.ignore_eos else target.eos_token_ids
        self.generator = torch.Generator()
        self.generator.manual_seed(config.seed if config.seed is not None else int(torch.randint(2**62, ()).item()))
        self.tracker = TextTracker(tokenizer, config.stop)
        self.prompt_ids = list(prompt_ids)
        self.context = list(prompt_ids)
        self.output: list[int] = []
        self.steps: list[StepStats] = []
        self.finish_reason = "length"  # until EOS or a stop string
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
            self.finish_reason = "eos"
        previous = len(self.output)
        self.output.extend(new)
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
            draft_depth=int(tree.depths(draft.parents).max()) if draft.is_tree and len(draft) else None,
            auxiliary_tokens=len(draft.auxiliary) if draft.auxiliary is not None else 0,
            stepped_aside=stepped_aside,
        )
        self.steps.append(stats)
        rejected = draft.tokens[verdict.num_accepted :].tolist() if not draft.is_tree else []
        return StepEvent(token_ids=new[:kept], origins=origins[:kept], text=text, stats=stats, rejected_ids=rejected)

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
        )


class SpeculativeEngine:
    """Runs draft-then-verify decoding of one sequence at a time on a target model.

    With no drafter every step drafts nothing and the loop is plain autoregressive decoding, the
    baseline every method is measured against.
    """

    def __init__(
        self,
        target: CausalLM,
        tokenizer=None,
        drafter: Drafter | None = None,
        method: str | None = None,
        tree_budget: int | str | None = None,
        gate: bool = True,
        verifier=verify,
        clock: Callable[[], float] = time.perf_counter,
        step_aside: bool | None = None,
    ):
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.method = method or (drafter.name if drafter else "ar")
        self.tree_budget = tree_budget
        self.gate = gate  # cut scored chains to the prefix that pays (see step)
        # exact (lossless) verification unless a lossy method brings its own (verify.typical)
        self.verifier = verifier
        self.clock = clock  # times the target's forwards, which keep its cost curve honest, and whole steps
        # step aside (plain steps) while speculation is timed slower than plain decoding (`engine.payoff`);
        # None: wherever the gate follows a measured curve, not a fixed one (tests fix theirs)
        self._step_aside = step_aside

    @functools.cached_property
    def step_aside(self) -> StepAside | None:
        """The switch between speculative and plain steps, or None where every step speculates."""
        if self.drafter is None:
            return None
        wanted = self._step_aside
        if wanted is None:
            wanted = self.gate and isinstance(self.curve, LiveCurve)
        return StepAside() if wanted else None

    def forget(self) -> None:
        """Forget what was learnt from earlier sequences (a benchmark's repeats start afresh)."""
        if self.drafter is not None:
            self.drafter.forget()
        if self.step_aside is not None:
            self.step_aside.forget()

    @functools.cached_property
    def curve(self) -> CostCurve | LiveCurve:
        """The target's verification cost curve (measured on first use, cached per machine, corrected by
        the forwards this engine times; a test may assign a fixed one)."""
        return self.target.cost_curve()

    def step(
        self, context: list[int], room: int, params: SamplingParams, generator, speculate: bool = True
    ) -> tuple[Draft, Verdict, float, float]:
        """One speculative step after `context`, drafting at most `room` tokens (none: `speculate=False`).

        Returns the draft, the verdict and the seconds spent drafting and verifying.
        """
        # 1. Draft: the drafter proposes up to `room` tokens (none at all for plain decoding). A chain
        #    that comes with acceptance estimates is cut to the prefix that pays on the target's cost
        #    curve: where a wider forward costs nearly as much as the tokens it may save, speculation
        #    switches itself off for the step.
        start = time.perf_counter()
        pending = context[self.target.cache_length :]
        asked = self.drafter is not None and room > 0 and speculate
        draft = self.drafter.propose(context, room, params, generator) if asked else Draft.empty()
        if self.gate and draft.scores is not None:
            cut = cut_chain(draft, self.curve, pending=len(pending))
            # now and then one size wider than pays, to time it again (`LiveCurve.probe`)
            probe = self.curve.probe(len(pending) + len(cut)) if len(cut) < len(draft) else None
            draft = cut if probe is None else draft.prefix(max(len(cut), probe - len(pending)))
        drafted = time.perf_counter()
        # 2. Verify: one target forward over the tokens it has not seen yet plus the draft gives the
        #    target's distribution after the context and after every draft token (for a tree, after every
        #    node's path, through the tree attention mask and the nodes' positions). Auxiliary tokens
        #    (lookahead decoding's window) ride after the draft, unseen by it; their rows are the drafter's.
        fed = torch.tensor(pending + draft.tokens.tolist())
        positions = tree_mask = None
        if draft.is_tree:
            positions, tree_mask = tree.verification_inputs(draft.parents, len(pending), len(context))
        if draft.auxiliary is not None:
            fed, positions, tree_mask = with_auxiliary(
                fed, positions, tree_mask, draft.auxiliary, len(pending), len(context))
        rows = fed.numel() - len(pending) + 1  # from the last context token's on
        hidden_wanted = self.drafter is not None and self.drafter.wants_hidden
        hidden = (self.drafter.hidden_layers or True) if hidden_wanted else False
        forward_start = self.clock()
        out = self.target.forward(fed, positions=positions, tree_mask=tree_mask, num_logits=rows,
                                  output_hidden=hidden)
        if self.gate and self.drafter is not None:
            self.curve.observe(fed.numel(), self.clock() - forward_start)
        logits = out.logits
        # 3. Accept the longest admissible prefix (or tree path) and add the correction or bonus token.
        verdict = self.verifier(logits[: len(draft) + 1], draft, params, generator)  # [draft_len + 1, vocab]
        if self.drafter is not None and self.drafter.wants_logits:
            self.drafter.observe(draft, logits, verdict)  # [rows, vocab], the auxiliary tokens' rows last
        if hidden_wanted:
            self.drafter.observe_hidden(out.hidden, len(pending), draft, verdict)
        # 4. Roll back: the cache keeps the context and the accepted drafts (auxiliary tokens, past the
        #    draft, go with the rejected nodes); the last token of the verdict is fed in the next forward.
        self.target.compact(len(context), verdict.path)
        return draft, verdict, drafted - start, time.perf_counter() - drafted

    def _events(self, prompt_ids: list[int], config: GenerationConfig) -> Iterator[StepEvent]:
        check_prompt(self.target, prompt_ids)
        if self.gate and self.drafter is not None:
            _ = self.curve  # measured (once per model and machine) before the target's cache is in use
        self.target.reset()
        if self.drafter is not None:
            self.drafter.begin(list(prompt_ids))
        progress = Progress(prompt_ids, config, self.tokenizer, self.target)
        aside = self.step_aside
        if aside is not None:
            aside.begin()
        while (room := progress.room()) > 0:
            forward_tokens = len(progress.context) - self.target.cache_length
            start, speculate = self.clock(), aside is None or aside.speculate
            # Each step emits at least one token beyond its accepted drafts, hence room - 1.
            draft, verdict, draft_seconds, verify_seconds = self.step(
                progress.context, room - 1, config.sampling, progress.generator, speculate=speculate)
            event = progress.advance(draft, verdict, draft_seconds, verify_seconds, forward_tokens,
                                     stepped_aside=not speculate)
            if self.drafter is not None:
                self.drafter.update(verdict, event.stats)
            if aside is not None:
                aside.record(self.clock() - start, event.stats.new_tokens)
            yield event
            if progress.finish_reason != "length":
                break
        if (tail := progress.tail()) is not None:
            yield tail
        return progress.result(self.method, self.tree_budget)

    def stream(self, prompt_ids: list[int], config: GenerationConfig | None = None) -> Stream:
        """Generate step by step: iterate the returned Stream for StepEvents, then read `.result`."""
        return Stream(self._events(list(prompt_ids), config or GenerationConfig()))

    def generate(
        self,
        prompt_ids: list[int],
        config: GenerationConfig | None = None,
        on_step: Callable[[StepEvent], None] | None = None,
    ) -> GenerationResult:
        stream = self.stream(prompt_ids, config)
        for event in stream:
            if on_step is not None:
                on_step(event)
        assert stream.result is not None
        return stream.result
