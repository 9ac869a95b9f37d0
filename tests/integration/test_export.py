"""`specdecode export eagle`: the folder a tiny random EAGLE-3 head exports to, checked against what vLLM's
and SGLang's EAGLE-3 loaders do with it (their renaming rules, the parameters they own, the config fields
they read), plus shards under the size limit and the command line's one-line errors.

The engines' facts are vendored below as data, each with the file it was read from (vLLM and SGLang main
branches); the loaders themselves are not installed here (they need GPUs).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import run_cli as run
from specdecode.drafters import eagle3_head
from specdecode.training import export
from specdecode.training.export import export_eagle3

# --- vendored facts ---------------------------------------------------------------------------------

# Both register the one-layer Llama EAGLE-3 draft under this architecture name:
# vllm-project/vllm vllm/model_executor/models/registry.py ("LlamaForCausalLMEagle3" -> llama_eagle3);
# sgl-project/sglang python/sglang/srt/models/llama_eagle3.py (EntryClass = [LlamaForCausalLMEagle3]).
ARCHITECTURE = "LlamaForCausalLMEagle3"

# vllm-project/vllm vllm/model_executor/models/llama_eagle3.py: the parameters of Eagle3LlamaForCausalLM
# with num_hidden_layers = 1 (LlamaModel builds `layers`, q/k/v fused into qkv_proj, gate/up into
# gate_up_proj). embed_tokens is skipped when the checkpoint has none, then shared with the target
# (vllm/v1/spec_decode/llm_base_proposer.py, formerly eagle.py: `has_own_embed_tokens`).
VLLM_PARAMS = {
    "model.fc.weight", "model.norm.weight", "model.layers.0.hidden_norm.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
    "lm_head.weight", "draft_id_to_target_id",
}
VLLM_OPTIONAL = {"model.embed_tokens.weight"}

# sgl-project/sglang python/sglang/srt/models/llama_eagle3.py: the parameters of LlamaForCausalLMEagle3
# (LlamaModel keeps the layer as `midlayer`). embed_tokens is replaced by the target's
# (python/sglang/srt/speculative/eagle_worker.py: `set_embed`); a name it cannot place is dropped silently.
SGLANG_PARAMS = {
    "model.fc.weight", "model.norm.weight", "model.midlayer.hidden_norm.weight",
    "model.midlayer.input_layernorm.weight", "model.midlayer.post_attention_layernorm.weight",
    "model.midlayer.self_attn.qkv_proj.weight", "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.mlp.gate_up_proj.weight", "model.midlayer.mlp.down_proj.weight", "lm_head.weight",
}
SGLANG_OPTIONAL = {"model.embed_tokens.weight"}

# Both loaders fuse these checkpoint names into one parameter (same files as above).
STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))


def vllm_name(name: str) -> str | None:
    """Eagle3LlamaForCausalLM.load_weights, then LlamaModel.load_weights (vllm llama_eagle3.py): t2d
    dropped, d2t renamed, "model." before every name without "lm_head", "midlayer." -> "layers.0."."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    if "lm_head" not in name:
        name = "model." + name.replace("midlayer.", "layers.0.")
    for part, fused in STACKED:
        name = name.replace(part, fused)
    return name


def sglang_name(name: str) -> str | None:
    """LlamaForCausalLMEagle3.load_weights (sglang llama_eagle3.py): d2t becomes hot_token_id = d2t +
    arange, t2d dropped, the name as is if a parameter has it, else "model." + name."""
    if "d2t" in name or "t2d" in name:
        return None
    for part, fused in STACKED:
        name = name.replace(part, fused)
    return name if name in SGLANG_PARAMS | SGLANG_OPTIONAL else "model." + name


# config.json fields each engine reads for an EAGLE-3 draft, and the value ours must hold.
# vllm llama_eagle3.py: hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, rms_norm_eps,
#   hidden_act, max_position_embeddings, num_hidden_layers (one decoder layer each), vocab_size (the
#   embedding and the width logits are scattered to), draft_vocab_size (lm_head rows), target_hidden_size
#   (fc input / 3), attention_bias, norm_before_residual, eagle_config.use_aux_hidden_state (default true);
# vllm vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py: eagle_aux_hidden_state_layer_ids at the top
#   level, captured as the input of those layers (interfaces.py EagleModelMixin._maybe_add_hidden_state);
# vllm vllm/transformers_utils/configs/eagle.py: architectures (kept when it ends with "Eagle3").
VLLM_FIELDS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "hidden_act", "max_position_embeddings", "num_hidden_layers",
               "vocab_size", "draft_vocab_size", "target_hidden_size", "attention_bias", "norm_before_residual",
               "eagle_config", "eagle_aux_hidden_state_layer_ids")
