"""Whether speculation pays for the sequence being decoded: the engine's step-aside switch.

The gate (`tree.budget.cut_chain`) cuts scored chains on the target's cost curve, but a curve prices the
target's forward only. Drafting, the Python around a step, attention that grows with the context, and
the trees and windows a drafter sends whole all escape it: where width is dear (a CPU without bf16
units) a method the curve lets through can still be slower than plain decoding.

So the engine also times whole steps, from the draft to the drafter's update (on a GPU between two events
on the device's stream, without waiting for it: a step's seconds come a step or two later, `took`), and
keeps for each way of stepping (speculate, or plain: no draft at all, the drafter not even asked) the
seconds per output token of its latest steps. It plays the faster one (the other must beat it by MARGIN to
take over) and tries the other again now and then, at intervals that double while the choice holds
(FIRST_PERIOD up to LAST_PERIOD steps). A plain trial costs only the speedup it forgoes (TRIAL["plain"]
steps); a speculative trial where speculation does not pay costs what its few steps lose. Which way a step
goes never changes what it outputs: the verifier decides that, and a plain step is the target's own.

A new sequence starts with a speculative trial unless speculation leads: acceptance depends on the
prompt more than on anything learnt from earlier ones. Unless trials are dear: the first speculative step
after plain ones is not timed (a drafter with a model of its own catches up on the tokens it skipped
then, a draft model on the whole prompt at a sequence's first draft), but its seconds beyond a plain step
are what a trial costs. Where that exceeds DEAR plain steps, a new sequence carries on the plain run, and
plain runs last long enough that trials cost at most TRIAL_SHARE of the time (for a draft model that does
not pay on this machine: a trial every few sequences instead of a prompt prefill in every one). Only a drafter
that owes such work calls trials dear (`Drafter.catches_up`): for the copies and Medusa a slow first speculative
step is the machine's noise, not a price worth carrying plain runs across sequences for.

A drafter that weighs each step's cost against its gain itself (`Drafter.weighs_itself`: `auto`) gets no switch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

SPECULATE, PLAIN = "speculate", "plain"
TRIAL = {SPECULATE: 4, PLAIN: 2}  # steps a trial of the trailing way lasts
FIRST_PERIOD, LAST_PERIOD = 8, 64  # steps the leading way keeps before the other is tried again
MARGIN = 0.03  # how much faster per token the trailing way must be to take the lead
DECAY = 0.8  # weight of a way's earlier steps in its running seconds per token, per step it takes
DEAR = 2.0  # a trial costing more than this many plain steps is dear (see the module's docstring)
TRIAL_SHARE = 0.05  # the most of the time dear trials may cost while plain decoding leads


@dataclass
class Rate:
    """Decayed seconds and tokens of the latest steps (of one way here; of a batch's steps, `engine.pacing.Pace`)."""

    seconds: float = 0.0
    tokens: float = 0.0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds = DECAY * self.seconds + seconds
        self.tokens = DECAY * self.tokens + tokens

    @property
    def per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens > 0 else None


class StepAside:
    """Decides, step by step, whether the engine drafts (`speculate`), from the steps it times (`record`)."""

    def __init__(self, dear_trials: bool = True) -> None:
        # False: the drafter owes nothing after plain steps (`Drafter.catches_up`), so a slow first speculative step
        # is noise, never a price that keeps whole sequences plain
        self.dear_trials = dear_trials
        self.forget()

    def forget(self) -> None:
        """Start afresh (a benchmark's repeat): speculation leads until timed otherwise."""
        self.rates = {SPECULATE: Rate(), PLAIN: Rate()}
        self.leader, self.period = SPECULATE, FIRST_PERIOD
        self.way, self.left, self.trial = SPECULATE, TRIAL[SPECULATE], True
        self._previous: str | None = None  # the way of the last step timed (None: a sequence starts)
        self.catch_up = 0.0  # seconds of the latest untimed first speculative step after plain ones

    @property
    def trial_cost(self) -> float:
        """Seconds a speculative trial costs beyond plain steps before it is timed (its catch-up step)."""
        plain = self.rates[PLAIN].per_token
        return 0.0 if plain is None else max(0.0, self.catch_up - plain)

    def _dear(self) -> bool:
        plain = self.rates[PLAIN].per_token
        return self.dear_trials and plain is not None and self.trial_cost > DEAR * plain

    def begin(self) -> None:
        """A new sequence: its first step (the prompt's prefill) is not timed; a speculative trial first
        unless speculation leads or trials are dear."""
        self._turn()
        self._previous = None
        if self.leader == PLAIN and not self._dear():
            self.way, self.left, self.trial = SPECULATE, TRIAL[SPECULATE], True

    @property
    def speculate(self) -> bool:
        """Whether the next step drafts."""
        self._turn()
        return self.way == SPECULATE

    def record(self, seconds: float, tokens: int, drafted: bool = True) -> None:
        """The step just taken (the way `speculate` said) took `seconds` and output `tokens` tokens;
        `drafted`: whether it verified a draft."""
        self.took(tokens, drafted)(seconds)
        self._turn()

    def took(self, tokens: int, drafted: bool = True) -> Callable[[float], None]:
        """The step just taken (the way `speculate` said) output `tokens` tokens; `drafted`: whether it verified
        a draft. Returns what takes its seconds once they are known: on a GPU a step or two later
        (`devices.EventStopwatch`), so the runs are counted now, in the order played, and the rates follow
        when the timings come (the choice at a run's end misses its latest step or two)."""
        self._turn()
        # not timed: a sequence's first step (the prompt's prefill, whatever the way) and the first
        # speculative step after plain ones (a drafter with a cache catches up on the skipped tokens then),
        # a speculative step that drafted nothing counting as plain (a draft model waiting for its prefill
        # to pay, `drafters.draft_model.LateStart`, catches up on the whole context when it starts)
        catching_up = self.way == SPECULATE and self._previous == PLAIN
        # (the way's rate as it stands now: a timing that comes after `forget` goes to the one forgotten)
        rate = self.rates[self.way] if self._previous is not None and not catching_up and tokens > 0 else None

        def timed(seconds: float) -> None:
            if rate is not None:
                rate.add(seconds, tokens)
            elif catching_up and drafted:
                self.catch_up = seconds

        self._previous = self.way if drafted else PLAIN
        self.left -= 1
        return timed

    def _turn(self) -> None:
        """The run just played over: choose the next (at the next decision, by when a host clock's timings of
        its steps are in)."""
        if self.left <= 0:
            self._next_run()

    def _next_run(self) -> None:
        other = PLAIN if self.way == SPECULATE else SPECULATE
        # the other way never timed, or the leader's period over: try the other way
        if self.rates[other].per_token is None or not self.trial:
            self.way, self.left, self.trial = other, TRIAL[other], True
            return
        winner = self._winner()
        if winner == self.leader:
            self.period = min(2 * self.period, LAST_PERIOD)
        else:
            self.leader, self.period = winner, FIRST_PERIOD
        plain = self.rates[PLAIN].per_token
        if self.leader == PLAIN and plain is not None and self._dear():
            # plain runs long enough for the trials to cost TRIAL_SHARE
            self.period = max(self.period, math.ceil(self.trial_cost / (TRIAL_SHARE * plain)))
        self.way, self.left, self.trial = self.leader, self.period, False

    def _winner(self) -> str:
        leader, other = self.leader, PLAIN if self.leader == SPECULATE else SPECULATE
        ours, theirs = self.rates[leader].per_token, self.rates[other].per_token
        if ours is None:
            return other
        return other if theirs is not None and theirs * (1 + MARGIN) < ours else leader
