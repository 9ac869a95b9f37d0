"""EAGLE-3 (Li et al. 2025): a head that drafts from the target's low, middle and high layers at once.

Three changes from EAGLE (`drafters.eagle`):
1. Its input is not the target's last hidden state but the inputs of three of the target's decoder layers
   (by default 2, L/2 and L - 3 of L, the choice vLLM and SGLang make) side by side, fused by a linear
   layer `fc` (3 d_target -> d): the shallow layers keep what the last one has already traded for the
   next token's prediction.
2. It predicts tokens, not features: its output goes through a final norm to the LM head over a draft
   vocabulary (the target's most frequent tokens in its own answers), trained with cross-entropy against the
   target's distribution alone: its output is free to be whatever helps the next step, which reads it back.
3. Training-time test (`training.eagle3`): the head is trained on its own outputs for several draft
   steps, as it drafts, not only on the target's features.

One decoder layer: the fused feature (or its own previous output) h and the next token's embedding e are
normalised apart and go side by side (2d wide) into the attention's projections; the residual stream
carries h. Parameter names follow the EAGLE-3 checkpoint layout (`fc`, `midlayer.*`, `norm`, `d2t`, `t2d`),
so `specdecode export eagle` writes what vLLM and SGLang load. The LM head is the target's, frozen, its
rows of the draft vocabulary; the embedding is the target's.

At inference the head keeps a KV cache of the context's pairs (fused feature of position t, token t + 1),
fed from the verification forwards' hidden states of those three layers (`Drafter.needs`), and drafts a
chain (`eagle3`) or EAGLE-2's dynamic tree (`eagle3-tree`) exactly as `drafters.eagle` does. The head
itself, its layer and storage are in `drafters.eagle3_head`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdecode.devices import to_device
from specdecode.drafters.base import Drafter, Needs, tensor_bytes
from specdecode.drafters.eagle import EagleDrafter, EagleTreeDrafter
from specdecode.drafters.eagle_head import full_vocabulary
from specdecode.drafters.static_heads import StaticFeeds
from specdecode.drafters.eagle3_head import Eagle3Head
from specdecode.drafters.heads import check_fits, for_drafting, head_folder, lm_head_rows
from specdecode.errors import UserError
from specdecode.models.static import BUCKETS, DEFAULT_CAPACITY, StaticCausalLM
from specdecode.models.static_layers import fuse_layer, grouped_attention, rotate


class Eagle3State:
    """An EAGLE-3 head's view of one sequence (the interface of `eagle_head.HeadState`, so the EAGLE chain and
    tree drafters run it): the fused features of the context, the head's KV cache over the context's
    pairs, and the speculative entries after them, all on the target's device."""

    quantize = True  # the head's layers on the quantized kernels where the device is a CPU that has them

    def __init__(self, head: Eagle3Head, target_model, adaptation=None):
        self.trained, self.target_model = head, target_model
        self.embed = target_model.get_input_embeddings()
        self.device = self.embed.weight.device
        self.adaptation = adaptation  # a head that learns while it drafts (`drafters.online`), or None
        # the target's LM head's rows of the draft vocabulary [V', d]: read once (an int8 target unpacks its whole
        # head to give them, an int4 one those rows: `heads.lm_head_rows`); an adaptation has read them already,
        # and holds them for its drafting copies to come
        rows = adaptation.lm_rows if adaptation is not None else lm_head_rows(target_model, head.draft_ids)
        self._drafting_copy(head, rows)
        self.dtype = torch.float32
        self.vocab_ids = head.draft_ids.to(self.device)
        self.vocab_size = target_model.get_output_embeddings().out_features
        self.features: list[torch.Tensor] = []  # [layers * d] the target's layer inputs at each context position
        self.keys: torch.Tensor | None = None  # [kv_heads, cached, head_dim]
        self.values: torch.Tensor | None = None
        self.reset()

    def _drafting_copy(self, head: Eagle3Head, rows: torch.Tensor | None = None) -> None:
        """The head as it drafts: float32 on the target's device (`heads.for_drafting`), over the LM head's `rows`
        (else the adaptation's)."""
        if rows is None:
            assert self.adaptation is not None, "an adapting state copies again over its adaptation's rows; others once"
            rows = self.adaptation.lm_rows
        self.head, self.lm_head = for_drafting(head, rows, self.quantize)

    def reset(self, forget: bool = False) -> None:
        """Ready for a new sequence. With an adaptation, the head first learns from the one that ended;
        `forget` takes it back to the trained head."""
        if self.adaptation is not None and forget and self.adaptation.restart():
            self._drafting_copy(self.trained)
        elif self.adaptation is not None and not forget and self.features:
            if self.adaptation.learn(self.context, torch.stack(self.features)):
                self._drafting_copy(self.adaptation.head)
        self.context: list[int] = []  # the sequence's context as last synced
        self.features = []
        self.keys = self.values = None
        self.fed = 0  # context pairs in the cache: positions 0 .. fed - 1
        self.cached = 0  # entries in the cache (the fed pairs, then speculative ones)
        self.last: torch.Tensor | None = None  # the head's output after its last real pair

    def memory_bytes(self) -> int:  # the head as loaded and as it drafts, its cache and features, the adaptation's
        # in one count: a drafting copy may share its storage with the adaptation's rows
        held = self.adaptation.tensors() if self.adaptation is not None else ()
        return tensor_bytes(self.trained, self.head, self.lm_head, self.features, self.keys, self.values, *held)

    def observe(self, hidden: torch.Tensor, num_pending: int, path: tuple[int, ...]) -> None:
        rows = list(range(num_pending)) + [num_pending + node for node in path]
        self.features += list(hidden[to_device(rows, hidden.device)].to(self.dtype))  # [pending + accepted] rows

    def run(self, hidden: torch.Tensor, tokens: list[int] | torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed pairs (hidden[i], tokens[i]) at `positions` [n] (on the device) after the cache; `tokens` from
        the host or the device, mask [n, cached + n] bool from either (None: causal). Returns the head's
        outputs [n, d]."""
        n = len(tokens)
        if mask is None:  # causal: every cached entry, then the new rows up to each
            mask = torch.ones(n, self.cached + n, dtype=torch.bool, device=self.device)
            mask[:, self.cached :] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        embeddings = self.embed(to_device(tokens, self.device)).to(self.dtype)  # [n, d]
        past = None if self.keys is None else (self.keys, self.values)
        out, (k, v) = self.head(hidden.to(self.dtype), embeddings, positions, to_device(mask, self.device), past)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], 1)
        self.values = v if self.values is None else torch.cat([self.values, v], 1)
        self.cached += n
        return out

    def crop(self) -> None:
        if self.cached > self.fed and self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[:, : self.fed], self.values[:, : self.fed]
            self.cached = self.fed

    def sync(self, context: list[int]) -> torch.Tensor | None:
        """Feed the context's pairs not yet in the cache; the head's output after the context (None
        before the target's first forward)."""
        self.context = context
        if len(context) < 2 or len(self.features) < len(context) - 1:
            return None
        self.crop()
        end = len(context) - 1
        if self.fed < end:
            fused = self.head.fuse(torch.stack(self.features[self.fed : end]))
            positions = torch.arange(self.fed, end, device=self.device)
            self.last = self.run(fused, context[self.fed + 1 : end + 1], positions)[-1]
            self.fed = end
        return self.last

    def probs(self, output: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.head.logits(output, self.lm_head).float(), dim=-1)

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """[n, vocab]: the draft logits on the draft vocabulary, -inf elsewhere."""
        return full_vocabulary(outputs, self.head.logits(outputs, self.lm_head).float(), self.vocab_ids,
                               self.vocab_size)


class StaticEagle3State(StaticFeeds, Eagle3State):
    """An EAGLE-3 head's view of one sequence on the static path (`static_heads.StaticFeeds`), over a cache of
    `capacity` positions."""

    kind = "the EAGLE-3 head"

    def __init__(self, head: Eagle3Head, target_model, runner: str = "eager", capacity: int = DEFAULT_CAPACITY,
                 adaptation=None, backend: str = "inductor"):
        self.capacity = capacity + BUCKETS[-1]
        self.runner_name, self.backend = runner, backend
        super().__init__(head, target_model, adaptation)

    def _drafting_copy(self, head: Eagle3Head, rows: torch.Tensor | None = None) -> None:
        super()._drafting_copy(head, rows)
        layer = self.head.midlayer
        attention = layer.self_attn
        fuse_layer(attention, layer.mlp)  # (the drafting copy's own weights: `for_drafting` copied the head)
        # the rotary angles' frequencies, each pair's twice, and the sign that makes `rotate`'s roll the rotation
        self._frequencies = attention.inverse_frequencies.repeat(2)
        self._signs = torch.ones(attention.head_dim, device=self.device)
        self._signs[: attention.head_dim // 2] = -1.0
        self._allocate(torch.zeros(2, attention.kv_heads, self.capacity, attention.head_dim, dtype=torch.float32,
                                   device=self.device), self.head.config.hidden_size)

    def memory_bytes(self) -> int:
        return super().memory_bytes() + tensor_bytes(self.kv)

    def feed(self, hidden, tokens, positions, slots, allowed):
        """The head's layer (`Eagle3Head.forward`) in few kernels, as the target's static layers are written
        (`models.static_layers`): the query, key and value in one product, the MLP's gate and up in another, the RMS
        norms torch's one kernel, query and key rotated together; the same sums in float32."""
        layer: Any = self.head.midlayer  # (its stacked weights are buffers `fuse_layer` registered)
        attention, mlp = layer.self_attn, layer.mlp
        n, heads, kv_heads = hidden.shape[0], attention.heads, attention.kv_heads
        embeddings = self.embed(tokens).to(self.dtype)
        x = torch.cat([_norm(layer.input_layernorm, embeddings), _norm(layer.hidden_norm, hidden)], dim=-1)
        qkv = F.linear(x, attention.qkv_weight).view(n, heads + 2 * kv_heads, attention.head_dim)
        angles = positions.float()[:, None] * self._frequencies  # [n, head_dim]
        rotated = rotate(qkv[:, : heads + kv_heads], angles.cos()[:, None], (angles.sin() * self._signs)[:, None],
                         attention.head_dim // 2)
        self.kv[0].index_copy_(1, slots, rotated[:, heads:].transpose(0, 1))  # [kv_heads, capacity, head_dim]
        self.kv[1].index_copy_(1, slots, qkv[:, heads + kv_heads :].transpose(0, 1))
        attended = grouped_attention(rotated[:, :heads].transpose(0, 1), self.kv[0], self.kv[1], allowed,
                                     attention.head_dim ** -0.5)
        residual = hidden + attention.o_proj(attended.transpose(0, 1).reshape(n, -1))
        gate, up = F.linear(_norm(layer.post_attention_layernorm, residual), mlp.gate_up_weight).chunk(2, dim=-1)
        return residual + mlp.down_proj(F.silu(gate) * up)

    def probs(self, output: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.lm_head(_norm(self.head.norm, output)), dim=-1)


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The head's RMS norm (`eagle3_head.RMSNorm`) in torch's one kernel."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


class Eagle3Drafter(EagleDrafter):
    """EAGLE-3 drafting a chain: EAGLE's chain drafter on an EAGLE-3 head."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head, target_model, max_tokens: int = 8, min_confidence: float = 0.05,
                 adaptation=None, state: Eagle3State | None = None):
        super().__init__(None, target_model, max_tokens, min_confidence,
                         state=state or Eagle3State(head, target_model, adaptation))
        self.needs = Needs(hidden=tuple(head.config.aux_layers))
        self.name = "eagle3" if adaptation is None else "eagle3-online"


class Eagle3TreeDrafter(EagleTreeDrafter):
    """EAGLE-3 growing EAGLE-2's dynamic tree."""

    name = "eagle3-tree"

    def __init__(self, head: Eagle3Head, target_model, curve, draft_cost: float | None = None, adaptation=None,
                 state: Eagle3State | None = None, **tree_options):
        super().__init__(None, target_model, curve, draft_cost,
                         state=state or Eagle3State(head, target_model, adaptation), **tree_options)
        self.needs = Needs(hidden=tuple(head.config.aux_layers))
        self.name = "eagle3-tree" if adaptation is None else "eagle3-online-tree"


def build_eagle3(target, draft, options, adapt=None) -> Drafter:
    """The `eagle3` method: the target's EAGLE-3 head (`specdecode train eagle3`): `options.head`, else the one
    shipped for the default target, drafting a chain, or with `options.tree` the dynamic tree; `adapt(head,
    target model)`: its `drafters.online`."""
    model, folder = head_folder(target, "eagle3", options.head)
    head, record = Eagle3Head.load(folder, dtype=torch.float32, device=model.device)
    check_fits(folder, "eagle3", record, head.config.target_hidden_size, head.config.vocab_size, model.config)
    if max(head.config.aux_layers) >= model.config.num_hidden_layers:
        raise UserError(f"the eagle3 head in {folder} reads the target's layers {list(head.config.aux_layers)}; "
                        f"this target has {model.config.num_hidden_layers}")
    adaptation = None if adapt is None else adapt(head, model)
    state = eagle3_state(head, target, adaptation)
    if options.tree:
        return Eagle3TreeDrafter(head, model, target.cost_curve(), budget=options.budget, adaptation=adaptation,
                                 state=state)
    return Eagle3Drafter(head, model, adaptation=adaptation, state=state)


def eagle3_state(head: Eagle3Head, target, adaptation=None) -> Eagle3State:
    """The head's state for a target (a `CausalLM` on the torch backend): on the static path where the target is
    on it (`models.static.StaticCausalLM`), with the target's runner and capacity."""
    if isinstance(target, StaticCausalLM):
        return StaticEagle3State(head, target.model, target.runner_name, target.decoder.capacity - BUCKETS[-1],
                                 adaptation, target.backend)
    return Eagle3State(head, target.model, adaptation)


def load_shipped(target_name: str | None = None) -> tuple[Eagle3Head, dict]:
    """The EAGLE-3 head shipped for a target (default: the default target), with its record."""
    from specdecode.models.registry import DEFAULT_TARGET, get_model
    return Eagle3Head.load(Path(__file__).resolve().parents[1] / "heads" / get_model(target_name or DEFAULT_TARGET).name
                           / "eagle3")
