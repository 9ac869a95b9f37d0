"""What every drafter offers the engine: begin a sequence, propose a draft after a context, observe how it went."""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from specdecode import devices
from specdecode.types import Draft, SamplingParams, StepStats, Verdict


class RunningAcceptance:
    """The running chance that a drafted token is accepted: decayed counts of a drafter's accepted and
    rejected tokens (the past weighs `decay` per verified draft), with a prior of `prior` worth `weight`
    tokens. The prior keeps one unlucky first token (the opening of an answer is the least predictable)
    from reading as a drafter that is never right, which would switch drafting off for the next steps."""

    def __init__(self, prior: float = 2 / 3, weight: float = 3.0, decay: float = 0.9):
        self.prior, self.weight, self.decay = prior, weight, decay
        self.reset()

    def reset(self) -> None:
        self.accepted = self.rejected = 0.0

    def record(self, verdict: Verdict) -> None:
        """A verified draft: its accepted tokens, and one rejected unless every drafted token was accepted."""
        self.accepted = self.decay * self.accepted + verdict.num_accepted
        self.rejected = self.decay * self.rejected + (0 if verdict.bonus else 1)

    @property
    def value(self) -> float:
        return (self.accepted + self.prior * self.weight) / (self.accepted + self.rejected + self.weight)


def own_verdict(verdict: Verdict, prepended: int) -> Verdict:
    """The verdict on a drafter's own tokens when `prepended` tokens it did not propose led the chain it was
    judged in (a constraint's forced run, put ahead of a drafter that drafts from the tokens alone:
    `engine.forced`, `Draft.forced`): their acceptance is not the drafter's, and where the target turned one of
    them down the drafter's tokens were never judged (nothing drafted, nothing rejected: nothing to learn)."""
    if not prepended:
        return verdict
    if verdict.num_accepted < prepended:
        return Verdict(num_drafted=0, num_accepted=0, tokens=verdict.tokens[verdict.num_accepted :], bonus=False)
    return Verdict(num_drafted=verdict.num_drafted - prepended, num_accepted=verdict.num_accepted - prepended,
                   tokens=verdict.tokens[prepended:], path=tuple(node - prepended for node in verdict.path[prepended:]),
                   bonus=verdict.bonus, rejected=verdict.rejected)


@dataclass(frozen=True)
class Needs:
    """What a drafter asks to observe of each step's target forward, beyond the verdict and statistics
    (`Outcome`). Every other drafter costs the engine nothing: no logits kept, no hidden states computed."""

    logits: bool = False  # the target's logits (Jacobi and lookahead decoding draft from them)
    # the target's hidden states of every token the forward fed (trained heads draft from them): True, the
    # final-norm state the LM head reads; a tuple of layer indices, the inputs of those layers side by side
    hidden: bool | tuple[int, ...] = False


@dataclass(frozen=True)
class Outcome:
    """How one step went, for the drafter that drafted it: `Drafter.observe`'s one argument."""

    # what the target verified of the drafter's own proposal (of a chain, the prefix the engine's gate kept); a
    # composite's sources hear of their own proposals instead (`drafters.composite`). Under a constraint a forced
    # run the engine put ahead of the drafter's draft is left out, draft and verdict (`engine.forced.own_part`);
    # `draft.forced` then counts the forced tokens the drafter's own draft began with
    draft: Draft
    verdict: Verdict  # what verification made of it: the accepted nodes, then the correction or bonus token
    stats: StepStats  # the step's statistics (`new_tokens`: what it appended to the context, after stops)
    # with Needs.logits, [len(draft) + 1 + aux, vocab]: row i the distribution after the context and draft
    # node i - 1 (row 0: after the context), then one row per auxiliary token of the draft (`Draft.auxiliary`)
    logits: torch.Tensor | None = None
    # with Needs.hidden, [num_pending + len(draft) + aux, d]: the pending context tokens' states, then the
    # draft nodes' (and the auxiliary tokens')
    hidden: torch.Tensor | None = None
    num_pending: int = 0  # context tokens the forward fed before the draft
    # the accepted path of the draft the forward fed, whose rows `hidden` holds, where `verdict` judges
    # another (a composite's source hears of its own proposal, `drafters.composite`); None: verdict.path
    fed_path: tuple[int, ...] | None = None

    @property
    def accepted_path(self) -> tuple[int, ...]:
        """The accepted nodes of the fed draft, in `hidden`'s rows after the pending ones: the tokens the
        context gained whose states the forward computed."""
        return self.verdict.path if self.fed_path is None else self.fed_path

    def require_hidden(self) -> torch.Tensor:
        """`hidden`, which the engine gives every drafter whose `needs` asks for it."""
        if self.hidden is None:
            raise ValueError("no hidden states in this outcome: the drafter's `needs` must ask for them")
        return self.hidden


