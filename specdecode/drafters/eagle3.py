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
chain (`eagle3`) or EAGLE-2's dynamic tree (`eagle3-tree`) exactly as `drafters.eagle` does.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.devices import to_device
from specdecode.drafters.base import Drafter, Needs, tensor_bytes
from specdecode.drafters.eagle import EagleDrafter, EagleTreeDrafter, full_vocabulary
from specdecode.drafters.heads import for_drafting, shipped_or_explain
from specdecode.errors import UserError

CONFIG = "eagle3.json"
WEIGHTS = "eagle3-{:05d}.safetensors"  # shards of at most MAX_FILE_BYTES
MAX_FILE_BYTES = 38 * 2**20  # the repository keeps no file over 40 MB


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs the head reads: low, middle, high (2, L/2, L - 3 of L; the first
    three on a shallow model)."""
    if num_layers < 3:
        raise UserError(f"EAGLE-3 reads three of the target's layers; this one has {num_layers}")
    if num_layers < 6:
        return (0, 1, 2)
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class Eagle3Config:
    hidden_size: int  # the head's width: the target's
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # hidden_states indices of the target: the inputs of these decoder layers

    @staticmethod
    def for_target(target_config, intermediate_size: int, draft_vocab_size: int) -> Eagle3Config:
        c = target_config
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        return Eagle3Config(
            hidden_size=c.hidden_size, target_hidden_size=c.hidden_size, intermediate_size=intermediate_size,
            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps, rope_theta=float(theta), max_position_embeddings=c.max_position_embeddings,
            vocab_size=c.vocab_size, draft_vocab_size=draft_vocab_size,
            aux_layers=default_layers(c.num_hidden_layers))

    def to_dict(self) -> dict:
        return asdict(self) | {"aux_layers": list(self.aux_layers)}

    @staticmethod
    def from_dict(data: dict) -> Eagle3Config:
        known = {f.name for f in fields(Eagle3Config)}
        return Eagle3Config(**{k: v for k, v in data.items() if k in known} | {"aux_layers": tuple(data["aux_layers"])})


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        inverse = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        self.register_buffer("inverse_frequencies", inverse, persistent=False)

    def forward(self, x, positions, mask, past):
        """x [n, 2d] at `positions` [n]; `past`: (keys, values) [kv_heads, m, head_dim] the rows may also see
        (or None); mask [n, m + n] bool over past and new keys. Returns (out [n, d], (keys, values) of x)."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim).transpose(0, 1)  # [heads, n, hd]
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)  # [kv, n, hd]
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        angles = positions.float()[:, None] * self.inverse_frequencies[None]  # [n, hd / 2]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask[None, None],
                                             enable_gqa=True)[0]  # [heads, n, hd]
        return self.o_proj(out.transpose(0, 1).reshape(n, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class Eagle3Head(nn.Module):
    """(feature h_t, embedding of token t + 1) pairs -> the head's outputs o_t (pre-norm), whose draft logits
    (`logits`) predict token t + 2 and which are the next draft step's h."""

    def __init__(self, config: Eagle3Config, draft_ids: torch.Tensor):
        super().__init__()
        c = self.config = config
        if draft_ids.numel() != c.draft_vocab_size:
            raise ValueError(f"{draft_ids.numel()} draft token ids for a draft vocabulary of {c.draft_vocab_size}")
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        draft_ids = draft_ids.long()
        # d2t: the target id of draft id i is i + d2t[i]; t2d: which target ids the draft vocabulary holds
        self.register_buffer("d2t", draft_ids - torch.arange(len(draft_ids), device=draft_ids.device), persistent=True)
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool, device=draft_ids.device)
        t2d[draft_ids] = True
        self.register_buffer("t2d", t2d, persistent=True)

    @property
    def draft_ids(self) -> torch.Tensor:
        """[V'] the target token id of each draft id (on the head's device)."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., layers * d_target] the target's layer inputs -> [..., d] the head's feature."""
        return self.fc(aux)

    def forward(self, hidden, embeddings, positions, mask, past=None):
        """hidden [n, d] (fused features or the head's own outputs), embeddings [n, d] of the tokens that
        follow, positions [n]; mask [n, m + n] bool over `past` (m keys) and the new ones. Returns
        (outputs [n, d], (keys, values) of the new rows, [kv_heads, n, head_dim] each)."""
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeddings), layer.hidden_norm(hidden)], dim=-1)  # [n, 2d]
        attended, new = layer.self_attn(x, positions, mask, past)
        residual = hidden + attended
        return residual + layer.mlp(layer.post_attention_layernorm(residual)), new

    def logits(self, outputs: torch.Tensor, lm_head: torch.Tensor | nn.Module) -> torch.Tensor:
        """[..., d] outputs -> [..., V'] draft logits, through the final norm and the target's LM head rows
        of the draft vocabulary (`lm_head` [V', d], or a layer computing them: `heads.for_drafting`)."""
        if isinstance(lm_head, nn.Module):
            return lm_head(self.norm(outputs))
        return self.norm(outputs) @ lm_head.T

    # -- storage ---------------------------------------------------------------------------------

    def save(self, folder: Path, record: dict) -> None:
        """bfloat16 weights in shards of at most MAX_FILE_BYTES, and the config and record as JSON."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("eagle3-*.safetensors"):
            old.unlink()
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in self.state_dict().items():
            tensor = tensor.detach().to(torch.bfloat16 if tensor.is_floating_point() else tensor.dtype).contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > MAX_FILE_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = tensor
            size += nbytes
        for i, shard in enumerate(shards):
            save_file(shard, str(folder / WEIGHTS.format(i + 1)))
        (folder / CONFIG).write_text(json.dumps({"config": self.config.to_dict(), **record}, indent=1))

    @classmethod
    def load(cls, folder: Path, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> tuple[Eagle3Head, dict]:
        from safetensors.torch import load_file

        folder = Path(folder)
        files = sorted(folder.glob("eagle3-*.safetensors"))
        if not (folder / CONFIG).is_file() or not files:
            raise UserError(f"{folder} holds no EAGLE-3 head ({CONFIG} and eagle3-*.safetensors); train one with "
                            "`specdecode train eagle3`")
        record = json.loads((folder / CONFIG).read_text())
        config = Eagle3Config.from_dict(record.pop("config"))
        weights = {k: v for f in files for k, v in load_file(str(f)).items()}
        head = cls(config, torch.arange(config.draft_vocab_size, device="cpu") + weights["d2t"])
        head.load_state_dict(weights)
        return head.to(device=device, dtype=dtype).eval(), record


def _mask(rows: int, step: int, device: torch.device) -> torch.Tensor:
    """[rows, (step + 1) rows] bool: step 0's keys up to the row, then the row's own keys of steps 1..step."""
    causal = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    if step == 0:
        return causal
    eye = torch.eye(rows, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def unroll(head: Eagle3Head, embed, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test's forward (`training.eagle3`, `drafters.online`): the head's outputs [m, d] at each of
    `steps` draft steps, m = len(tokens) - steps - 1 rows. `tokens` [n] and `aux` [n, k d] on the head's device."""
    m, device = len(tokens) - steps - 1, tokens.device
    hidden = head.fuse(aux[:m].float())
    keys, values, outputs = [], [], []
    for step in range(steps):
        past = None if step == 0 else (torch.cat(keys, 1), torch.cat(values, 1))
        embeddings = embed(tokens[step + 1 : step + 1 + m]).float()
        out, (k, v) = head(hidden, embeddings, torch.arange(m, device=device) + step, _mask(m, step, device), past)
        keys.append(k)
        values.append(v)
        outputs.append(out)
        hidden = out
    return outputs


