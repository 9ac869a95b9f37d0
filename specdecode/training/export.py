"""Export an EAGLE-3 head as the draft-model folder vLLM and SGLang load (`specdecode export eagle`).

Both engines load an EAGLE-3 draft as a one-layer Llama model, architecture `LlamaForCausalLMEagle3`: a
`config.json` and safetensors weights named as in the EAGLE-3 checkpoints (`fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`). This module writes that folder from a plain description of a head (its state
dict, its config as a dict, the target's LM head), so it depends on no head class.

Glossary:
- *aux layers*: the target layers whose hidden states the head fuses, as `hidden_states` indices of
  transformers (`output_hidden_states[i]`, the input of decoder layer i; 0 is the embedding output).
  vLLM reads `eagle_aux_hidden_state_layer_ids` at the config's top level in that same convention (it
  captures a layer's input). SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` in the
  convention "output of layer i" and adds 1 before capturing a layer's input, so its ids are ours
  minus 1. With no ids both engines fall back to (2, L // 2, L - 3), ours by default.
- *draft vocabulary*: the V' target tokens the head predicts; draft id i is target token i + d2t[i]
  (the ids ascending, so d2t is non-decreasing); t2d [V] marks them. The head has no LM head of its
  own: its logits are the target's LM head rows of those tokens, written here as `lm_head.weight`.
- The embedding is the target's. Neither engine needs it in the folder: both share the target's when
  the checkpoint holds none (vLLM: `has_own_embed_tokens`; SGLang: `set_embed`), so it is written only
  when asked for (`embed`), e.g. for a loader that cannot share.

Sizes: a safetensors file holds whole tensors, so files are cut at tensor boundaries, at most
MAX_SHARD_BYTES of tensor data each (the repository takes no file over 40 MB), with a
`model.safetensors.index.json` when there are several. A tensor larger than that on its own cannot be
cut without breaking the engines' loaders; it gets a file of its own, and a file over FILE_LIMIT is
reported in `Exported.oversize` (a draft vocabulary of 32,768 on a target 1,536 wide makes LM head rows of
100 MB in bfloat16: such a folder is for serving, not for the repository).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from specdecode.drafters.eagle3_head import Eagle3Config
from specdecode.errors import UserError
from specdecode.paths import write_atomically

Format = Literal["vllm", "sglang"]  # the engines an export is laid out for
FORMATS: tuple[Format, ...] = ("vllm", "sglang")
ARCHITECTURE = "LlamaForCausalLMEagle3"  # both engines' registered name for a one-layer Llama EAGLE-3 draft
MAX_SHARD_BYTES = 36 * 2**20  # tensor bytes per file; with its header a file stays under FILE_LIMIT
FILE_LIMIT = 40 * 10**6  # the repository takes no larger file
WEIGHTS = "model.safetensors"
SHARD = "model-{:05d}-of-{:05d}.safetensors"
INDEX = "model.safetensors.index.json"

NORMS = ("midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
         "midlayer.post_attention_layernorm.weight", "norm.weight")
HEAD_WEIGHTS = ("fc.weight", *NORMS, "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight")


def head_shape(config: dict) -> Eagle3Config:
    """The sizes of an EAGLE-3 head, read from a config dict with the defaults and checks an export needs."""
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps",
                           "max_position_embeddings", "vocab_size", "draft_vocab_size", "aux_layers")
               if config.get(k) is None]
    if missing:
        raise UserError(f"the head's config lacks {', '.join(missing)}")
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta") or rope.get("rope_theta")
    if theta is None:
        raise UserError("the head's config has no rope_theta (nor rope_parameters.rope_theta)")
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"the head uses {rope['rope_type']!r} RoPE scaling; only plain RoPE is exported")
    aux = tuple(int(i) for i in config["aux_layers"])
    if len(aux) != 3 or any(b <= a for a, b in zip(aux, aux[1:])) or aux[0] < 0:
        # the engines concatenate exactly three captured states, in layer order
        raise UserError(f"aux_layers must be three increasing layer indices, not {list(aux)}")
    return Eagle3Config(
        hidden_size=config["hidden_size"],
        target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=float(config["rms_norm_eps"]), rope_theta=float(theta),
        max_position_embeddings=config["max_position_embeddings"], vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"], aux_layers=aux)


def weight_shapes(shape: Eagle3Config) -> dict[str, tuple[int, ...]]:
    d, q, kv, inter = (shape.hidden_size, shape.num_attention_heads * shape.head_dim,
                       shape.num_key_value_heads * shape.head_dim, shape.intermediate_size)
    return {
        "fc.weight": (d, 3 * shape.target_hidden_size),  # fuses the three aux states
        **{name: (d,) for name in NORMS},
        "midlayer.self_attn.q_proj.weight": (q, 2 * d),  # input: [embedding, hidden] side by side
        "midlayer.self_attn.k_proj.weight": (kv, 2 * d),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, q),
        "midlayer.mlp.gate_proj.weight": (inter, d),
        "midlayer.mlp.up_proj.weight": (inter, d),
        "midlayer.mlp.down_proj.weight": (d, inter),
    }


@dataclass
class Exported:
    folder: Path
    files: list[str]  # the weight files written
    oversize: list[str]  # those over FILE_LIMIT: each holds one tensor too large to fit


def export_eagle3(state: dict[str, torch.Tensor], config: dict, lm_head: torch.Tensor, embed: torch.Tensor | None,
                  out: Path, fmt: Format, dtype: torch.dtype = torch.bfloat16) -> Exported:
    """Write the head as `fmt`'s EAGLE-3 draft folder `out` (absent or empty).

    state: the head's state dict in the EAGLE-3 layout (HEAD_WEIGHTS, `d2t`, optionally `t2d`);
    config: its config (`Eagle3Config`'s fields, `rope_theta` or `rope_parameters`, `aux_layers`);
    lm_head: [V, d] the target's LM head; embed: [V, d] the target's embedding, written only if given."""
    check_destination(fmt, out)
    out = Path(out)
    shape = head_shape(config)
    tensors = head_tensors(state, shape, lm_head, embed, dtype)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(engine_config(shape, fmt, dtype), indent=2) + "\n")
    return write_weights(tensors, out)


def check_destination(fmt: str, out: Path) -> Format:
    """A known format (returned as one) and a folder that is new or empty (nothing of another export is mixed
    in)."""
    known = next((f for f in FORMATS if f == fmt), None)
    if known is None:
        raise UserError(f"unknown format {fmt!r}; choose {' or '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder; pick a new one")
    return known


def head_tensors(state: dict[str, torch.Tensor], shape: Eagle3Config, lm_head: torch.Tensor,
                 embed: torch.Tensor | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The folder's tensors: the head's weights in `dtype`, the LM head rows of the draft vocabulary,
    d2t (int64) and t2d (bool) with the draft ids in ascending order, and the embedding if given."""
    expected = weight_shapes(shape)
    unknown = sorted(set(state) - set(expected) - {"d2t", "t2d"})
    missing = sorted(set(expected) - set(state)) + ([] if "d2t" in state else ["d2t"])
    if unknown or missing:
        raise UserError(f"not an EAGLE-3 head state: missing {missing}, unexpected {unknown}")
    for name, size in expected.items():
        if tuple(state[name].shape) != size:
            raise UserError(f"{name} is {list(state[name].shape)}, the config says {list(size)}")
    target_size = (shape.vocab_size, shape.hidden_size)
    if tuple(lm_head.shape) != target_size:
        raise UserError(f"the target's LM head is {list(lm_head.shape)}, the head expects {list(target_size)} "
                        "(vocabulary, width): is this the head's target?")
    if embed is not None and tuple(embed.shape) != target_size:
        raise UserError(f"the target's embedding is {list(embed.shape)}, the head expects {list(target_size)}")

    draft_ids = draft_vocabulary(state, shape)  # [V'] ascending target ids
    tensors = {name: state[name].detach().to(dtype).contiguous() for name in expected}
    tensors["lm_head.weight"] = lm_head.detach()[draft_ids].to(dtype).contiguous()  # [V', d]
    tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))  # [V'] int64
    t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d  # [V]
    if embed is not None:
        tensors["embed_tokens.weight"] = embed.detach().to(dtype).contiguous()  # [V, d]
    return tensors


