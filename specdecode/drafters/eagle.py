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
(one row) and the token embeddings and LM head are the target's, frozen, never stored with the head.

On a static target (`models.static`) the head drafts on the static path too (`StaticHeadState`, chosen by
`eagle_state`): the same arithmetic written out over the head's own modules, over a KV cache allocated once,
each feed padded to a bucket width and run by the target's runner (captured as CUDA graphs on a GPU). What
that path does for any head, EAGLE-3's as well, is `StaticFeeds`.
"""

from __future__ import annotations

import functools
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, Qwen2Config, Qwen2Model

from specdecode import devices
from specdecode.devices import to_device
from specdecode.drafters.base import Drafter, Needs, Outcome, tensor_bytes
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.drafters.heads import check_fits, for_drafting, head_folder, load_head, save_head
from specdecode.models.cache import cache_keyword
from specdecode.models.costs import lower_median
from specdecode.models.graphs import make_runner
from specdecode.models.static import (
    BUCKETS, DEFAULT_CAPACITY, StaticCausalLM, bucket, decode_layers, empty_cache, fits, full_mask, pack, unpack,
)
from specdecode.tree import structure
from specdecode.errors import UserError
from specdecode.tree.budget import Calibration
from specdecode.types import Draft, SamplingParams

WEIGHTS, CONFIG = "eagle.safetensors", "eagle.json"

ROUND_TIMINGS = 5  # latest timings of a head's tree round, per width, whose lower median prices it


def head_config(target_config, intermediate_size: int | None = None) -> Qwen2Config:
    """One decoder layer with the target's width and attention, a (possibly narrower) MLP."""
    known = Qwen2Config().to_dict()
    config = Qwen2Config(**{key: value for key, value in target_config.to_dict().items() if key in known})
    config.num_hidden_layers = 1
    config.layer_types = ["full_attention"]
    config.intermediate_size = intermediate_size or target_config.intermediate_size
    config.vocab_size = 1  # inputs come as embeddings
    config.pad_token_id = config.bos_token_id = config.eos_token_id = None  # (the target's lie past that row)
    config.use_sliding_window = False
    config.tie_word_embeddings = False
    return config


