"""The small records that pass between drafters, verifiers and the engine.

Glossary (used the same way everywhere in specdecode):

- *context*: the token ids the target has seen or will see next: prompt plus the tokens generated so far.
- *draft*: the tokens a drafter proposes to follow the context, cheaply, before the target has looked.
- *target forward*: one forward pass of the target model; each speculative step makes exactly one.
- *token tree*: a draft of several candidate continuations sharing prefixes; node i holds one token and
  the index of its parent node (-1: the node follows the context directly). A chain is the tree whose
  node i has parent i - 1. The *depth* of a node is its distance from the context (1 for its children).
- *accepted* tokens: the draft tokens the verifier keeps (a prefix of a chain draft, or one root-to-node
  path of a tree draft).
- *correction* token (vLLM calls it *recovered*): after the first rejected draft token, the token the
  verifier takes instead — the target's argmax under greedy decoding, a sample from the residual
  distribution under speculative sampling.
- *bonus* token: when every draft token is accepted, the target's forward already gives the distribution
  of the next position for free; the token sampled from it is the bonus.
- Every step therefore emits ``accepted + 1`` tokens (the correction or the bonus), unless a stop
  condition cuts it short. *Mean accepted tokens* is new tokens per target forward and includes that
  one extra token (plain decoding scores exactly 1.0); metrics are defined once in `specdecode.metrics`.
- *lossless*: the output follows the target model's own distribution exactly (identical tokens under
  greedy decoding). Lossy verifiers say so with ``lossless = False``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from specdecode.errors import UserError


def check_types(owner, numbers: tuple[str, ...] = (), whole: tuple[str, ...] = (), optional: tuple[str, ...] = ()
                ) -> None:
    """A UserError naming the fields of a settings object (a dataclass a library caller fills) whose values are not
    numbers (`numbers`: int or float) or whole numbers (`whole`; in `optional` also None); True and False are
    neither (a string such as "0.5", a float of tokens, failed deep in the decoding, after the prompt's prefill)."""
    wrong = [(name, kinds) for names, kinds in ((numbers, (int, float)), (whole, int)) for name in names
             if not ((is_number if kinds == (int, float) else is_whole)(getattr(owner, name))
                     or (name in optional and getattr(owner, name) is None))]
    if wrong:
        said = "; ".join(f"{name} must be {'a number' if kinds == (int, float) else 'a whole number'}"
                         f"{' or None' if name in optional else ''}, got {getattr(owner, name)!r}"
                         for name, kinds in wrong)
        raise UserError(f"{type(owner).__name__}: {said}")


def frozen_items(owner, name: str, fits: Callable[[Any], bool], what: str,
                 convert: Callable[[Any], Any] = lambda item: item) -> None:
    """Field `name` of a frozen settings object made a tuple of its items, each `convert`ed (a caller's list changed
    after the checks then changes nothing: a NaN bias slipped past them so), each of which must `fits`; a UserError
    saying `what` they must be otherwise."""
    value = getattr(owner, name)
    try:
        items = tuple(value.items() if isinstance(value, Mapping) else value)
    except TypeError:
        items = None
    if items is None or isinstance(value, str | bytes) or not all(map(fits, items)):
        raise UserError(f"{type(owner).__name__}: {name} must be {what}, got {value!r}")
    object.__setattr__(owner, name, tuple(map(convert, items)))


def is_whole(value: Any, integral: type = int) -> bool:
    """An int (with `numbers.Integral`: numpy's too), not a bool."""
    return isinstance(value, integral) and not isinstance(value, bool)


def is_number(value: Any, real: type | tuple = (int, float)) -> bool:
    """An int or a float (with `numbers.Real`: numpy's too), not a bool."""
    return isinstance(value, real) and not isinstance(value, bool)


GREEDY_BELOW = 1e-5  # a temperature under this decodes greedily (`SamplingParams.greedy`)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` (or under `GREEDY_BELOW`) means greedy decoding.

    Temperature, top-k and top-p are applied identically to the target and draft distributions before
    speculative sampling, which is what keeps sampling lossless with respect to the *processed* target
    distribution.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filtering
    top_p: float = 1.0  # 1.0: no nucleus filtering
    # min-p (vLLM's): after temperature, keep the tokens at least min_p times as likely as the likeliest; 0: off
    min_p: float = 0.0
    # The penalties and biases change the target's logits before all of the above, and greedy decoding's argmax
    # too (`sampling.penalise`), at every position from the tokens before it (drafted ones included):
    # frequency: minus frequency_penalty times the times a token was generated so far (OpenAI's, in [-2, 2]);
    # presence: minus presence_penalty once it was generated at all (OpenAI's, in [-2, 2]);
    # repetition (vLLM's, > 0; 1: off): a token of the prompt or the output so far has its logit divided by it
    # where positive, multiplied where not. They count generated tokens, the prompt only for repetition.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits first; ids distinct
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's min_tokens: before this many tokens are generated, the tokens that would end the output (its
    # end-of-sequence and stop token ids) have their logits at -inf, after the penalties (`engine.penalties`), and
    # a stop string counts only once a token at that position or later completes it (`engine.stopping`)
    min_tokens: int = 0

    def __post_init__(self) -> None:
        check_types(self, numbers=("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                                   "repetition_penalty"), whole=("top_k", "min_tokens"))
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature > 100:
            raise UserError(f"temperature {self.temperature} is absurd; use a value in [0, 100]")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise UserError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        # (a penalty far under 0.01 divides a logit into float32's overflow: a NaN row, an id past the vocabulary)
        if not (math.isfinite(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100.0):
            raise UserError(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}")
        frozen_items(self, "logit_bias", lambda pair: isinstance(pair, tuple | list) and len(pair) == 2 and
                     is_whole(pair[0], numbers.Integral) and is_number(pair[1], numbers.Real),
                     "(token id, bias) pairs or a {token id: bias} mapping",
                     lambda pair: (int(pair[0]), float(pair[1])))
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(token < 0 for token in ids):
            raise UserError("logit_bias takes each token id (>= 0) once")
        if self.min_tokens < 0:
            raise UserError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise UserError("a logit_bias value must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below `GREEDY_BELOW` (as vLLM's): the limit of sampling as the temperature falls, and
        where dividing the logits by it would overflow float32 (a NaN row, then an id past the vocabulary)."""
        return self.temperature < GREEDY_BELOW

    @property
    def counts_tokens(self) -> bool:
        """Whether a position's logits depend on the tokens before it (a penalty is on)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def penalised(self) -> bool:
        """Whether the target's logits are changed before sampling (a penalty, a bias or min_tokens is on)."""
        return self.counts_tokens or bool(self.logit_bias) or self.min_tokens > 0


@dataclass(frozen=True)
class AuxiliaryTokens:
    """Tokens that ride in a step's target forward after the draft without being verified (lookahead
    decoding's Jacobi window). Each sees the whole context and the auxiliary tokens its `mask` row
    allows, never a draft node, and no draft node sees them, so the draft's logits are as without them.
    Their logits follow the draft's in what the drafter's observe() receives; their cache entries lie past
    the draft's and go with the rejected nodes."""

    tokens: torch.Tensor  # [m] int64
    positions: torch.Tensor  # [m] int64, their position ids
    mask: torch.Tensor  # [m, m] bool, mask[i, j]: auxiliary token i attends to auxiliary token j (itself: True)

    def __len__(self) -> int:
        return int(self.tokens.numel())


@dataclass
class DeviceLayout:
    """A tree draft whose structure lives on the device (grown and selected there: `tree.growth`), so that the
    step's one read is its verdict's: what verification needs of the structure, on the device."""

    ancestors: torch.Tensor  # [n, n] bool: node i sees node j (itself and its ancestors)
    depths: torch.Tensor  # [n] int64, 1 for the children of the context


@dataclass
class Draft:
    """Proposed tokens (a chain, or a token tree when `parents` is given) and, when the drafter sampled
    them, the distributions they came from."""

    tokens: torch.Tensor  # [draft_len] int64
    # [draft_len, vocab] float32, the processed distribution each token was drawn from; None for a
    # deterministic drafter (prompt lookup, greedy or top-k drafting), which verification treats as one-hot.
    # In a tree, siblings drawn independently from one distribution each carry a copy of it.
    probs: torch.Tensor | None = None
    # [draft_len] int64, the parent node of each node (-1: follows the context), parents before children;
    # None: a chain.
    parents: torch.Tensor | None = None
    # [draft_len] float32, the drafter's estimate of the chance that each node is accepted (its whole
    # path up to it, so non-increasing along a chain); None: no estimate. With it the engine verifies
    # only the prefix of a chain that pays on the target's cost curve, possibly none of it.
    scores: torch.Tensor | None = None
    # Tokens the same target forward carries for the drafter's own use, unverified; None: none.
    auxiliary: AuxiliaryTokens | None = None
    # A tree's `probs` promise (True) that every node was drawn from its row independently of its earlier
    # siblings: i.i.d. given its parent's path, repeats allowed (a one-hot row: a token fixed in advance).
    # Only then is multi-draft speculative sampling lossless with them. Children picked otherwise (the
    # top-k, distinct tokens, a pruning that looks at the tokens) and sent with the distributions they were
    # ranked by make the output lossy (top-2 children: 0.73 total variation, in
    # tests/statistical/test_engine_sampling.py), so such a tree goes without probs and each node is verified
    # as one-hot. Verification refuses probs on a tree without this flag (`check_probs`). A chain needs none:
    # each token is alone after its prefix.
    drawn_independently: bool = False
    # How many leading tokens (a chain's first nodes) a constraint's grammar forced (`engine.forced`): drafted
    # from the grammar alone, not by the drafter.
    forced: int = 0
    # How many of those the engine put ahead of the drafter's own draft (which then continues after them); the
    # rest of `forced` the drafter's draft began with itself. The drafter hears of its own part only
    # (`engine.forced.own_part`).
    prepended: int = 0
    # A tree whose `parents` (and tokens and scores) live on the device, with what verifying it there needs; its
    # greedy verification reads the structure with the verdict and sets `parents` to the host's copy. Every other
    # use of `parents` reads it as any device data (correct, at a wait). None: a host-made structure.
    layout: DeviceLayout | None = None
    # Device tensors the drafter wants on the host with the verdict, read in its transfer by greedy verification
    # (`verify.tree.verify`), which puts their values in `read` (else None: the drafter reads them itself).
    riders: tuple[torch.Tensor, ...] = ()
    read: list | None = None

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def prefix(self, n: int) -> Draft:
        """The chain's first n tokens."""
        if self.is_tree:
            raise ValueError("a tree draft has no prefix; prune it with tree.select")
        return Draft(
            tokens=self.tokens[:n],
            probs=None if self.probs is None else self.probs[:n],
            scores=None if self.scores is None else self.scores[:n],
            auxiliary=self.auxiliary,
            forced=min(self.forced, n),
            prepended=min(self.prepended, n),
        )

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def check_probs(self) -> None:
        """Raise ValueError for `probs` that speculative sampling cannot use losslessly: on a tree whose
        nodes the drafter does not promise were drawn independently (see `drawn_independently`)."""
        if self.is_tree and self.probs is not None and not self.drawn_independently:
            raise ValueError(
                "a tree draft with probs must have drawn_independently=True (every node drawn from its row "
                "independently of its earlier siblings); send fixed children (top-k, a trie) without probs")

    @staticmethod
    def empty() -> Draft:
        return Draft(tokens=torch.empty(0, dtype=torch.long, device="cpu"))


@dataclass(frozen=True)
class TokenLogprob:
    """An output (or prompt) token's log-probability under the target: the log-softmax of the target's own
    logits at its position (before any penalty, bias, temperature, truncation or grammar mask), and the
    likeliest tokens there with theirs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Verdict:
    """What verification decided for one step."""

    num_drafted: int  # draft tokens (tree nodes) the target verified
    num_accepted: int  # how many draft tokens were accepted
    tokens: tuple[int, ...]  # the accepted draft tokens, then the correction or bonus token
    # The accepted nodes, root to deepest, num_accepted of them (default: the chain's first num_accepted
    # positions).
    path: tuple[int, ...] = ()
    # True when the last token is a bonus token: no draft was offered after the accepted ones (the whole
    # chain was accepted, or the accepted path ends at a leaf of the tree). Default: the chain rule.
    bonus: bool | None = None
    # A chain's draft tokens after the accepted ones, which the target turned down (for streaming: the
    # verifier has them on the host already, where the draft's own tensor may live on a device); () for trees.
    rejected: tuple[int, ...] = ()
    # The host values of tensors a caller asked to ride along the verdict's one transfer (greedy verification's
    # `riders`, in order); () when none were asked for or the verifier takes none.
    riders: tuple = ()
    # Each of `tokens`' log-probability under the target (`TokenLogprob`), when the sequence asks for them.
    logprobs: tuple[TokenLogprob, ...] | None = None

    def __post_init__(self) -> None:
        if not self.path and self.num_accepted:  # a chain's: its first positions
            object.__setattr__(self, "path", tuple(range(self.num_accepted)))
        if self.bonus is None:
            object.__setattr__(self, "bonus", self.num_accepted == self.num_drafted)


# accepted: a draft token the target agreed with; corrected: the target's token where it rejected one;
# bonus: the target's token after a wholly accepted draft; target: a step that drafted nothing
TokenOrigin = Literal["accepted", "corrected", "bonus", "target"]


@dataclass(frozen=True)
class StepStats:
    """Per-step statistics of the draft-then-verify loop."""

    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens accepted
    new_tokens: int  # tokens appended to the output this step (after stop conditions)
    draft_seconds: float
    verify_seconds: float  # the target forward plus the acceptance decision
    forward_tokens: int  # pending context (the prefill included) and draft tokens in this step's forward
    draft_depth: int | None = None  # the longest root-to-leaf path of a tree draft; None: a chain (= drafted)
    auxiliary_tokens: int = 0  # unverified tokens the forward also carried (`AuxiliaryTokens`)
    stepped_aside: bool = False  # a plain step because speculation was timed slower (`engine.payoff`)
    forced: int = 0  # accepted draft tokens a constraint's grammar forced (`engine.forced`), among `accepted`