# sglang llama_eagle3.py: hidden_size, intermediate_size, hidden_act, rms_norm_eps, num_hidden_layers (more
#   than 1 adds layers), vocab_size, draft_vocab_size (None: the target's full LM head), target_hidden_size,
#   tie_word_embeddings (true: lm_head *is* embed_tokens), model_type;
# sglang python/sglang/srt/model_executor/model_runner.py: eagle_config.eagle_aux_hidden_state_layer_ids,
#   passed to the target's set_eagle3_layers_to_capture, which captures layers [id + 1 for id in ids]
#   (python/sglang/srt/models/llama.py, qwen3.py, ...); eagle_config.use_aux_hidden_state (default true in
#   model_runner.py and speculative/eagle_worker.py, but false in some versions' get_draft_hidden_dim).
SGLANG_FIELDS = ("architectures", "model_type", "hidden_size", "intermediate_size", "hidden_act", "rms_norm_eps",
                 "num_hidden_layers", "vocab_size", "draft_vocab_size", "target_hidden_size", "tie_word_embeddings",
                 "eagle_config")

LIMIT = 40 * 10**6  # the repository keeps no file over 40 MB

# --- a tiny random head -----------------------------------------------------------------------------

D, TARGET_D, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 32, 48, 4, 2, 8, 40, 300, 24
AUX = (1, 3, 5)  # hidden_states indices of a 7-layer target (the input of layers 1, 3 and 5)


def head_config(**changes) -> dict:
    return {"hidden_size": D, "target_hidden_size": TARGET_D, "intermediate_size": INTER,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "max_position_embeddings": 4096, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
            "aux_layers": list(AUX)} | changes


def head_state(generator: torch.Generator, draft_vocab: int = DRAFT_VOCAB, inter: int = INTER) -> dict:
    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    draft_ids = torch.randperm(VOCAB, generator=generator)[:draft_vocab]  # not sorted: the exporter sorts
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    return {
        "fc.weight": rand(D, 3 * TARGET_D),
        "midlayer.hidden_norm.weight": rand(D), "midlayer.input_layernorm.weight": rand(D),
        "midlayer.post_attention_layernorm.weight": rand(D), "norm.weight": rand(D),
        "midlayer.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * D),
        "midlayer.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * D),
        "midlayer.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * D),
        "midlayer.self_attn.o_proj.weight": rand(D, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": rand(inter, D), "midlayer.mlp.up_proj.weight": rand(inter, D),
        "midlayer.mlp.down_proj.weight": rand(D, inter),
        "d2t": draft_ids - torch.arange(draft_vocab), "t2d": t2d,
    }


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture
def lm_head(generator) -> torch.Tensor:
    return torch.randn(VOCAB, D, generator=generator)  # the target's


def read_folder(folder) -> tuple[dict, dict[str, torch.Tensor], dict[str, str]]:
    """(config.json, every tensor, the file of each tensor)."""
    tensors, where = {}, {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert name not in tensors, f"{name} twice"
                tensors[name], where[name] = f.get_tensor(name), path.name
    return json.loads((folder / "config.json").read_text()), tensors, where


# --- the layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, rename, params, optional", [
    ("vllm", vllm_name, VLLM_PARAMS, VLLM_OPTIONAL),
    ("sglang", sglang_name, SGLANG_PARAMS, SGLANG_OPTIONAL),
])
@pytest.mark.parametrize("with_embed", [False, True])
def test_every_tensor_lands_on_an_engine_parameter_and_every_parameter_is_filled(
        tmp_path, generator, lm_head, fmt, rename, params, optional, with_embed):
    embed = torch.randn(VOCAB, D, generator=generator) if with_embed else None
    export_eagle3(head_state(generator), head_config(), lm_head, embed, tmp_path / "out", fmt)
    _, tensors, _ = read_folder(tmp_path / "out")
    loaded = {rename(name) for name in tensors} - {None}
    assert loaded - params - optional == set()  # nothing dropped or unplaceable
    assert params - loaded == set()  # nothing left at its initial value
    assert ("model.embed_tokens.weight" in loaded) == with_embed  # otherwise shared with the target


