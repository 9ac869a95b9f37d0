"""The trained heads' own caches on the static-shape path (`models.static`): what an EAGLE or EAGLE-3 head keeps of a
sequence, allocated once and fed at fixed widths, so that a GPU replays each feed as a CUDA graph.

`StaticFeeds` is what both heads' static states share (buckets, padding, the mask built on the device, the runner, the
eager fallback); `StaticHeadState` is EAGLE's (its one Qwen2 layer through `models.static_layers.decode_layers`, the
arithmetic the target's static decoder runs), `drafters.eagle3.StaticEagle3State` EAGLE-3's. Besides single feeds,
a greedy chain (`chain`) and a greedy EAGLE-2 tree (`tree`, grown as `tree.growth` grows it) each run as one step
function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdecode.devices import to_device
from specdecode.drafters.base import tensor_bytes
from specdecode.drafters.eagle_head import EagleHead, HeadState
from specdecode.models.graphs import make_runner
from specdecode.models.static import (
    BUCKETS, DEFAULT_CAPACITY, StaticCausalLM, bucket, fits, full_mask, pack, pack_on, unpack,
)
from specdecode.models.static_layers import decode_layers, empty_cache, fuse_projections
from specdecode.tree.growth import DeviceTree, layer_sizes


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
    vocab_ids: torch.Tensor  # draft index -> token id
    probs: Callable[[torch.Tensor], torch.Tensor]  # the head's distribution over its draft vocabulary
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
        self.chain_runner = make_runner(self.runner_name, self.chain_step, self.device, self.backend)
        self.tree_runner = make_runner(self.runner_name, self.tree_step, self.device, self.backend)

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
        self._room(start + n)
        # the feed's own mask, [n, cached + n] over the cache (whose context pairs every row sees), from the host or
        # the device (a tree grown there: `pack_on`)
        local = None if mask is None else mask[:, self.fed :]
        hidden = hidden.to(self.dtype)
        tokens, positions = to_device(tokens, self.device), to_device(positions, self.device)
        width = bucket(n)
        if width is not None and fits(n, local):
            padding = width - n
            inputs = (pack_on(self.device, start, n, width, None, local), F.pad(hidden, (0, 0, 0, padding)),
                      F.pad(tokens, (0, padding)), F.pad(positions, (0, padding)))
            out = self.runner(inputs)[:n]
        else:  # the prompt's pairs, or a mask past the window: the same arithmetic at its own width
            slots = torch.arange(start, start + n, device=self.device)
            allowed = to_device(full_mask(start, n, self.capacity, local), self.device)
            out = self.feed(hidden, tokens, positions, slots, allowed)
        self.cached += n
        return out

    def _room(self, needed: int) -> None:
        """Room for `needed` entries and the widest bucket's pads after them: the cache doubles (what it holds kept)
        and the runners start afresh, as the target's does (`StaticCausalLM`): a head built beside a target of 4,096
        positions follows it past them."""
        if needed + BUCKETS[-1] <= self.capacity:
            return
        size = self.capacity - BUCKETS[-1]
        while size < needed:
            size *= 2
        kv = self.kv.new_zeros((*self.kv.shape[:-2], size + BUCKETS[-1], self.kv.shape[-1]))
        kv[..., : self.capacity, :] = self.kv
        self._allocate(kv, self.features_width)

    def chain(self, feature: torch.Tensor, k: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain of k tokens drafted greedily from `feature` [d] (the head's output after the context, whose
        next position is `end`), each fed back to the head: (the tokens [k], the probability the head gave each
        [k]), on the device. What `EagleDrafter`'s loop of k - 1 feeds computes, as one step function the runner
        runs (one CUDA graph per k), so that a chain costs one launch rather than a few dozen a token."""
        self._room(self.cached + k)
        packed = torch.tensor([self.cached, end], dtype=torch.long, device="cpu")
        tokens, probs = self.chain_runner((packed, feature.to(self.dtype)), (k,))
        self.cached += k - 1
        return tokens, probs

    def chain_step(self, packed: torch.Tensor, feature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`chain`'s step function: `packed` [2] the cache's length and the chain's first position, on the device.
        Depth i's pair sits at slot start + i and position end + i, and sees every slot up to its own, as a causal
        feed of one token does (`models.static.pack`)."""
        start, end = packed[:1], packed[1:2]
        tokens, probs = [], []
        for depth in range(k):
            p, index = self.probs(feature).max(dim=-1, keepdim=True)  # [1] each
            tokens.append(self.vocab_ids[index])
            probs.append(p)
            if depth + 1 < k:
                slots = start + depth
                feature = self.feed(feature[None], tokens[-1], end + depth, slots, (self.columns <= slots)[None])[-1]
        return torch.cat(tokens), torch.cat(probs)

    def tree(self, feature: torch.Tensor, top_k: int, width: int, rounds: int, end: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2's tree grown greedily from `feature` [d] (the head's output after the context, whose next position
        is `end`) in `rounds` rounds (`tree.growth.DeviceTree`: the `width` best nodes of the newest layer fed each
        round, their `top_k` children added): (tokens, parents, scores) [nodes], on the device. What
        `EagleTreeDrafter`'s rounds compute one feed at a time, as one step function the runner runs (one CUDA graph
        per shape of tree), so that a tree costs one launch."""
        top_k = min(top_k, self.vocab_ids.numel())
        fed = sum(min(width, size) for size in layer_sizes(top_k, top_k, width, rounds)[:rounds])
        self._room(self.cached + fed)
        packed = torch.tensor([self.cached, end], dtype=torch.long, device="cpu")
        grown = self.tree_runner((packed, feature.to(self.dtype)), (top_k, width, rounds))
        self.cached += fed
        return grown

    def tree_step(self, packed: torch.Tensor, feature: torch.Tensor, top_k: int, width: int, rounds: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`tree`'s step function: `packed` [2] the cache's length and the first round's position, on the device.
        Round r's nodes sit at position end + r and at the slots after the nodes fed before them, and see every
        slot of the context and, among the tree's, their ancestors' and their own."""
        start, end = packed[:1], packed[1:2]
        values, index = torch.topk(self.probs(feature[None]), top_k)  # [1, k]
        grown = DeviceTree(values[0], self.vocab_ids[index[0]], width, rounds)
        outputs, relative = feature[None], self.columns - start  # relative: a slot's place after the context
        for depth in range(rounds):
            tokens, parent_rows, mask = grown.expand()  # mask [w, tree slots so far]
            n, seen = tokens.shape[0], mask.shape[1]
            slots = start + (seen - n) + torch.arange(n, device=self.device)
            inside = (relative >= 0) & (relative < seen)
            allowed = (relative < 0)[None] | (mask[:, relative.clamp(0, seen - 1)] & inside[None])  # [w, capacity]
            hidden = outputs.expand(n, -1) if parent_rows is None else outputs[parent_rows]
            outputs = self.feed(hidden, tokens, (end + depth).expand(n), slots, allowed)
            values, index = torch.topk(self.probs(outputs), top_k)  # [w, k]
            grown.add(values, self.vocab_ids[index])
        return grown.nodes()

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
        fuse_projections(self.head.layer)
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
