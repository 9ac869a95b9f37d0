"""The draft-then-verify loop (Algorithm 2 of the survey), with plain decoding as its zero-draft case."""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator

import torch

from specdecode import devices
from specdecode.devices import to_device
from specdecode.drafters.base import Drafter
from specdecode.engine.payoff import StepAside
from specdecode.engine.prompts import Prefilled, check_prompt, prefill, token_ids
from specdecode.engine.sequence import (
    GenerationConfig, GenerationResult, SequenceState, StepEvent, Stream, VerifiedStep, after_prefill, conclude,
    draft_inputs, verify_draft,
)
from specdecode.engine import forced
from specdecode.engine.penalties import TokenHistory
from specdecode.constraints import Matcher
from specdecode.errors import UserError
from specdecode.models import holding
from specdecode.models.base import CausalLM
from specdecode.models.costs import MIN_CHUNK, CostCurve, prefill_chunk
from specdecode.models.live_curve import LiveCurve
from specdecode.types import AuxiliaryTokens, SamplingParams
from specdecode.tree.budget import cut_chain
from specdecode.verify.tree import verify

__all__ = ["GenerationConfig", "GenerationResult", "SpeculativeEngine", "StepEvent", "Stream", "with_auxiliary"]


def with_auxiliary(
    fed: torch.Tensor,  # [p + n] the pending context tokens, then the draft's
    positions: torch.Tensor,  # [p + n]
    mask: torch.Tensor,  # [p + n, p + n] bool
    auxiliary: AuxiliaryTokens,
    num_pending: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forward's inputs with auxiliary tokens appended: each sees every context token (the cache and
    the pending ones) and the auxiliary tokens its row allows, no draft node; no draft node sees them.
    Returns (tokens [p + n + m], positions [p + n + m], mask [p + n + m, p + n + m] bool)."""
    length, m = fed.numel(), len(auxiliary)
    full = torch.zeros(length + m, length + m, dtype=torch.bool, device=mask.device)
    full[:length, :length] = mask
    full[length:, :num_pending] = True
    full[length:, length:] = auxiliary.mask.to(mask.device)
    return (torch.cat([fed, auxiliary.tokens.to(fed.device)]),
            torch.cat([positions, auxiliary.positions.to(positions.device)]), full)


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
        clock: Callable[[], float] | None = None,
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
        # times the target's forwards, which keep its cost curve honest, and whole steps, for the step-aside
        # switch, without waiting for the device: on CUDA between events, each span known once the device has
        # passed it, a step or two later (`devices.stopwatch`). `clock` (a test's fake clock, or
        # `devices.clock(device)`, which waits at every reading): read at once instead. A test may assign one.
        self.stopwatch = devices.stopwatch(target.device, clock)
        # step aside (plain steps) while speculation is timed slower than plain decoding (`engine.payoff`);
        # None: wherever the gate follows a measured curve, not a fixed one (tests fix theirs), and the drafter
        # does not weigh its own steps (`Drafter.weighs_itself`)
        self._step_aside = step_aside
        self._forget = False  # the drafter forgets earlier sequences at its next begin (`forget`)
        self._busy = False  # a sequence is being decoded (`_events`)
        # the target's cache, held while a sequence decodes on it (`models.holding`)
        self._cache = holding.Holder(target, "this model is decoding another sequence (an engine made from the same "
                                     "models, or a batch): engines that share a model take turns, one sequence at a "
                                     "time; engine.batch.BatchEngine, or the server, decodes several at once")

    @functools.cached_property
    def step_aside(self) -> StepAside | None:
        """The switch between speculative and plain steps, or None where every step speculates."""
        if self.drafter is None:
            return None
        wanted = self._step_aside
        if wanted is None:
            wanted = self.gate and isinstance(self.curve, LiveCurve) and not self.drafter.weighs_itself
        return StepAside(dear_trials=self.drafter.catches_up) if wanted else None

    def forget(self) -> None:
        """Forget what was learnt from earlier sequences (a benchmark's repeats start afresh): the drafter
        at its next `begin`."""
        self._forget = True
        if self.step_aside is not None:
            self.step_aside.forget()

    @functools.cached_property
    def curve(self) -> CostCurve | LiveCurve:
        """The target's verification cost curve (measured on first use, cached per machine, corrected by
        the forwards this engine times; a test may assign a fixed one)."""
        return self.target.cost_curve()

    @functools.cached_property
    def prefill_chunk(self) -> int:
        """Prompt tokens one forward of a prefill feeds at most (`costs.prefill_chunk`; a test may assign it)."""
        return prefill_chunk(self.target.cost_curve())

    def step(
        self, context: list[int], room: int, params: SamplingParams, generator, speculate: bool = True,
        matcher: Matcher | None = None, history: TokenHistory | None = None, top_logprobs: int | None = None,
    ) -> VerifiedStep:
        """One speculative step after `context`, drafting at most `room` tokens (none: `speculate=False`):
        the draft, its verdict and the target's rows for it, and the seconds spent drafting and verifying.
        What the step appends to the output, and what the drafter learns of it, follow in `conclude`.
        `matcher`: the constraint's state after `context`, which cuts the draft and masks every row; `history`:
        what the penalties count after `context` (`engine.penalties`), which penalises every row; `top_logprobs`:
        the verdict carries its tokens' log-probabilities (`engine.logprobs`).
        The seconds drafting and verifying are the host's, read without waiting for the device: where drafting
        only queues device work, its time shows in verification's, which ends with the step's read of the
        verdict (it waits for everything queued), so their sum stays the step's."""
        # 1. Draft: the drafter proposes up to `room` tokens (none at all for plain decoding). A chain
        #    that comes with acceptance estimates is cut to the prefix that pays on the target's cost
        #    curve: where a wider forward costs nearly as much as the tokens it may save, speculation
        #    switches itself off for the step.
        start = self.stopwatch.now()
        pending = context[self.target.cache_length :]
        drafter = self.drafter if room > 0 and speculate else None  # None: a plain step
        if self.gate and self.drafter is not None:  # the step is priced over the cache it runs over (`LiveCurve.at`)
            self.curve.at(self.target.cache_length)
        # (under a constraint: the grammar's forced run first, and nothing it forbids: `engine.forced`)
        draft = forced.propose(drafter, context, room, params, generator, matcher)
        if self.gate and draft.scores is not None:
            cut = cut_chain(draft, self.curve, pending=len(pending))
            # now and then one size wider than pays, to time it again (`LiveCurve.probe`); a chain only: a tree cut
            # to a subtree has no wider prefix of its own (the next chain probes for it)
            probe = (self.curve.probe(len(pending) + len(cut)) if len(cut) < len(draft) and not draft.is_tree
                     else None)
            draft = cut if probe is None else draft.prefix(max(len(cut), probe - len(pending)))
        drafted = self.stopwatch.now()
        # 2. Verify: one target forward over the tokens it has not seen yet plus the draft gives the
        #    target's distribution after the context and after every draft token (for a tree, after every
        #    node's path, through the tree attention mask and the nodes' positions). Auxiliary tokens
        #    (lookahead decoding's window) ride after the draft, unseen by it; their rows are the drafter's.
        device = self.target.device
        fed = torch.cat([to_device(pending, device), to_device(draft.tokens, device)])  # [p + n], on the device
        positions = mask = None  # a chain alone: consecutive positions after the cache, causal
        if draft.is_tree or draft.auxiliary is not None:
            positions, mask = draft_inputs(draft, len(pending), len(context))
            if draft.auxiliary is not None:
                fed, positions, mask = with_auxiliary(fed, positions, mask, draft.auxiliary, len(pending))
        rows = fed.numel() - len(pending) + 1  # from the last context token's on
        hidden = self.drafter.needs.hidden if self.drafter is not None else False
        # the curve learns from the timed forward, but for a sequence's first: the prompt's prefill (cold
        # caches, attention over the whole prompt, or its last chunk) prices nothing a draft's verification costs
        timed = self.gate and self.drafter is not None and self.target.cache_length > 0 and len(pending) == 1
        forward_start = self.stopwatch.mark() if timed else None
        out = self.target.forward(fed, positions=positions, tree_mask=mask, num_logits=rows, output_hidden=hidden)
        if forward_start is not None:  # (its seconds come once the device has done it)
            observe = functools.partial(self.curve.observe, fed.numel(), context=len(context) - len(pending))
            self.stopwatch.measure(forward_start, self.stopwatch.mark(), observe)
        # 3. Accept the longest admissible prefix (or tree path) and add the correction or bonus token.
        verdict = verify_draft(self.verifier, draft, out.logits, params, generator, matcher, history, top_logprobs,
                               position=len(context))
        # 4. Roll back: the cache keeps the context and the accepted drafts (auxiliary tokens, past the
        #    draft, go with the rejected nodes); the last token of the verdict is fed in the next forward.
        self.target.compact(len(context), verdict.path)
        return VerifiedStep(draft, verdict, out.logits, len(pending), drafted - start,
                            self.stopwatch.now() - drafted, out.hidden)

    def _events(self, prompt_ids: list[int], config: GenerationConfig
                ) -> Generator[StepEvent | Prefilled, None, GenerationResult]:
        """`_decode`, one sequence at a time: the target's cache and the drafter hold one sequence's state."""
        if self._busy:
            raise UserError("this engine is decoding another sequence (another thread's, or a stream not run to its "
                            "end nor closed): it decodes one at a time (engine.batch.BatchEngine decodes several)")
        self._cache.take()
        self._busy = True
        try:
            return (yield from self._decode(prompt_ids, config))
        finally:
            self._busy = False
            self._cache.let_go()

    def _decode(self, prompt_ids: list[int], config: GenerationConfig
                ) -> Generator[StepEvent | Prefilled, None, GenerationResult]:
        check_prompt(self.target, prompt_ids)
        self.target.reset()
        if self.gate and self.drafter is not None:
            _ = self.curve  # measured (once per model and machine) before the target's cache is in use
        if self.drafter is not None:
            self.drafter.begin(list(prompt_ids), forget=self._forget)
            self._forget = False
        state = SequenceState(prompt_ids, config, self.tokenizer, self.target)
        # A long prompt is fed a chunk a forward (a caller may stop between two: `Stream.items`), all but the
        # last chunk, which the first step feeds with its draft. (No chunk splits a prompt of MIN_CHUNK tokens:
        # its chunk needs no cost curve.)
        hidden = self.drafter.needs.hidden if self.drafter is not None else False
        chunk = self.prefill_chunk if len(prompt_ids) > MIN_CHUNK else MIN_CHUNK
        if config.echo:  # every prompt token but the last fed, each scored
            state.prompt_logprobs = []
        pieces = yield from prefill(self.target, prompt_ids, chunk, hidden, state.prompt_logprobs, config.logprobs or 0)
        prefilled = self.target.cache_length
        aside = self.step_aside
        if aside is not None:
            aside.begin()
        while (room := state.room()) > 0:
            self.stopwatch.settle()  # the timings of earlier steps the device has done with, before choosing
            start = self.stopwatch.mark() if aside is not None else None
            speculate = aside is None or aside.speculate
            # Each step emits at least one token beyond its accepted drafts, hence room - 1.
            step = self.step(state.context, room - 1, config.sampling, state.generator, speculate=speculate,
                             matcher=state.matcher, history=state.history, top_logprobs=config.logprobs)
            if prefilled:  # the first step: the drafter sees the prompt as if this forward had fed it whole
                step, prefilled = after_prefill(step, prefilled, pieces), 0
            # 5. Append the step's tokens; the drafter learns how its draft fared.
            event = conclude(state, self.drafter, step, stepped_aside=not speculate)
            if aside is not None and start is not None:
                self.stopwatch.measure(start, self.stopwatch.mark(),
                                       aside.took(event.stats.new_tokens, drafted=event.stats.drafted > 0))
            yield event
            if state.finish_reason != "length":
                break
        if (tail := state.tail()) is not None:
            yield tail
        return state.result(self.method, self.tree_budget)

    def stream(self, prompt_ids: list[int], config: GenerationConfig | None = None) -> Stream:
        """Generate step by step: iterate the returned Stream for StepEvents, then read `.result`."""
        if config is not None and not isinstance(config, GenerationConfig):
            raise UserError(f"config must be a GenerationConfig, got {type(config).__name__}")
        return Stream(self._events(token_ids(prompt_ids), config or GenerationConfig()))

    def generate(
        self,
        prompt_ids: list[int],
        config: GenerationConfig | None = None,
        on_step: Callable[[StepEvent], None] | None = None,
    ) -> GenerationResult:
        stream = self.stream(prompt_ids, config)
        try:
            for event in stream:
                if on_step is not None:
                    on_step(event)
        finally:
            # an exception out of on_step, or Ctrl-C, frees the engine and its model now, not when the traceback
            # that holds the suspended stream goes (a notebook keeps the last one)
            stream.close()
        assert stream.result is not None
        return stream.result