def test_shapes_dtypes_and_values(tmp_path, generator, lm_head):
    state = head_state(generator)
    export_eagle3(state, head_config(), lm_head, None, tmp_path / "out", "vllm")
    _, tensors, _ = read_folder(tmp_path / "out")
    # the fused layer's input is [embedding, hidden]: 2 * hidden; fc fuses 3 target states
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (HEADS * HEAD_DIM, 2 * D)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (KV_HEADS * HEAD_DIM, 2 * D)
    assert tensors["fc.weight"].shape == (D, 3 * TARGET_D)
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, D)
    assert tensors["d2t"].shape == (DRAFT_VOCAB,) and tensors["d2t"].dtype == torch.int64
    assert tensors["t2d"].shape == (VOCAB,) and tensors["t2d"].dtype == torch.bool
    for name, tensor in tensors.items():
        if name not in ("d2t", "t2d"):
            assert tensor.dtype == torch.bfloat16, name
    for name in export.HEAD_WEIGHTS:
        assert torch.equal(tensors[name], state[name].to(torch.bfloat16)), name


def test_d2t_names_the_lm_head_rows_in_ascending_order(tmp_path, generator, lm_head):
    state = head_state(generator)
    export_eagle3(state, head_config(), lm_head, None, tmp_path / "out", "sglang")
    _, tensors, _ = read_folder(tmp_path / "out")
    target_ids = torch.arange(DRAFT_VOCAB) + tensors["d2t"]  # what vLLM and SGLang (hot_token_id) compute
    assert bool((target_ids[1:] > target_ids[:-1]).all())
    assert set(target_ids.tolist()) == set((torch.arange(DRAFT_VOCAB) + state["d2t"]).tolist())
    assert torch.equal(torch.nonzero(tensors["t2d"]).flatten(), target_ids)  # t2d marks exactly those
    assert torch.equal(tensors["lm_head.weight"], lm_head[target_ids].to(torch.bfloat16))


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_config_holds_what_the_engine_reads(tmp_path, generator, lm_head, fmt):
    export_eagle3(head_state(generator), head_config(), lm_head, None, tmp_path / "out", fmt)
    config, _, _ = read_folder(tmp_path / "out")
    for field in VLLM_FIELDS if fmt == "vllm" else SGLANG_FIELDS:
        assert field in config, field
    assert config["architectures"] == [ARCHITECTURE] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["hidden_act"] == "silu"
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is False
    assert (config["hidden_size"], config["target_hidden_size"], config["intermediate_size"]) == (D, TARGET_D, INTER)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        HEADS, KV_HEADS, HEAD_DIM)
    assert (config["vocab_size"], config["draft_vocab_size"]) == (VOCAB, DRAFT_VOCAB)
    assert config["eagle_config"]["use_aux_hidden_state"] is True
    if fmt == "vllm":  # captured as the input of layer id
        assert config["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    else:  # SGLang captures the input of layer id + 1
        assert [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == list(AUX)
        assert "eagle_aux_hidden_state_layer_ids" not in config


def test_transformers_reads_the_config_as_a_llama_config(tmp_path, generator, lm_head):
    """Both engines start from transformers' AutoConfig."""
    from transformers import AutoConfig, LlamaConfig

    export_eagle3(head_state(generator), head_config(), lm_head, None, tmp_path / "out", "vllm")
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert isinstance(config, LlamaConfig)
    assert config.rope_parameters["rope_theta"] == 1e6 and config.num_hidden_layers == 1
    assert config.draft_vocab_size == DRAFT_VOCAB and config.eagle_aux_hidden_state_layer_ids == list(AUX)


def test_rope_parameters_are_read_like_rope_theta(tmp_path, generator, lm_head):
    config = head_config(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    del config["rope_theta"]
    export_eagle3(head_state(generator), config, lm_head, None, tmp_path / "out", "vllm")
    assert read_folder(tmp_path / "out")[0]["rope_theta"] == 5e5


# --- shards -----------------------------------------------------------------------------------------


def test_a_big_head_is_sharded_under_the_limit_with_an_index(tmp_path, generator, lm_head, monkeypatch):
    monkeypatch.setattr(export, "MAX_SHARD_BYTES", 20_000)  # the tiny head is ~60 kB in bfloat16
    exported = export_eagle3(head_state(generator, inter=200), head_config(intermediate_size=200), lm_head, None,
                             tmp_path / "out", "vllm")
    _, tensors, where = read_folder(tmp_path / "out")
    assert len(exported.files) >= 2 and exported.oversize == []
    assert not (tmp_path / "out" / export.WEIGHTS).exists()
    index = json.loads((tmp_path / "out" / export.INDEX).read_text())
    assert index["weight_map"] == where  # every tensor, in the file the index names
    assert set(index["weight_map"].values()) == set(exported.files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for path in (tmp_path / "out").iterdir():
        assert path.stat().st_size < LIMIT
        if path.suffix == ".safetensors":  # the limit on tensor data, plus a small header
            assert path.stat().st_size < 20_000 + 4096


def test_a_small_head_is_one_file_without_index(tmp_path, generator, lm_head):
    exported = export_eagle3(head_state(generator), head_config(), lm_head, None, tmp_path / "out", "sglang")
    assert exported.files == [export.WEIGHTS] and not (tmp_path / "out" / export.INDEX).exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", export.WEIGHTS]


def test_a_tensor_over_the_limit_gets_a_file_of_its_own_and_is_reported(tmp_path, generator, lm_head, monkeypatch):
    monkeypatch.setattr(export, "MAX_SHARD_BYTES", 4_000)  # fc is 32 x 144 x 2 bytes = 9 kB, the rest less
    monkeypatch.setattr(export, "FILE_LIMIT", 5_000)
    exported = export_eagle3(head_state(generator), head_config(), lm_head, None, tmp_path / "out", "vllm")
    _, _, where = read_folder(tmp_path / "out")
    assert [name for name, file in where.items() if file == where["fc.weight"]] == ["fc.weight"]
    assert exported.oversize == [where["fc.weight"]]


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    (lambda s, c: c.update(aux_layers=[1, 3]), "three increasing"),
    (lambda s, c: c.update(aux_layers=[5, 3, 1]), "three increasing"),
    (lambda s, c: s.update({"fc.weight": torch.zeros(D, 2 * TARGET_D)}), "fc.weight"),
    (lambda s, c: s.pop("norm.weight"), "missing"),
    (lambda s, c: s.update({"lm_head.weight": torch.zeros(DRAFT_VOCAB, D)}), "unexpected"),
    (lambda s, c: s.update(d2t=-torch.arange(DRAFT_VOCAB)), "twice"),  # every draft id -> token 0
    (lambda s, c: s.update(t2d=torch.ones(VOCAB, dtype=torch.bool)), "t2d"),
    (lambda s, c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "yarn"),
])
def test_an_inconsistent_head_is_refused(tmp_path, generator, lm_head, change, message):
    state, config = head_state(generator), head_config()
    change(state, config)
    with pytest.raises(ValueError, match=message):
        export_eagle3(state, config, lm_head, None, tmp_path / "out", "vllm")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_another_targets_lm_head_and_a_used_folder_are_refused(tmp_path, generator, lm_head):
    with pytest.raises(ValueError, match="head's target"):
        export_eagle3(head_state(generator), head_config(), lm_head[:, :-1], None, tmp_path / "a", "vllm")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")
    with pytest.raises(ValueError, match="not an empty folder"):
        export_eagle3(head_state(generator), head_config(), lm_head, None, tmp_path / "b", "vllm")


def test_serve_commands():
    vllm = export.serve_commands("Qwen/Qwen2.5-Coder-1.5B-Instruct", "out", "vllm", draft_tokens=4)
    spec = json.loads(vllm.split("--speculative-config ")[1].strip("'"))
    assert vllm.startswith("vllm serve Qwen/") and spec == {"method": "eagle3", "model": "out",
                                                            "num_speculative_tokens": 4}
    sglang = export.serve_commands("Qwen/Qwen2.5-Coder-1.5B-Instruct", "out", "sglang")
    assert "--speculative-algorithm EAGLE3" in sglang and "--speculative-draft-model-path out" in sglang


# --- the command line -------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--format", "tgi", "OUT"], "unknown format 'tgi'"),
    (["--format", "vllm", "--head", "/no/such/head", "OUT"], "no such folder"),
    (["--format", "vllm", "USED"], "not an empty folder"),
])
def test_cli_mistakes_give_one_line_and_exit_2(monkeypatch, capsys, tmp_path, args, message):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "config.json").write_text("{}")
    args = [str(tmp_path / "out") if a == "OUT" else str(tmp_path / "used") if a == "USED" else a for a in args]
    code, _, err = run(monkeypatch, capsys, "export", "eagle", *args)
    assert code == 2 and message in " ".join(err.split())  # rich wraps the one line at the terminal's width
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert not (tmp_path / "out").exists()