def draft_vocabulary(state: dict[str, torch.Tensor], shape: Eagle3Config) -> torch.Tensor:
    """[V'] the target ids of the draft vocabulary, ascending (the head's logits come from the target's
    LM head rows, so their order is free), checked against d2t and t2d."""
    d2t = state["d2t"]
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or tuple(d2t.shape) != (shape.draft_vocab_size,):
        raise UserError(f"d2t must be {shape.draft_vocab_size} integers, not {d2t.dtype} {list(d2t.shape)}")
    ids = torch.arange(len(d2t)) + d2t.long()
    ids = torch.sort(ids).values
    if ids[0] < 0 or ids[-1] >= shape.vocab_size or bool((ids[1:] == ids[:-1]).any()):
        raise UserError(f"d2t maps the draft vocabulary outside [0, {shape.vocab_size}) or twice to one token")
    if "t2d" in state:
        marked = torch.nonzero(state["t2d"].bool()).flatten()
        if state["t2d"].numel() != shape.vocab_size or not torch.equal(marked, ids):
            raise UserError("t2d does not mark exactly the draft vocabulary d2t gives")
    return ids


def engine_config(shape: Eagle3Config, fmt: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json: a one-layer Llama model of the head's sizes, with the fields the engine's EAGLE-3
    loader reads (see tests/integration/test_export.py for where each is read)."""
    aux = list(shape.aux_layers)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,  # the engines build one decoder layer per count
        "hidden_size": shape.hidden_size,
        "target_hidden_size": shape.target_hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,  # transformers 4 reads this ...
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},  # ... transformers 5 this
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": shape.vocab_size,
        "draft_vocab_size": shape.draft_vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,  # SGLang would make lm_head the embedding
        "norm_before_residual": False,  # the residual stream carries h before hidden_norm
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if fmt == "vllm":
        config["eagle_aux_hidden_state_layer_ids"] = aux
        config["eagle_config"] = {"use_aux_hidden_state": True}
    else:
        config["eagle_config"] = {"use_aux_hidden_state": True,
                                  "eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]}
    return config


def shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, cut into groups of at most max_bytes (a larger tensor alone in its group)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    return groups


def write_weights(tensors: dict[str, torch.Tensor], out: Path) -> Exported:
    """One model.safetensors, or shards and their index when the tensors exceed MAX_SHARD_BYTES."""
    from safetensors.torch import save_file

    groups = shard(tensors, MAX_SHARD_BYTES)
    names = [WEIGHTS] if len(groups) == 1 else [SHARD.format(i + 1, len(groups)) for i in range(len(groups))]
    for name, group in zip(names, groups):  # (readable by the engine's user: `paths.write_atomically`)
        write_atomically(out / name, functools.partial(save_file, group, metadata={"format": "pt"}))
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {tensor: name for name, group in zip(names, groups) for tensor in group}}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    oversize = [name for name in names if (out / name).stat().st_size > FILE_LIMIT]
    return Exported(folder=out, files=names, oversize=oversize)


def serve_commands(target: str, folder: Path, fmt: str, draft_tokens: int = 3) -> str:
    """How to serve `target` with the exported head (`target`: the engine's name for the model)."""
    if fmt == "vllm":
        spec = json.dumps({"method": "eagle3", "model": str(folder), "num_speculative_tokens": draft_tokens})
        return f"vllm serve {target} --speculative-config '{spec}'"
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {folder} --speculative-num-steps {draft_tokens} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {draft_tokens + 1}")