class Drafter(abc.ABC):
    """Proposes tokens to follow a context. A drafter never decides what is output: the verifier does,
    so any drafter is lossless under a lossless verifier; a better drafter is only a faster one.

    Three calls, in this order: `begin` once per sequence, then per step `propose` and, after the target
    has verified the draft, `observe` with how it went (the draft may have been cut, or not asked for:
    `observe` comes every step all the same, with an empty draft). A drafter that reads the target's
    logits or hidden states says so in `needs`."""

    name: str = "drafter"
    # True: drafts without running a model of its own or the target (a trained head that reads the target's
    # features counts: its sequences' rows go through it in one call a step), so that one instance per sequence
    # (`for_sequence`) can serve a batch (`engine.batch`)
    batchable: bool = False
    # True: its first draft after plain steps (the engine's step-aside switch, `engine.payoff`) does extra work
    # for the tokens it did not draft (a draft model's cache catching up). False where nothing is owed: a slow
    # such step is then the machine's noise, not what a trial of speculation costs
    catches_up: bool = True
    # True: it weighs each step's cost against its gain itself (`auto`'s composite: every node it submits pays on
    # the target's cost curve, every source's drafting time is charged against the tokens it adds), so the engine's
    # step-aside switch, which judges from timings of whole steps, is left out (`engine.loop`)
    weighs_itself: bool = False
    needs: Needs = Needs()

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        """A new sequence starts: forget per-sequence state; with `forget`, also what was learnt from
        earlier sequences (a benchmark's repeats start afresh)."""

    @abc.abstractmethod
    def propose(
        self,
        context: list[int],
        max_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        """Propose tokens to follow `context` (prompt + output so far): a chain of at most `max_tokens`
        tokens, or a token tree at most `max_tokens` deep."""

    def observe(self, outcome: Outcome) -> None:
        """Learn from how the step went (adaptive draft length, the next guesses, the target's features)."""

    def memory_bytes(self) -> int:
        """What this drafter holds apart from the models, in bytes, where that is large enough to count: a
        server keeps one drafter per owner for the methods that learn (`serve.engines`) and caps their sum."""
        return 0

    def for_sequence(self, memory: Memory | None = None) -> Drafter:
        """A new drafter like this one for one sequence of a batch (`batchable` drafters): it shares what no
        sequence changes (a head's weights and its batched call, a datastore) and starts afresh in the rest.
        `memory`: its owner's, which a drafter that remembers earlier requests reads, and adds this sequence to
        at its `end` (None: a memory of its own, forgotten after)."""
        raise NotImplementedError(f"the {self.name} drafter cannot join a batch")

    def batch_pace(self, seconds_per_token: float | None) -> None:
        """The batch this sequence decodes in outputs a token every `seconds_per_token` (None: the sequence decodes
        alone, or the pace is not yet known): told before each step's draft (`engine.batch.Pace`). A drafter that
        weighs its own drafting time against the tokens it gains prices it at that pace, since in a batch every
        sequence waits for it (`drafters.composite`); others ignore it."""

    def end(self) -> None:
        """The sequence is over (ended, or dropped): a batched sequence's drafter leaves what its owner's later
        sequences may read in its `memory`, and is not used again."""


Part = TypeVar("Part")


class Memory:
    """What one owner's sequences leave for its later ones: a server keeps one per owner and method while the
    owner's batched sequences come and go (`serve.engines`); each drafter that remembers keeps its part under a
    name of its own (`part`), reads it while a sequence runs and adds the sequence to it at the end
    (`Drafter.end`). Nothing in it reaches another owner."""

    def __init__(self) -> None:
        self._parts: dict[str, Any] = {}

    def part(self, name: str, make: Callable[[], Part]) -> Part:
        """The part kept under `name`, made on first use."""
        if name not in self._parts:
            self._parts[name] = make()
        return self._parts[name]

    def memory_bytes(self) -> int:
        return sum(part.memory_bytes() for part in self._parts.values() if hasattr(part, "memory_bytes"))


def tensor_bytes(*things) -> int:
    """Bytes of the distinct tensor storages in `things`: tensors, modules (parameters and buffers), optimisers
    (their state) and lists, tuples, deques and dicts of them; anything else counts nothing."""
    seen: dict[int, int] = {}
    stack = list(things)
    while stack:
        thing = stack.pop()
        if isinstance(thing, torch.Tensor):
            storage = thing.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(thing, torch.nn.Module):
            stack += [*thing.parameters(), *thing.buffers()]
        elif isinstance(thing, torch.optim.Optimizer):
            stack += list(thing.state.values())
        elif isinstance(thing, dict):
            stack += list(thing.values())
        elif isinstance(thing, (list, tuple, deque)):
            stack += list(thing)
    return sum(seen.values())


def late_values(draft: Draft) -> list:
    """The host values of a draft's riders (`Draft.riders`): those its verdict brought (`Draft.read`), else read
    now (a draft that was replaced, or verified otherwise)."""
    return draft.read if draft.read is not None else devices.to_host(*draft.riders)
