"""The EAGLE-3 head as a module (`drafters.eagle3` drafts with it, `training.eagle3` trains it): its config, its
one decoder layer over the fused feature and the next token's embedding side by side, its storage in the
checkpoint layout vLLM and SGLang load (`fc`, `midlayer.*`, `norm`, `d2t`, `t2d`), and `unroll`, the
head run on its own outputs for several steps as it drafts.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import UserError
from specdecode.paths import damaged, read_record, write_atomically

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
    inverse_frequencies: torch.Tensor  # a buffer (register_buffer), declared for the type checker

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        inverse = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        self.register_buffer("inverse_frequencies", inverse, persistent=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, 2d] at `positions` [n] -> (queries [heads, n, hd], keys, values [kv_heads, n, hd]), rotated."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim).transpose(0, 1)  # [heads, n, hd]
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)  # [kv, n, hd]
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        angles = positions.float()[:, None] * self.inverse_frequencies[None]  # [n, hd / 2]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Queries [heads, n, hd] over keys and values [kv_heads, m, hd] where mask [n, m] allows -> [n, d]."""
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask[None, None],
                                             enable_gqa=True)[0]  # [heads, n, hd]
        return self.o_proj(out.transpose(0, 1).reshape(q.shape[1], -1))

    def forward(self, x, positions, mask, past):
        """x [n, 2d] at `positions` [n]; `past`: (keys, values) [kv_heads, m, head_dim] the rows may also see
        (or None); mask [n, m + n] bool over past and new keys. Returns (out [n, d], (keys, values) of x)."""
        q, k, v = self.project(x, positions)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
        return self.attend(q, keys, values, mask), (k, v)


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

    # buffers (register_buffer), declared for the type checker
    d2t: torch.Tensor
    t2d: torch.Tensor

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
        attended, new = self.midlayer.self_attn(self.inputs(hidden, embeddings), positions, mask, past)
        return self.finish(hidden, attended), new

    def inputs(self, hidden: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """The attention's input [n, 2d]: the embeddings and the features, each normalised, side by side."""
        layer = self.midlayer
        return torch.cat([layer.input_layernorm(embeddings), layer.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output [n, d] from its residual stream `hidden` and the attention's output."""
        residual = hidden + attended
        return residual + self.midlayer.mlp(self.midlayer.post_attention_layernorm(residual))

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
        # each file whole or not at all, older shards gone before the record, written last (`heads.save_head`)
        (folder / CONFIG).unlink(missing_ok=True)
        written = [write_atomically(folder / WEIGHTS.format(i + 1), functools.partial(save_file, part))
                   for i, part in enumerate(shards)]
        for old in set(folder.glob("eagle3-*.safetensors")) - set(written):
            old.unlink()
        write_atomically(folder / CONFIG, json.dumps({"config": self.config.to_dict(), **record}, indent=1))

    @classmethod
    def load(cls, folder: Path, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> tuple[Eagle3Head, dict]:
        from safetensors.torch import load_file

        folder = Path(folder)
        files = sorted(folder.glob("eagle3-*.safetensors"))
        if not (folder / CONFIG).is_file() or not files:
            raise UserError(f"{folder} holds no EAGLE-3 head ({CONFIG} and eagle3-*.safetensors); train one with "
                            "`specdecode train eagle3`")
        fix = "train it again (`specdecode train eagle3`)"
        record = read_record(folder / CONFIG, "an EAGLE-3 head's record", fix)
        with damaged(folder, "an EAGLE-3 head", fix):
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
    keys: list[torch.Tensor] = []  # each step's [kv_heads, m, head_dim]
    values: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    for step in range(steps):
        past = None if step == 0 else (torch.cat(keys, 1), torch.cat(values, 1))
        embeddings = embed(tokens[step + 1 : step + 1 + m]).float()
        out, (k, v) = head(hidden, embeddings, torch.arange(m, device=device) + step, _mask(m, step, device), past)
        keys.append(k)
        values.append(v)
        outputs.append(out)
        hidden = out
    return outputs
