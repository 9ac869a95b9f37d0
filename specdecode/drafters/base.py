"""What every drafter offers the engine: propose a draft after a context; optionally learn from verdicts."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from specdecode.errors import UserError
from specdecode.tree.budget import check_budget
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


class Drafter(abc.ABC):
    """Proposes tokens to follow a context. A drafter never decides what is output: the verifier does,
    so any drafter is lossless under a lossless verifier; a better drafter is only a faster one."""

    name: str = "drafter"
    # True: drafts without running a model (neither its own nor the target), so one instance per sequence
    # can serve a batch (`engine.batch`)
    batchable: bool = False

    def begin(self, prompt_ids: list[int]) -> None:
        """A new sequence starts (forget per-sequence state)."""

    def forget(self) -> None:
        """Forget what was learnt across sequences too (a benchmark's repeats start afresh)."""

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

    def update(self, verdict: Verdict, stats: StepStats) -> None:
        """Learn from how the last step fared (adaptive draft length and the like)."""

    wants_logits: bool = False  # True: the engine calls observe() after every verification
    wants_hidden: bool = False  # True: the engine calls observe_hidden() after every verification
    # with wants_hidden: the target layers whose inputs observe_hidden() gets, side by side (None: the
    # final-norm state)
    hidden_layers: tuple[int, ...] | None = None

    def observe_hidden(self, hidden: torch.Tensor, num_pending: int, draft: Draft, verdict: Verdict) -> None:
        """The target's final-norm hidden states (or those of `hidden_layers`) of every token the step's
        forward fed: [p + n (+ aux), d],
        the p = num_pending context tokens first, then the draft's nodes (trained heads draft from them)."""

    def observe(self, draft: Draft, logits: torch.Tensor, verdict: Verdict) -> None:
        """The target's logits from the step's verification, before update(): [len(draft) + 1 + aux, vocab],
        row i the distribution after the context and draft node i - 1 (row 0: after the context), then
        one row per auxiliary token of the draft (`Draft.auxiliary`). Jacobi and lookahead decoding
        draft from them."""


@dataclass(frozen=True)
class DrafterOptions:
    tree: bool = False  # draft a token tree instead of a chain
    budget: int | None = None  # tree nodes verified per step; None: chosen from the measured cost curve
    choices: tuple[tuple[int, ...], ...] | None = None  # a fixed tree shape (draft model only)
    datastore: str | None = None  # a retrieval datastore (`specdecode datastore build`); None: the default
    reference_ids: tuple[int, ...] | None = None  # a document to copy from (retrieved passages, a file being edited)
    tokenizer: object | None = field(default=None, compare=False)  # the target's, for drafters that tokenize text
    # the draft model's when it differs from the target's (its drafts are translated through text); None: the same
    draft_tokenizer: object | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.budget is not None and not self.tree:
            raise UserError("a budget applies to token trees; add --tree")
        check_budget(self.budget)
        if self.choices is not None and not self.tree:
            raise UserError("tree choices apply to token trees; add --tree")
