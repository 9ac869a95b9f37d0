"""EAGLE (Li et al. 2024): a trained head drafts at the level of the target's features.

The target's last hidden state f_t at position t (after its final norm: what its LM head reads) predicts
token t + 1. The head takes the pair (f_t, embedding of token t + 1) — the feature, and the token the
target then actually chose, which removes the uncertainty of sampling from the feature's prediction —
through a linear layer (2d -> d) and one decoder layer of the target's own architecture, and predicts
f_{t+1}; the target's frozen LM head turns that into the distribution of token t + 2. Drafting repeats
it on its own predictions: (f^_{t+1}, drafted token) -> f^_{t+2}, and so on. A draft token costs one
small layer and an LM head over a truncated vocabulary (the most frequent tokens of the training data),
a few percent of a target forward.

The head keeps its own KV cache over the context's pairs. The target's features come from the
verification forwards (`Drafter.needs`): each step hands the drafter the hidden states of the
tokens it fed, and the drafter keeps those of the context; the pairs not yet in the head's cache are fed
at the next proposal, after dropping the previous proposal's speculative entries.

The head is a transformers `Qwen2Model` of one layer fed `inputs_embeds` (stock modeling code: rotary
positions, cache, masks), so it follows the target's attention geometry; its embedding table is unused
(one row) and the token embeddings and LM head are the target's, frozen, never stored with the head. The head
and its view of a sequence are `drafters.eagle_head`'s; this module's are the drafters that run it.

On a static target (`models.static`) the head drafts on the static path too (`StaticHeadState`, chosen by
`eagle_state`): the same arithmetic written out over the head's own modules, over a KV cache allocated once,
each feed padded to a bucket width and run by the target's runner (captured as CUDA graphs on a GPU). What
that path does for any head, EAGLE-3's as well, is `static_heads.StaticFeeds`.
"""

from __future__ import annotations

import functools
from collections import defaultdict, deque
from collections.abc import Callable

import torch

from specdecode import devices
from specdecode.drafters.base import Drafter, Needs, Outcome, late_values
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.drafters.eagle_head import EagleHead, HeadState, State
from specdecode.drafters.static_heads import StaticFeeds, eagle_state
from specdecode.drafters.heads import check_fits, head_folder
from specdecode.models.costs import lower_median
from specdecode.tree import structure
from specdecode.tree.growth import layer_sizes
from specdecode.errors import UserError
from specdecode.tree.budget import Calibration
from specdecode.types import Draft, SamplingParams
from specdecode.sampling import matched

ROUND_TIMINGS = 5  # latest timings of a head's tree round, per width, whose lower median prices it


def head_state(head: EagleHead | None, target_model, state: State | None) -> State:
    """`state` when given (another head's: EAGLE-3's, `drafters.eagle3`), else an EAGLE head's own."""
    if state is not None:
        return state
    if head is None:
        raise ValueError("an EAGLE drafter needs a head or a head's state")
    return HeadState(head, target_model)


