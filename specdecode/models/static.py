"""The static-shape path of the torch backend: a KV cache allocated once, forwards of a few fixed widths, masks
and cache moves done on the device, so that each width's forward can be captured once as a CUDA graph (the
gpt-fast way: a static cache and one captured decode step, nothing clever).

On a GPU, transformers' eager forward spends far longer launching its kernels from Python than the GPU spends
running them, and a forward over a growing cache with host-built masks has a new shape at every step, which
no graph can replay. Here:

- the cache is one tensor [2, layers, kv_heads, capacity, head_dim] (keys, values), written at explicit slots
  (`index_copy_`), so its shape never changes; its length is a host integer, and a crop only lowers it (the
  next forward overwrites what was dropped);
- a forward of n new tokens runs at the width of the smallest bucket (`BUCKETS`) that holds n, padded: a pad
  token attends only to itself and writes its keys and values past the sequence's end, where the next forward
  overwrites them; no real token sees a pad;
- its mask [width, capacity] is computed inside the forward from the cache's length (a device scalar) and the
  new tokens' own mask [width, width] (causal for a chain, ancestors for a tree), both copied to the device
  without waiting, so a step's inputs travel in one or two copies and the forward reads nothing on the host;
- a tree's accepted path is moved into place on the device by one gather and one scatter over every layer at
  once (`_move`).

How the fixed-width forward runs is the runner's business (`Runner`): "eager" calls it as written (the CPU,
and the reference the others are checked against), "compile" through `torch.compile(fullgraph=True,
dynamic=False)` (the tests' proof, on the CPU, that it has no graph break and never recompiles once every width
is warm), "graphs" as one CUDA graph per width and hidden-state request captured by hand (`models.graphs`).
A prompt's prefill (wider than the last bucket) and a mask over other sequences' slots (the batch engine) run
the same arithmetic eagerly at their own width.

The arithmetic is transformers' for the Llama family (Llama, Mistral, Qwen2, Qwen3 whose every layer attends to the
whole context, float weights), written out over the model's own modules as `models.lean` writes the quantized paths'
(`models.static_layers`, in few kernels; the EAGLE head's one Qwen2 layer runs it too: `drafters.static_heads`). It
attends over the whole capacity under the mask, so its sums run over another number of (masked) terms than
transformers' forward: greedy output is the dynamic path's token for token, not bit for bit
(tests/equivalence/test_every_method.py).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from transformers import PreTrainedModel

from specdecode import devices
from specdecode.devices import to_device
from specdecode.errors import UserError
from specdecode.models.base import Entries, ForwardOutput
from specdecode.models.graphs import make_runner
from specdecode.models.hf import HFCausalLM
from specdecode.models.lean import LAYERS, NORMS
from specdecode.models.static_layers import decode_layers, empty_cache, fuse_projections
from specdecode.paths import console
from specdecode.progress import Progress

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the widths a verification or draft forward is padded to
# cache slots before the new tokens that a forward's own mask may reach (a draft tree's nodes fed in earlier
# rounds); every token sees the slots before those
BACK = 64
DEFAULT_CAPACITY = 4096  # cache positions allocated at first (it grows by doubling when a sequence needs more)


def bucket(n: int) -> int | None:
    """The smallest bucket that holds n new tokens, or None when n is wider than every bucket."""
    return next((width for width in BUCKETS if width >= n), None)


def unsupported(model: PreTrainedModel) -> str | None:
    """Why `model` cannot take the static path, or None when it can (module docstring: the Llama family with
    float weights, every layer attending to the whole context)."""
    decoder = getattr(model, "model", None)
    if decoder is None or not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} is not a Llama-family decoder"
    if set(getattr(model.config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return "some of its layers attend to a window, not the whole context"
    for layer in decoder.layers:
        if type(layer).__name__ not in LAYERS or type(layer.input_layernorm).__name__ not in NORMS:
            return f"its {type(layer).__name__} layers are not ones this path writes out"
        attention = layer.self_attn
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
        if not all(type(linear) is torch.nn.Linear for linear in linears):
            return "its weights are quantized (the int8 and int4 paths keep their own decoder)"
    if not model.dtype.is_floating_point:
        return f"its weights are {model.dtype}"
    return None


class StaticDecoder:
    """The forward of a Llama-family model over a cache of fixed capacity (module docstring)."""

    def __init__(self, model: PreTrainedModel, capacity: int):
        self.model = model
        self.decoder = model.model
        fuse_projections(self.decoder)
        self.allocate(capacity)

    def allocate(self, capacity: int) -> None:
        """A cache of `capacity` positions."""
        self.kv = empty_cache(self.decoder, capacity, self.model.dtype, self.model.device)
        self.columns = torch.arange(capacity, device=self.model.device)  # [capacity]
        self.capacity = capacity

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, allowed: torch.Tensor,
            hidden: bool | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed `tokens` [n] at rotary `positions` [n], their keys and values written at cache `slots` [n],
        token i attending to the slots where allowed[i] [n, capacity] is True. Returns (float32 logits [n, vocab],
        the hidden states asked: final-norm [n, d] for True, the named layers' inputs side by side for a tuple)."""
        trace: list[torch.Tensor] = []
        states = self.decoder.embed_tokens(tokens)  # [n, d]
        final = decode_layers(self.decoder, states, positions, slots, allowed, self.kv, trace)
        trace.append(final)
        logits = self.model.get_output_embeddings()(final).float()  # [n, vocab]
        if hidden is True:
            return logits, final
        if hidden:
            return logits, torch.cat([trace[i] for i in hidden], dim=-1)
        return logits, None

    def step(self, packed: torch.Tensor, tokens: torch.Tensor, hidden: bool | tuple[int, ...]
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One fixed-width forward of `tokens` [w], every input on the device (`packed`: `pack`'s). The function
        each runner runs (module docstring)."""
        slots, positions, allowed = unpack(packed, tokens.shape[0], self.columns)
        return self.run(tokens, positions, slots, allowed, hidden)


def unpack(packed: torch.Tensor, width: int, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack`'s inputs on the device -> (the new tokens' cache slots [w], their positions [w], the mask [w,
    capacity] bool), for a cache whose slots are `columns` [capacity]: every slot before `seen`, then the mask
    [w, BACK + w] over the window of slots start - BACK .. start + w - 1 (the cache's last BACK slots, then the
    new tokens'), nothing after."""
    start, seen = packed[:1], packed[1:2]  # the cache's length; the slots every token sees
    slots = start + torch.arange(width, device=packed.device)  # [w]
    positions = torch.where(packed[2] == 1, slots, packed[3 : 3 + width])
    local = packed[3 + width :].view(width, BACK + width) != 0
    relative = columns - (start - BACK)  # [capacity]: a slot's place in the window
    inside = (relative >= 0) & (relative < BACK + width)
    in_window = local[:, relative.clamp(0, BACK + width - 1)]  # [w, capacity]
    return slots, positions, (columns < seen)[None, :] | (in_window & inside[None, :])


def fits(n: int, tree_mask: torch.Tensor | None) -> bool:
    """Whether n new tokens under `tree_mask` (`CausalLM.forward`'s) fit a bucket and the window (`pack`)."""
    return n <= BUCKETS[-1] and (tree_mask is None or tree_mask.shape[1] <= n + BACK)


def pack(start: int, n: int, width: int, positions: torch.Tensor | None, tree_mask: torch.Tensor | None
         ) -> torch.Tensor:
    """The step's inputs packed in one int64 tensor on the host, for n new tokens padded to `width` (where they
    `fits`): [3 + w + w * (BACK + w)], the cache's length, the slots every token sees (those before the last m),
    a flag (1: consecutive positions after the cache), the positions [w] (read where the flag is 0) and the mask
    [w, BACK + w] (0 or 1) over the window (`unpack`). `positions` [n] (None: consecutive after the cache);
    `tree_mask` as `CausalLM.forward` takes it, [n, m] over the last m tokens, cached or new, those before seen
    by all (None: causal). A pad sees itself only, at position start + its index."""
    m = n if tree_mask is None else tree_mask.shape[1]
    packed = torch.zeros(3 + width + width * (BACK + width), dtype=torch.long, device="cpu")
    packed[0], packed[1], packed[2] = start, start + n - m, positions is None
    if positions is not None:
        packed[3 : 3 + width] = torch.arange(start, start + width, device="cpu")
        packed[3 : 3 + n] = positions
    local = packed[3 + width :].view(width, BACK + width)  # column BACK + i: new token i's slot
    local[:n, BACK + n - m : BACK + n] = _causal(n) if tree_mask is None else tree_mask
    pads = torch.arange(n, width, device="cpu")
    local[pads, BACK + pads] = 1
    return packed


def pack_on(device: torch.device, start: int, n: int, width: int, positions: torch.Tensor | None,
            tree_mask: torch.Tensor | None) -> torch.Tensor:
    """`pack`'s inputs for a forward on `device`, where `positions` and `tree_mask` may live on the device already (a
    tree grown there: `tree.growth`): then the rest is packed on the host and they are written in on the device
    (`place`), so that nothing is read back. Host ones: `pack` as it is."""
    on_device = [x is not None and x.device.type != "cpu" for x in (positions, tree_mask)]
    if not any(on_device):
        return pack(start, n, width, positions, tree_mask)
    blank_positions = torch.zeros(n, dtype=torch.long, device="cpu") if on_device[0] else positions
    blank_mask = tree_mask if tree_mask is None or not on_device[1] else torch.zeros(tree_mask.shape, dtype=torch.bool,
                                                                                      device="cpu")
    packed = to_device(pack(start, n, width, blank_positions, blank_mask), device)
    return place(packed, n, width, positions if on_device[0] else None, tree_mask if on_device[1] else None)


def place(packed: torch.Tensor, n: int, width: int, positions: torch.Tensor | None, tree_mask: torch.Tensor | None
          ) -> torch.Tensor:
    """Packed inputs (`pack`'s, made with blank positions and a blank mask of their shapes) with `positions` [n] and
    `tree_mask` [n, m] (each where given) written in, where the packed inputs are (no read of either)."""
    if positions is not None:
        packed[3 : 3 + n] = positions
    if tree_mask is not None:
        m = tree_mask.shape[1]
        packed[3 + width :].view(width, BACK + width)[:n, BACK + n - m : BACK + n] = tree_mask.to(packed.dtype)
    return packed


def full_mask(start: int, n: int, capacity: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """[n, capacity] bool on the host: what n new tokens after `start` cached ones see under `tree_mask`
    (`CausalLM.forward`'s: [n, m] over the last m tokens, those before seen by all; None: causal)."""
    local = _causal(n) if tree_mask is None else tree_mask.cpu()
    m = local.shape[1]
    allowed = torch.zeros(n, capacity, dtype=torch.bool, device="cpu")
    allowed[:, : start + n - m] = True
    allowed[:, start + n - m : start + n] = local
    return allowed


def _padded(token_ids: torch.Tensor, width: int) -> torch.Tensor:
    """[n] token ids (host or device) -> [width], where they are, with pads after them."""
    return F.pad(token_ids.view(-1), (0, width - token_ids.numel()))


@functools.cache
def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device="cpu").tril()


class StaticCausalLM(HFCausalLM):
    """A transformers model of the Llama family on the static-shape path (module docstring): the `CausalLM`
    interface over a cache of fixed capacity, each bucket's forward run by `runner` ("eager", "compile",
    "graphs"). `capacity`: cache positions to allocate first (default: the model's context, at most
    DEFAULT_CAPACITY); it doubles when a sequence needs more, which drops what the runner captured."""

    SPARE_CACHE = False  # a sibling allocates a whole cache of the capacity (`holding.measuring`)

    def __init__(self, model: PreTrainedModel, eos_token_ids: frozenset[int] | None = None, *,
                 runner: str = "eager", capacity: int | None = None, backend: str = "inductor"):
        super().__init__(model, eos_token_ids)
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the static path cannot run this model: {reason}")
        self._cache = None  # type: ignore[assignment]  # no growing cache: methods that share the target's cache run on `dynamic()`
        self._lean = None
        capacity = capacity or min(self.max_context, DEFAULT_CAPACITY)
        self.decoder = StaticDecoder(model, capacity + BUCKETS[-1])  # room for the widest bucket's pads
        self.runner_name, self.backend = runner, backend
        self.runner = make_runner(runner, self.decoder.step, self.device, backend)

    @property
    def cost_key(self) -> str:
        """The dynamic path's key and the runner's: a captured forward costs otherwise than transformers' forward."""
        return f"{super().cost_key}|static-{self.runner_name}"

    def sibling(self) -> StaticCausalLM:
        """The same weights on the static path over a cache and captured forwards of their own."""
        return StaticCausalLM(self.model, self.eos_token_ids, runner=self.runner_name,
                              capacity=self.decoder.capacity - BUCKETS[-1], backend=self.backend)

    @functools.cached_property
    def twin(self) -> HFCausalLM:
        """The same weights on the dynamic path (transformers' forward, a cache that grows): for the methods
        that run the target's layers over its own cache (layer skipping, sparse caches)."""
        return HFCausalLM(self.model, self.eos_token_ids)

    @torch.inference_mode()
    def capture(self, hidden: tuple[bool | tuple[int, ...], ...] = (False,), progress=None) -> float:
        """Run every bucket's forward once for each hidden-state request in `hidden` (captured or compiled, by
        the runner) past the sequence's end, so that a first answer does not pay for it; returns the seconds
        it took. `progress`: called with (done, total) after each."""
        began = time.perf_counter()
        keys = [(width, h) for h in hidden for width in BUCKETS]
        for done, (width, h) in enumerate(keys, 1):
            self._ensure(self._length + 2 * BUCKETS[-1])
            packed = pack(self._length, width, width, None, None)  # writes only past the sequence
            self.runner((packed, torch.zeros(width, dtype=torch.long, device="cpu")), (h,))
            if progress is not None:
                progress(done, len(keys))
        devices.synchronize(self.device)
        return time.perf_counter() - began

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, num_logits: int | None = None,
                output_hidden: bool | tuple[int, ...] = False, rows: torch.Tensor | None = None) -> ForwardOutput:
        n, start = token_ids.numel(), self._length
        self._ensure(start + n + BUCKETS[-1])
        if fits(n, tree_mask):
            width = bucket(n) or n
            packed = pack_on(self.device, start, n, width, positions, tree_mask)
            logits, hidden = self.runner((packed, _padded(token_ids, width)), (output_hidden,))  # [width, vocab]
        else:  # a prefill chunk, or a mask over the cache: the same arithmetic at its own width
            logits, hidden = self._eager(token_ids, positions, tree_mask, output_hidden)
        self._length += n
        num_logits = n if num_logits is None else num_logits
        if rows is None:
            logits = logits[n - num_logits : n]
        else:
            logits = logits.index_select(0, to_device(rows, self.device))
        return ForwardOutput(logits=logits, hidden=None if hidden is None else hidden[:n])

    def _eager(self, token_ids, positions, tree_mask, output_hidden):
        n, start, device = token_ids.numel(), self._length, self.device
        slots = torch.arange(start, start + n, device=device)
        positions = slots if positions is None else to_device(positions, device)
        allowed = full_mask(start, n, self.decoder.capacity, tree_mask)
        return self.decoder.run(to_device(token_ids, device), positions, slots, to_device(allowed, device),
                                output_hidden)

    def _ensure(self, needed: int) -> None:
        """Room for `needed` positions: the cache doubles (what it holds kept), the runner starts afresh."""
        if needed <= self.decoder.capacity:
            return
        old, capacity = self.decoder.kv, self.decoder.capacity
        while capacity < needed:
            capacity *= 2
        self.decoder.allocate(capacity)
        self.decoder.kv[..., : old.shape[3], :] = old
        self.runner.reset()

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot crop a cache of {self._length} tokens to {length}")
        self._length = length  # what lies past it is overwritten by the next forward, and masked until then

    @torch.inference_mode()
    def _move(self, start: int, keep: list[int]) -> None:
        source = to_device([start + i for i in keep], self.device)
        target = torch.arange(start, start + len(keep), device=self.device)
        kv = self.decoder.kv  # [2, layers, kv_heads, capacity, head_dim]: every layer's keys and values at once
        kv.index_copy_(3, target, kv.index_select(3, source))

    def reset(self) -> None:
        self._length = 0

    @torch.inference_mode()
    def entries(self, slots: torch.Tensor) -> Entries:
        return Entries([self.decoder.kv.index_select(3, to_device(slots, self.device))])

    @torch.inference_mode()
    def append_entries(self, entries: Entries, n: int) -> None:
        self._ensure(self._length + n + BUCKETS[-1])
        self.decoder.kv[..., self._length : self._length + n, :] = entries.tensors[0][..., :n, :]
        self._length += n


def torch_lm(model: PreTrainedModel, static: bool | None = None, progress: bool = True) -> HFCausalLM:
    """`model` as the torch backend runs it: on the static path with CUDA graphs (`static` True, or None on a
    CUDA device where the model fits the path: `unsupported`), else on the dynamic path (`HFCausalLM`). A graphed
    model's buckets are captured here, with a progress line (`progress`); a hidden-state request a method makes
    later is captured on its first use."""
    reason = unsupported(model)
    if static is None:
        static = model.device.type == "cuda" and reason is None
    if not static:
        return HFCausalLM(model)
    if reason is not None:
        raise UserError(f"the static path cannot run this model: {reason}")
    lm = StaticCausalLM(model, runner="graphs" if model.device.type == "cuda" else "eager")
    if lm.runner_name == "graphs":
        with Progress(TextColumn("capturing CUDA graphs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, disable=not progress) as bar:
            task = bar.add_task("capture", total=len(BUCKETS))
            lm.capture(progress=lambda done, total: bar.update(task, completed=done))
    return lm