def test_cli_a_folder_without_a_head_says_so(monkeypatch, capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, err = run(monkeypatch, capsys, "export", "eagle", "--format", "sglang", "--head", str(tmp_path / "empty"),
                       str(tmp_path / "out"))
    assert code == 2 and "no EAGLE-3 head" in " ".join(err.split()) and err.count("error:") == 1, err
    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "eagle.json").write_text("{}")  # an EAGLE-1 head's record: the kind said, not "none"
    code, _, err = run(monkeypatch, capsys, "export", "eagle", "--format", "sglang", "--head", str(tmp_path / "eagle"),
                       str(tmp_path / "out"))
    assert code == 2 and "holds eagle heads" in " ".join(err.split()), err


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    """A tiny local Qwen2 target of 4 layers (a head's default aux layers: 0, 1, 2)."""
    from conftest import TOKENS, tiny_qwen2, tiny_tokenizer

    folder = tmp_path_factory.mktemp("target")
    tiny_qwen2(0, layers=4, vocab=len(TOKENS) + 10, max_positions=128).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_cli_exports_a_trained_head_for_its_target(monkeypatch, capsys, tmp_path, target_folder):
    """End to end on a tiny local target: the head class's own storage, the target's LM head rows."""
    target = AutoModelForCausalLM.from_pretrained(target_folder)
    config = eagle3_head.Eagle3Config.for_target(target.config, intermediate_size=16, draft_vocab_size=8)
    draft_ids = torch.tensor([9, 2, 30, 4, 5, 17, 11, 0])
    eagle3_head.Eagle3Head(config, draft_ids).save(tmp_path / "head", {})
    code, out, err = run(monkeypatch, capsys, "export", "eagle", "--format", "vllm", "--head", str(tmp_path / "head"),
                         "--target", str(target_folder), str(tmp_path / "out"))
    assert code == 0, err
    assert "Traceback" not in err
    assert out.startswith(f"vllm serve {target_folder} --speculative-config")
    exported, tensors, _ = read_folder(tmp_path / "out")
    assert exported["eagle_aux_hidden_state_layer_ids"] == list(config.aux_layers)
    rows = target.get_output_embeddings().weight[draft_ids.sort().values]
    assert torch.equal(tensors["lm_head.weight"], rows.to(torch.bfloat16))