class Eagle3State:
    """An EAGLE-3 head's view of one sequence (the interface of `eagle.HeadState`, so the EAGLE chain and
    tree drafters run it): the fused features of the context, the head's KV cache over the context's
    pairs, and the speculative entries after them, all on the target's device."""

    def __init__(self, head: Eagle3Head, target_model, adaptation=None):
        self.trained, self.target_model = head, target_model
        self.device = target_model.get_output_embeddings().weight.device
        self.adaptation = adaptation  # a head that learns while it drafts (`drafters.online`), or None
        self._drafting_copy(head)
        self.dtype = torch.float32
        self.embed = target_model.get_input_embeddings()
        self.vocab_ids = head.draft_ids.to(self.device)
        self.vocab_size = target_model.get_output_embeddings().weight.shape[0]
        self.features = []
        self.reset()

    def _drafting_copy(self, head: Eagle3Head) -> None:
        """The head as it drafts: float32 on the target's device, its layers on the quantized kernels where
        that is a CPU that has them."""
        weight = self.target_model.get_output_embeddings().weight  # [vocab, d]
        self.head, self.lm_head = for_drafting(head, weight[head.draft_ids.to(self.device)])

    def reset(self, forget: bool = False) -> None:
        """Ready for a new sequence. With an adaptation, the head first learns from the one that ended;
        `forget` takes it back to the trained head."""
        if self.adaptation is not None and forget and self.adaptation.restart():
            self._drafting_copy(self.trained)
        elif self.adaptation is not None and not forget and self.features:
            if self.adaptation.learn(self.context, torch.stack(self.features)):
                self._drafting_copy(self.adaptation.head)
        self.context: list[int] = []  # the sequence's context as last synced
        self.features: list[torch.Tensor] = []  # [layers * d] the target's layer inputs at each context position
        self.keys = self.values = None  # [kv_heads, cached, head_dim]
        self.fed = 0  # context pairs in the cache: positions 0 .. fed - 1
        self.cached = 0  # entries in the cache (the fed pairs, then speculative ones)
        self.last: torch.Tensor | None = None  # the head's output after its last real pair

    def memory_bytes(self) -> int:  # the head as loaded and as it drafts, its cache and features, the adaptation's
        return tensor_bytes(self.trained, self.head, self.lm_head, self.features, self.keys, self.values) + (
            self.adaptation.memory_bytes() if self.adaptation is not None else 0)

    def observe(self, hidden: torch.Tensor, num_pending: int, verdict) -> None:
        rows = list(range(num_pending)) + [num_pending + node for node in verdict.path]
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
        if self.cached > self.fed:
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


