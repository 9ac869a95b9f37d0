"""The batch's clock (`engine.batch.BatchEngine` times its steps): turns between long prompts' chunks and the other
sequences' steps (`PrefillShare`), and the pace at which the batch outputs tokens (`Pace`)."""

from __future__ import annotations

from collections.abc import Callable

from specdecode.engine.payoff import Rate
from specdecode.errors import UserError
from specdecode.models.costs import CHUNK_SECONDS, MIN_CHUNK


CHUNK_POLICIES = ("turns", "every")  # when a long prompt's chunk goes into a step (`PrefillShare`)


class PrefillShare:
    """Turns between long prompts' chunks and the other sequences' steps, and the chunks' size.

    Policy "turns" (the default): a chunk goes into a step once the steps since the previous chunk have taken as long
    as that chunk did (or when the step would carry nothing else). So while a long prompt is fed, the sequences
    decoding get at least half of the time at their own pace (and a token in each chunk's step too), and the prompt
    the other half. Policy "every": a chunk goes into every step while a long prompt is fed, the decoding sequences
    riding in it (the chunked prefill of vLLM and Sarathi-Serve): no step of theirs waits for a chunk beside it, but
    each of their steps while the prompt is fed is a chunk's step, so small chunks go with it.

    A chunk is what takes `seconds` (CHUNK_SECONDS) at the pace of the last one, within MIN_CHUNK and the curve's chunk
    (`costs.prefill_chunk`, timed at the start of a prompt): a token's attention grows with the context, and
    a machine shared with other work slows every forward, so that a newcomer waits about as long for the
    chunk under way deep into a long prompt, or on a busy machine, as at its start on a quiet one."""

    def __init__(self, seconds: float = CHUNK_SECONDS, policy: str = "turns") -> None:
        if not seconds > 0:
            raise UserError(f"a chunk of prompt takes some time: chunk_seconds {seconds} is not above 0")
        if policy not in CHUNK_POLICIES:
            raise UserError(f"the chunk policy is one of {', '.join(CHUNK_POLICIES)}, not {policy!r}")
        self.seconds, self.policy = seconds, policy  # what a chunk takes at the pace of the last one; when it goes
        self.chunk_seconds = 0.0  # the last step that carried a chunk
        self.since = 0.0  # the steps after it
        self.per_token = 0.0  # the last chunk's step, seconds a token it fed (0: none yet)
        self._chunks = 0  # steps that carried a chunk

    def turn(self) -> bool:
        """Whether a chunk may go into the next step."""
        return self.policy == "every" or self.since >= self.chunk_seconds

    def chunk(self, most: int) -> int:
        """Prompt tokens the next step may carry, `most` at the most."""
        if not self.per_token > 0:
            return most
        return max(min(most, MIN_CHUNK), min(most, round(self.seconds / self.per_token)))

    def plan(self, prompts: dict[int, int], chunk: int, chunks: dict[int, int], only: bool, wait: set
             ) -> dict[int, int]:
        """The prompt tokens each sequence feeds in the next step, from the tokens each sequence feeding its prompt has
        left (`prompts`, in arrival order), `chunk` in all: prompts whose rest fits in a chunk whole, oldest first,
        while they fit in one chunk together; then, at a long prompt's turn (`turn`) or when the step would carry
        nothing else (`only` prompts are fed), what is left of the chunk to the long prompt that has fed the fewest
        chunks (`chunks`), then the oldest. Those in `wait` feed nothing."""
        plan: dict[int, int] = {}
        budget = chunk
        for ident, left in prompts.items():
            if ident in wait:
                continue
            if left <= chunk:
                if left > budget:
                    break
                plan[ident], budget = left, budget - left
        long = [(chunks[i], i) for i, left in prompts.items() if left > chunk and i not in wait]
        if long and budget and ((only and not plan) or self.turn()):
            plan[min(long)[1]] = budget
        return plan

    def took(self, chunked: bool, tokens: int) -> Callable[[float], None]:
        """A step fed `tokens`; `chunked`: a long prompt's chunk among them. Returns what takes its seconds once
        known (on a GPU a step or two later, `devices.EventStopwatch`): a chunk restarts the count of the steps
        since at once, and a step's seconds from before it, coming later, no longer count."""
        if chunked:
            self.since, self._chunks = 0.0, self._chunks + 1
        chunks = self._chunks

        def timed(seconds: float) -> None:
            if chunked:
                self.chunk_seconds, self.per_token = seconds, seconds / tokens
            elif chunks == self._chunks:
                self.since += seconds

        return timed


class Pace:
    """Seconds a token of the batch's output, over its latest steps (their seconds and output tokens decayed as the
    step-aside switch decays a way's, `engine.payoff.Rate`).

    What a sequence's drafting costs depends on who waits for it: alone, only itself, so a source of a composite is
    priced in plain steps of one sequence (`drafters.source_payoff`); in a batch, every sequence of the step waits, so
    its seconds cost as many tokens as the whole batch outputs in that time. The batch tells each sequence's drafter
    this pace before it drafts (`Drafter.batch_pace`)."""

    def __init__(self) -> None:
        self.rate = Rate()

    def took(self, tokens: int, then: Callable[[float], None]) -> Callable[[float], None]:
        """A step that output `tokens`: returns what takes its seconds once they are known, and hands them on to
        `then` (on a GPU a step or two later, `devices.EventStopwatch`)."""

        def timed(seconds: float) -> None:
            self.rate.add(seconds, tokens)
            then(seconds)

        return timed

    @property
    def per_token(self) -> float | None:
        """Seconds a token (None before a step that output one is timed)."""
        return self.rate.per_token