class EagleHead(nn.Module):
    """(feature, next token's embedding) pairs -> predicted next features; logits over `vocab_ids`."""

    vocab_ids: torch.Tensor  # a buffer (register_buffer), declared for the type checker

    def __init__(self, config: Qwen2Config, vocab_ids: torch.Tensor):
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.layer = Qwen2Model(config)
        self.register_buffer("vocab_ids", vocab_ids.long().clone(), persistent=True)  # draft index -> token id

    def forward(
        self,
        features: torch.Tensor,  # [b, n, d] the target's (or predicted) features at positions t
        embeddings: torch.Tensor,  # [b, n, d] the target's embeddings of the tokens at t + 1
        position_ids: torch.Tensor,  # [b, n]
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        x = self.fc(torch.cat([features, embeddings], dim=-1))
        out = self.layer(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                         **{cache_keyword(self.layer): cache}, use_cache=cache is not None)
        return out.last_hidden_state  # [b, n, d]

    # -- storage ---------------------------------------------------------------------------------

    def save(self, folder: Path, record: dict) -> None:
        save_head(self, folder, WEIGHTS, CONFIG, self.config.to_dict(), record)

    @classmethod
    def load(cls, folder: Path, dtype: torch.dtype = torch.bfloat16,
             device: torch.device | str = "cpu") -> tuple[EagleHead, dict]:
        shape, weights, record = load_head(folder, WEIGHTS, CONFIG, "EAGLE")
        head = cls(Qwen2Config(**shape), weights["vocab_ids"])
        head.load_state_dict(weights)
        return head.to(device=device, dtype=dtype).eval(), record


class State(Protocol):
    """What the EAGLE drafters use of a head's view of one sequence: `HeadState` for an EAGLE head,
    `eagle3.Eagle3State` for an EAGLE-3 one."""

    device: torch.device
    vocab_ids: torch.Tensor  # draft index -> token id, on the device
    fed: int  # context pairs in the head's cache

    def reset(self, forget: bool = False) -> None: ...
    def memory_bytes(self) -> int: ...
    def observe(self, hidden: torch.Tensor, num_pending: int, path: tuple[int, ...], /) -> None: ...
    def run(self, features: torch.Tensor, tokens: list[int] | torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor | None = None, /) -> torch.Tensor: ...
    def crop(self) -> None: ...
    def sync(self, context: list[int], /) -> torch.Tensor | None: ...
    def probs(self, feature: torch.Tensor, /) -> torch.Tensor: ...
    def logits(self, features: torch.Tensor, /) -> torch.Tensor: ...


class HeadState:
    """A head's view of one sequence: the target's features of the context (from the verification
    forwards), the head's KV cache over the context's pairs, and the speculative entries after them. All of
    it lives on the target's device, where the head drafts."""

    quantize = True  # the head's layers on the quantized kernels where the device is a CPU that has them

    def __init__(self, head: EagleHead, target_model):
        weight = target_model.get_output_embeddings().weight  # [vocab, d] the target's LM head
        self.device = weight.device
        # the head as it drafts: float32 on the target's device (`heads.for_drafting`)
        self.head, self.lm_head = for_drafting(head, weight[head.vocab_ids.to(self.device)], self.quantize)
        self.dtype = torch.float32
        self.embed = target_model.get_input_embeddings()
        self.vocab_ids = head.vocab_ids.to(self.device)  # draft index -> token id
        self.vocab_size = weight.shape[0]
        self.reset()

    def reset(self, forget: bool = False) -> None:
        """Ready for a new sequence (a head keeps nothing of earlier ones)."""
        self.features: list[torch.Tensor] = []  # [d] the target's feature at each context position (but the last)
        self.cache = DynamicCache(config=self.head.config)
        self.fed = 0  # context pairs in the head's cache: positions 0 .. fed - 1
        self.cached = 0  # entries in the head's cache (the fed pairs, then speculative ones)
        self.last: torch.Tensor | None = None  # the head's prediction after its last real pair

    def memory_bytes(self) -> int:
        return tensor_bytes(self.head, self.lm_head, self.features)

    def observe(self, hidden: torch.Tensor, num_pending: int, path: tuple[int, ...]) -> None:
        # the fed tokens: the pending context tokens, then the draft's nodes; the context gains the
        # accepted nodes `path` (their features are the target's now), the last verdict token has none yet
        rows = list(range(num_pending)) + [num_pending + node for node in path]
        self.features += list(hidden[to_device(rows, hidden.device)].to(self.dtype))  # [pending + accepted] rows

    def run(self, features: torch.Tensor, tokens: list[int] | torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed pairs (features[i], tokens[i]) at `positions` [n] (on the device) to the head's cache; `tokens`
        from the host or the device, `mask` [n, cached + n] bool from the host (None: causal); returns its
        predictions [n, d]."""
        embeddings = self.embed(to_device(tokens, self.device)[None]).to(features.dtype)  # [1, n, d]
        additive = None
        if mask is not None:
            additive = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)  # [n, cached + n]
            additive = additive.masked_fill_(~to_device(mask, self.device), torch.finfo(self.dtype).min)[None, None]
        self.cached += len(tokens)
        return self.head(features[None], embeddings, positions[None], attention_mask=additive, cache=self.cache)[0]

    def crop(self) -> None:
        """Drop the speculative entries."""
        if self.cached > self.fed:
            self.cache.crop(self.fed - self.cached)  # transformers takes minus the count to drop
            self.cached = self.fed

    def sync(self, context: list[int]) -> torch.Tensor | None:
        """Feed the context's pairs (f_t, x_{t+1}) not yet in the head's cache; the head's prediction of
        the feature after the context (None before the target's first forward)."""
        if len(context) < 2 or len(self.features) < len(context) - 1:
            return None
        self.crop()
        end = len(context) - 1
        if self.fed < end:
            new = torch.stack(self.features[self.fed : end])
            positions = torch.arange(self.fed, end, device=self.device)
            self.last = self.run(new, context[self.fed + 1 : end + 1], positions)[-1]
            self.fed = end
        return self.last

    def probs(self, feature: torch.Tensor) -> torch.Tensor:
        """[..., V'] the draft distribution over the truncated vocabulary."""
        return torch.softmax(self.lm_head(feature).float(), dim=-1)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[n, vocab] full-vocabulary logits: the head's over its vocabulary, -inf elsewhere."""
        return full_vocabulary(features, self.lm_head(features).float(), self.vocab_ids, self.vocab_size)


class StaticFeeds:
    """A head's state on the static path (`models.static`), whichever the head (`StaticHeadState` here,
    `eagle3.StaticEagle3State`): its KV cache allocated once and written at explicit slots, each feed padded to a
    bucket width with its mask built on the device, run by the target's runner ("eager", "compile" or CUDA
    "graphs"). Wider feeds (the prompt's pairs) and masks that reach past the window run the same arithmetic
    eagerly. Cropping lowers a count; nothing is copied. The head's state writes its arithmetic out (`feed`) over
    the cache it allocates (`_allocate`), its layers in float32: the quantized kernels are the CPU's dynamic path's,
    and no graph traces them."""

    quantize = False
    kind = "the head"  # in messages
    # the state's own, set by the class this is mixed into (`HeadState`, `eagle3.Eagle3State`)
    device: torch.device
    dtype: torch.dtype
    fed: int
    cached: int
    # set by the static state before it allocates
    runner_name: str
    backend: str

    def _allocate(self, kv: torch.Tensor, features: int) -> None:
        """Draft on the cache `kv` (zeros, its slots on its second last dimension, the widest bucket's pads
        included) from features `features` wide, through a runner over `step`."""
        self.kv, self.features_width = kv, features
        self.capacity = kv.shape[-2]
        self.columns = torch.arange(self.capacity, device=self.device)
        self.runner = make_runner(self.runner_name, self.step, self.device, self.backend)

    def feed(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             allowed: torch.Tensor) -> torch.Tensor:
        """Pairs (hidden [n, d], tokens [n]) at `positions` [n], their keys and values written at `slots` [n],
        row i attending where allowed[i] [n, capacity] -> the head's outputs [n, d]."""
        raise NotImplementedError

    def step(self, packed: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
             ) -> torch.Tensor:
        """One fixed-width feed, every input on the device (`packed`: `models.static.pack`'s, whose positions it
        leaves unread): the function the runner runs."""
        slots, _, allowed = unpack(packed, tokens.shape[0], self.columns)
        return self.feed(hidden, tokens, positions, slots, allowed)

    def run(self, hidden: torch.Tensor, tokens: list[int] | torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
        n, start = len(tokens), self.cached
        if start + n + BUCKETS[-1] > self.capacity:
            raise UserError(f"{self.kind}'s cache holds {self.capacity - BUCKETS[-1]} positions; this sequence "
                            "needs more")
        # the feed's own mask: a host mask [n, cached + n] over the cache (whose context pairs every row sees)
        local = None if mask is None else to_device(mask, torch.device("cpu"))[:, self.fed :]
        hidden = hidden.to(self.dtype)
        tokens, positions = to_device(tokens, self.device), to_device(positions, self.device)
        width = bucket(n)
        if width is not None and fits(n, local):
            padding = width - n
            inputs = (pack(start, n, width, None, local), F.pad(hidden, (0, 0, 0, padding)),
                      F.pad(tokens, (0, padding)), F.pad(positions, (0, padding)))
            out = self.runner(inputs)[:n]
        else:  # the prompt's pairs, or a mask past the window: the same arithmetic at its own width
            slots = torch.arange(start, start + n, device=self.device)
            allowed = to_device(full_mask(start, n, self.capacity, local), self.device)
            out = self.feed(hidden, tokens, positions, slots, allowed)
        self.cached += n
        return out

    def crop(self) -> None:
        self.cached = min(self.cached, self.fed)  # later feeds overwrite what lies past it

    @torch.inference_mode()
    def capture(self) -> None:
        """Run every bucket's feed once past what the cache holds (captured or compiled, by the runner), so that
        drafting does not pay for it."""
        for width in BUCKETS:
            tokens, positions = (torch.zeros(width, dtype=torch.long, device=self.device) for _ in range(2))
            self.runner((pack(self.cached, width, width, None, None),
                         torch.zeros(width, self.features_width, dtype=self.dtype, device=self.device), tokens,
                         positions))


class StaticHeadState(StaticFeeds, HeadState):
    """An EAGLE head's view of one sequence on the static path (`StaticFeeds`): `EagleHead.forward`'s arithmetic
    written out over the head's own modules (its Qwen2 layer as `models.static` writes the target's), over a
    cache of `capacity` positions."""

    kind = "the EAGLE head"

    def __init__(self, head: EagleHead, target_model, runner: str = "eager", capacity: int = DEFAULT_CAPACITY,
                 backend: str = "inductor"):
        self.runner_name, self.backend = runner, backend
        super().__init__(head, target_model)
        self._allocate(empty_cache(self.head.layer, capacity + BUCKETS[-1], self.dtype, self.device),
                       self.head.config.hidden_size)

    def memory_bytes(self) -> int:
        return super().memory_bytes() + tensor_bytes(self.kv)

    def feed(self, hidden, tokens, positions, slots, allowed):
        embeddings = self.embed(tokens).to(self.dtype)  # [n, d]
        return decode_layers(self.head.layer, self.head.fc(torch.cat([hidden, embeddings], dim=-1)), positions,
                             slots, allowed, self.kv)


def eagle_state(head: EagleHead, target) -> HeadState:
    """The head's state for a target (a `CausalLM` on the torch backend): on the static path where the target is
    on it (`models.static.StaticCausalLM`), with the target's runner and capacity."""
    if isinstance(target, StaticCausalLM):
        return StaticHeadState(head, target.model, target.runner_name, target.decoder.capacity - BUCKETS[-1],
                               target.backend)
    return HeadState(head, target.model)


def full_vocabulary(features: torch.Tensor, draft_logits: torch.Tensor, vocab_ids: torch.Tensor,
                    vocab_size: int) -> torch.Tensor:
    """[n, V'] logits over a head's draft vocabulary `vocab_ids` -> [n, vocab_size], -inf elsewhere. The
    buffer is made from `features` (`new_full`): on their device, and, in a sync count, their stand-in for
    device data (`devices.Tracked`), as a GPU's would be."""
    out = features.new_full((features.shape[0], vocab_size), float("-inf"), dtype=torch.float32)
    out[:, vocab_ids] = draft_logits
    return out


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
    never grows, so the cut chain is the one that stopping early drafts)."""

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
        self._calibration = Calibration()
        self._scores = torch.empty(0, device="cpu")  # the last draft's scores

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self.state.reset(forget)
        self._calibration.reset()

    def memory_bytes(self) -> int:
        return self.state.memory_bytes()

    def observe(self, outcome: Outcome) -> None:
        self.state.observe(outcome.require_hidden(), outcome.num_pending, outcome.accepted_path)
        self._calibration.record_verdict(self._scores, outcome.verdict)

    @torch.inference_mode()
    def propose(self, context: list[int], max_tokens: int, params: SamplingParams, generator) -> Draft:
        feature = self.state.sync(context) if max_tokens > 0 else None
        if feature is None:
            return Draft.empty()
        limit, end = min(max_tokens, self.max_tokens), len(context) - 1
        probs, tokens = [], []  # [1] each, on the device: the head's top token at each depth and its probability
        read = []  # each depth's probability, on the host once read
        confidence = 1.0
        for depth in range(limit):
            p, index = self.state.probs(feature).max(dim=-1, keepdim=True)  # [1] each
            probs.append(p)
            tokens.append(self.state.vocab_ids[index])
            if self.stops_early:  # one read per token: the stop is decided before the head runs again
                read += devices.to_host(p)[0]
                confidence *= read[-1]
                if confidence < self.min_confidence:
                    break
            if depth + 1 < limit:
                position = torch.full((1,), end + depth, device=self.state.device)
                feature = self.state.run(feature[None], tokens[-1], position)[-1]
        if not self.stops_early:  # the whole chain's probabilities in one read
            read = devices.to_host(torch.cat(probs))[0]
        # keep the tokens while the path's confidence stays at or above min_confidence
        scores, confidence = [], 1.0
        for p in read:
            confidence *= p
            if confidence < self.min_confidence:
                break
            scores.append(confidence)
        if not scores:
            return Draft.empty()
        self._scores = (torch.tensor(scores, device="cpu") * self._calibration.factor).clamp(max=1.0)
        return Draft(tokens=torch.cat(tokens)[: len(scores)], scores=self._scores)  # tokens on the device


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
        self._outputs: dict[int, torch.Tensor] = {}  # node -> the head's prediction after it
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
        return self.state.logits(root[None])

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