class EagleDrafter(Drafter):
    """Drafts a chain with an EAGLE head: the head's most likely token at each step, scored by the
    product of its probabilities (EAGLE-2: draft confidence tracks acceptance) times the running ratio of
    accepted tokens to those the scores predicted, so the engine verifies the prefix that pays on the
    target's cost curve. Stops at `max_tokens` or once the path's confidence falls under
    `min_confidence`. Deterministic drafts: verification treats them as one-hot, lossless under sampling
    too.

    Where the confidence is read (`stops_early`): on a CPU after each token, which costs nothing there and
    spares the head's forwards past the stop; elsewhere the whole chain is drafted on the device and read
    in one transfer, then cut where the confidence fell under `min_confidence` (a product of probabilities
    never grows, so the cut chain is the one that stopping early drafts). Off the CPU, greedy or sampled in a seeded
    sequence (`reads_late`, `sampling.matched`), after a sequence's first chain, not even that: each chain is drafted
    as long as the one before stayed confident (one token more where all of it did) and verified whole, its
    probabilities read with its verdict (`Draft.riders`), so that a step waits for the device once."""

    name = "eagle"
    needs = Needs(hidden=True)

    def __init__(self, head: EagleHead | None, target_model, max_tokens: int = 8, min_confidence: float = 0.05,
                 state: State | None = None):
        if max_tokens < 1 or not 0.0 <= min_confidence < 1.0:
            raise UserError(f"EAGLE needs max_tokens >= 1 and min_confidence in [0, 1); got {max_tokens}, "
                            f"{min_confidence}")
        self.state = head_state(head, target_model, state)
        self.max_tokens, self.min_confidence = max_tokens, min_confidence
        # read each token's probability as it is drafted, to stop at once (see the class docstring)
        self.stops_early = min_confidence > 0 and self.state.device.type == "cpu"
        self.reads_late = self.state.device.type != "cpu"  # a greedy chain's probabilities read with its verdict
        self._calibration = Calibration()
        self._scores = torch.empty(0, device="cpu")  # the last draft's scores
        self.late_length: int | None = None  # tokens of the next chain read late (None: read this one first)
        self._late: Draft | None = None  # the chain drafted that way, before its observe

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self.state.reset(forget)
        self._calibration.reset()
        self.late_length, self._late = None, None

    def memory_bytes(self) -> int:
        return self.state.memory_bytes()

    def observe(self, outcome: Outcome) -> None:
        self.state.observe(outcome.require_hidden(), outcome.num_pending, outcome.accepted_path)
        if self._late is not None:  # its probabilities came with the verdict (else they are read now)
            draft, self._late = self._late, None
            read = late_values(draft)[0]
            self._scores = (torch.tensor(read, device="cpu").cumprod(0) * self._calibration.factor).clamp(max=1.0)
            self._learn(read)
        self._calibration.record_verdict(self._scores, outcome.verdict)

    @torch.inference_mode()
    def propose(self, context: list[int], max_tokens: int, params: SamplingParams, generator) -> Draft:
        feature = self.state.sync(context) if max_tokens > 0 else None
        if feature is None:
            return Draft.empty()
        limit, end = min(max_tokens, self.max_tokens), len(context) - 1
        if self.reads_late and matched(params, generator) and self.late_length is not None:  # verified whole, read late
            tokens, probs = self._device_chain(feature, min(limit, self.late_length), end)
            self._late = Draft(tokens=tokens, riders=(probs,))
            return self._late
        if self.stops_early:
            tokens, read = self._chain(feature, limit, end)
        else:  # the whole chain on the device, read once
            tokens, probs = self._device_chain(feature, limit, end)
            read = devices.to_host(probs)[0]
            if self.reads_late:
                self._learn(read)
        # keep the tokens while the path's confidence stays at or above min_confidence
        scores = self._confident(read)
        if not scores:
            return Draft.empty()
        self._scores = (torch.tensor(scores, device="cpu") * self._calibration.factor).clamp(max=1.0)
        return Draft(tokens=tokens[: len(scores)], scores=self._scores)  # tokens on the device

    def _confident(self, read: list[float]) -> list[float]:
        """The path's confidence at each token of a chain whose probabilities are `read`, while it stays at or
        above min_confidence."""
        scores, confidence = [], 1.0
        for p in read:
            confidence *= p
            if confidence < self.min_confidence:
                break
            scores.append(confidence)
        return scores

    def _learn(self, read: list[float]) -> None:
        """The length of the next chain read late, from one whose probabilities are `read`: as many tokens as stayed
        confident, at least one; one more than it had where all did (a chain the room cut short says nothing against
        the tokens it did not draft), at most max_tokens."""
        confident = len(self._confident(read))
        if confident < len(read):
            self.late_length = max(confident, 1)
        else:
            self.late_length = min(max(len(read) + 1, self.late_length or 0), self.max_tokens)

    def _device_chain(self, feature: torch.Tensor, limit: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`limit` tokens drafted greedily from `feature`, nothing read: (the tokens, the head's probability of each)
        [limit] on the device. On the static path one step function (`StaticFeeds.chain`), else a head step at
        a time."""
        if isinstance(self.state, StaticFeeds):
            return self.state.chain(feature, limit, end)
        probs, tokens = [], []  # [1] each, on the device: the head's top token at each depth and its probability
        for depth in range(limit):
            p, index = self.state.probs(feature).max(dim=-1, keepdim=True)  # [1] each
            probs.append(p)
            tokens.append(self.state.vocab_ids[index])
            if depth + 1 < limit:
                position = torch.full((1,), end + depth, device=self.state.device)
                feature = self.state.run(feature[None], tokens[-1], position)[-1]
        return torch.cat(tokens), torch.cat(probs)

    def _chain(self, feature: torch.Tensor, limit: int, end: int) -> tuple[torch.Tensor, list[float]]:
        """Up to `limit` tokens drafted from `feature` a head step at a time, each probability read as it comes and
        the chain stopped once the path's confidence falls under min_confidence (the CPU's way): (the tokens on
        the device, their probabilities on the host)."""
        tokens: list[torch.Tensor] = []  # [1] each, on the device: the head's top token at each depth
        read: list[float] = []  # each depth's probability, read at once
        confidence = 1.0
        for depth in range(limit):
            p, index = self.state.probs(feature).max(dim=-1, keepdim=True)  # [1] each
            tokens.append(self.state.vocab_ids[index])
            read += devices.to_host(p)[0]  # one read per token: the stop is decided before the head runs again
            confidence *= read[-1]
            if confidence < self.min_confidence:
                break
            if depth + 1 < limit:
                position = torch.full((1,), end + depth, device=self.state.device)
                feature = self.state.run(feature[None], tokens[-1], position)[-1]
        return torch.cat(tokens), read


class EagleTreeDrafter(DraftModelTreeDrafter):
    """EAGLE-2: the head grows a dynamic token tree (the draft model's tree growth, `draft_model_tree`,
    with the head's forwards): each round expands the best-scoring nodes of the newest layer, each fed as
    the pair (its parent's predicted feature, its token) attending to the context's pairs and its
    ancestors; the best nodes by cumulative confidence are kept for the verification budget."""

    name = "eagle-tree"
    needs = Needs(hidden=True)

    def __init__(self, head: EagleHead | None, target_model, curve, draft_cost: float | None = None,
                 state: State | None = None, clock: Callable[[], float] | None = None, **tree_options):
        # no draft model: the head drafts (`_start` and `_feed` are this class's own)
        super().__init__(model=None, curve=curve, draft_cost=draft_cost, **tree_options)  # type: ignore[arg-type]
        self.state = head_state(head, target_model, state)
        self.grows_on_host = self.state.device.type == "cpu"  # else on the device (`draft_model_tree`)
        self._outputs: dict[int, torch.Tensor] = {}  # node -> the head's prediction after it (on the host path)
        self._round = torch.empty(0)  # the head's outputs after the nodes the last round fed (on the device path)
        # the head's rounds as timed, by width (latest first): what a round costs on this machine, for
        # `_round_cost`; `draft_cost` is only the guess before a width has been timed (None: free, so the
        # drafter's first tree grows as deep as its scores allow and is timed on the way). Timed without waiting
        # for the device (`devices.stopwatch`: on CUDA between events): a round's seconds come by the next
        # round, as its children are read on the host right after it (`_add_children`). `clock`: a fixed
        # clock instead (a test's).
        self.stopwatch = devices.stopwatch(self.state.device, clock)
        self._rounds: defaultdict[int, deque[float]] = defaultdict(lambda: deque(maxlen=ROUND_TIMINGS))

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self.state.reset(forget)
        self._calibration.reset()

    def memory_bytes(self) -> int:
        return self.state.memory_bytes()

    def observe(self, outcome: Outcome) -> None:
        self.state.observe(outcome.require_hidden(), outcome.num_pending, outcome.accepted_path)
        super().observe(outcome)

    @torch.inference_mode()
    def _start(self, context: list[int]):
        root = self.state.sync(context)
        if root is None:  # before the target's first forward
            self._outputs = {}
            return None
        self._outputs = {structure.ROOT: root}
        return root[None]  # the head's prediction after the context: its distribution is made where needed (`_root`)

    @torch.inference_mode()
    def _root(self, start: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return self._distributions(self.state.logits(start), params)

    @torch.inference_mode()
    def _feed(self, tree, expand: list[int], fed: list[int], length: int, depth: int) -> torch.Tensor:
        context_pairs = self.state.fed
        # the tree's structure, built on the host: [width, context pairs + fed + width] bool
        mask = torch.zeros(len(expand), context_pairs + len(fed) + len(expand), dtype=torch.bool, device="cpu")
        mask[:, :context_pairs] = True
        for row, node in enumerate(expand):
            ancestors = tree.ancestors(node)
            mask[row, context_pairs : context_pairs + len(fed)] = torch.tensor([f in ancestors for f in fed],
                                                                               dtype=torch.bool, device="cpu")
            mask[row, context_pairs + len(fed) + row] = True
        # a node of depth d - 1 is fed with its parent's prediction, at the parent's position length + d - 3
        features = torch.stack([self._outputs[tree.parents[node]] for node in expand])  # [width, d]
        start = self.stopwatch.mark()
        out = self.state.run(features, [tree.tokens[node] for node in expand],
                             torch.full((len(expand),), length + depth - 3, device=self.state.device), mask)
        for row, node in enumerate(expand):
            self._outputs[node] = out[row]
        logits = self.state.logits(out)
        self.stopwatch.measure(start, self.stopwatch.mark(), functools.partial(self._timed, len(expand)))
        return logits

    @torch.inference_mode()
    def _grow_round(self, tokens, parent_rows, mask, length, depth, params):
        """A round of the tree grown on the device: the nodes `tokens` [w] fed as the pairs (their parents'
        predictions, their tokens), attending to the context's pairs and under `mask` [w, fed + w] to the nodes
        fed before; their children [w, k] taken from the head's own vocabulary under greedy decoding (the
        whole vocabulary's logits, -inf outside it, only where sampling processes them)."""
        width = tokens.numel()
        features = (self._outputs[structure.ROOT][None].expand(width, -1) if parent_rows is None
                    else self._round[parent_rows])  # [w, d]
        context = torch.ones(width, self.state.fed, dtype=torch.bool, device=mask.device)
        start = self.stopwatch.mark()
        self._round = self.state.run(features, tokens,
                                     torch.full((width,), length + depth - 3, device=self.state.device),
                                     torch.cat([context, mask], dim=1))
        if params.greedy:
            values, index = self._top(self.state.probs(self._round))
            children = values, self.state.vocab_ids[index]
        else:
            children = self._top(self._distributions(self.state.logits(self._round), params))
        self.stopwatch.measure(start, self.stopwatch.mark(), functools.partial(self._timed, width))
        return children

    @torch.inference_mode()
    def _device_tree(self, logits, params, length, rounds):
        """On the static path and under greedy decoding, the whole tree as one step function (`StaticFeeds.tree`),
        its rounds timed together; else a round at a time (`_grow_round`)."""
        if not (params.greedy and isinstance(self.state, StaticFeeds) and rounds):
            return super()._device_tree(logits, params, length, rounds)
        start = self.stopwatch.mark()
        grown = self.state.tree(self._outputs[structure.ROOT], self.top_k, self.width, rounds, length - 1)
        self.stopwatch.measure(start, self.stopwatch.mark(),
                               lambda seconds: self._timed(self.width, seconds / rounds))
        top_k = min(self.top_k, self.state.vocab_ids.numel())
        return grown, layer_sizes(top_k, top_k, self.width, rounds)

    def _timed(self, width: int, seconds: float) -> None:
        self._rounds[width].appendleft(seconds)

    def _round_cost(self, width: int) -> float:
        """A round over `width` nodes in one-token target forwards: the lower median of the latest timings
        of rounds that wide (or of the nearest width timed: a head's width costs little) over the target's
        one-token time, once both are known (a head's share of a step differs from machine to machine);
        `draft_cost` on the target's curve before."""
        target = getattr(self.curve, "seconds", 0.0)
        if not self._rounds or not target > 0:
            return super()._round_cost(width)
        return lower_median(self._rounds[min(self._rounds, key=lambda timed: (abs(timed - width), -timed))]) / target

    def _end(self, length: int) -> None:
        self.state.crop()


def build_eagle(target, draft, options) -> Drafter:
    """The `eagle` method: the head trained for the target (`specdecode train eagle`): `options.head`, else the
    one shipped for the default target; a chain, or EAGLE-2's dynamic tree with `options.tree`."""
    model, folder = head_folder(target, "eagle", options.head)
    head, record = EagleHead.load(folder, dtype=model.dtype, device=model.device)
    check_fits(folder, "eagle", record, head.config.hidden_size, int(head.vocab_ids.max()) + 1, model.config)
    state = eagle_state(head, target)
    if options.tree:
        return EagleTreeDrafter(head, model, target.cost_curve(), budget=options.budget, state=state)
    return EagleDrafter(head, model, state=state)