def test_cli_refuses_a_head_reading_layers_its_target_lacks(monkeypatch, capsys, tmp_path, target_folder):
    target = AutoModelForCausalLM.from_pretrained(target_folder)
    config = eagle3_head.Eagle3Config.for_target(target.config, intermediate_size=16, draft_vocab_size=8)
    eagle3_head.Eagle3Head(replace(config, aux_layers=(1, 2, 9)), torch.arange(8)).save(tmp_path / "head", {})
    code, _, err = run(monkeypatch, capsys, "export", "eagle", "--format", "sglang", "--head", str(tmp_path / "head"),
                       "--target", str(target_folder), str(tmp_path / "out"))
    assert code == 2 and "has 4" in " ".join(err.split()) and err.count("error:") == 1, err
    assert not (tmp_path / "out").exists()


def test_cli_exports_a_head_for_the_target_its_record_names(monkeypatch, capsys, tmp_path, target_folder):
    """Without --target the head's own target (its record's); a --target that is another model is refused (its LM
    head rows would be baked in without a word where the shapes agree)."""
    target = AutoModelForCausalLM.from_pretrained(target_folder)
    config = eagle3_head.Eagle3Config.for_target(target.config, intermediate_size=16, draft_vocab_size=8)
    eagle3_head.Eagle3Head(config, torch.arange(8)).save(tmp_path / "head", {"target": str(target_folder)})
    code, out, err = run(monkeypatch, capsys, "export", "eagle", "--format", "vllm", "--head", str(tmp_path / "head"),
                         str(tmp_path / "out"))
    assert code == 0 and out.startswith(f"vllm serve {target_folder} "), err
    other = tmp_path / "other"
    shutil.copytree(target_folder, other)  # the same shapes, another model
    code, _, err = run(monkeypatch, capsys, "export", "eagle", "--format", "vllm", "--head", str(tmp_path / "head"),
                       "--target", str(other), str(tmp_path / "again"))
    assert code == 2 and "was trained for" in err and not (tmp_path / "again").exists(), err