class Eagle3Drafter(EagleDrafter):
    """EAGLE-3 drafting a chain: EAGLE's chain drafter on an EAGLE-3 head."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head, target_model, max_tokens: int = 8, min_confidence: float = 0.05,
                 adaptation=None):
        super().__init__(head, target_model, max_tokens, min_confidence,
                         state=Eagle3State(head, target_model, adaptation))
        self.needs = Needs(hidden=tuple(head.config.aux_layers))
        self.name = "eagle3" if adaptation is None else "eagle3-online"


class Eagle3TreeDrafter(EagleTreeDrafter):
    """EAGLE-3 growing EAGLE-2's dynamic tree."""

    name = "eagle3-tree"

    def __init__(self, head: Eagle3Head, target_model, curve, draft_cost: float = 0.05, adaptation=None,
                 **tree_options):
        super().__init__(head, target_model, curve, draft_cost, state=Eagle3State(head, target_model, adaptation),
                         **tree_options)
        self.needs = Needs(hidden=tuple(head.config.aux_layers))
        self.name = "eagle3-tree" if adaptation is None else "eagle3-online-tree"


def build_eagle3(target, draft, options, adapt=None) -> Drafter:
    """The `eagle3` method: the target's EAGLE-3 head (`specdecode train eagle3`; shipped for the default target)
    drafting a chain, or with `options.tree` the dynamic tree; `adapt(head, target model)`: its `drafters.online`."""
    model, folder = shipped_or_explain(target, "EAGLE3", CONFIG)
    head, _ = Eagle3Head.load(folder, dtype=torch.float32, device=model.device)
    adaptation = None if adapt is None else adapt(head, model)
    if options.tree:
        return Eagle3TreeDrafter(head, model, target.cost_curve(), budget=options.budget, adaptation=adaptation)
    return Eagle3Drafter(head, model, adaptation=adaptation)


def load_shipped(target_name: str | None = None) -> tuple[Eagle3Head, dict]:
    """The EAGLE-3 head shipped for a target (default: the default target), with its record."""
    from specdecode.models.registry import DEFAULT_TARGET, get_model
    return Eagle3Head.load(Path(__file__).resolve().parents[1] / "heads" / get_model(target_name or DEFAULT_TARGET).name
                           / "eagle3")
