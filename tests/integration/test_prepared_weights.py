"""Prepared weights (`models.prepared`): an int8 or int4 model quantized once, stored, and loaded back at the
next start as the very model quantization gives, on tiny Qwen2 folders."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TOKENS, run_cli, tiny_chat_qwen2, tiny_tokenizer

from specdecode.models import digests, int4, int8, prepared
from specdecode.models.lean import lean_decoder
from specdecode.models.loading import load_causal_lm

pytestmark = pytest.mark.cpu_only

IDS = torch.tensor([[5, 70, 200, TOKENS.index("Ġthe"), 3, 9, 9, 120]])  # [1, 8]


@pytest.fixture(params=[8, 4], ids=["int8", "int4"])
def bits(request) -> int:
    if request.param == 4 and not int4.available():
        pytest.skip("this machine cannot run the int4 kernel")
    return request.param


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def folder(tiny_folder: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model folder this test may change."""
    return Path(shutil.copytree(tiny_folder, tmp_path / "model"))


def _entries() -> list[Path]:
    return sorted(prepared.root().iterdir()) if prepared.root().is_dir() else []


def _no_quantizing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make quantizing a linear layer fail: a load that passes took the prepared weights."""

    def refuse(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr(int8.InvariantInt8Linear, "from_linear", refuse)
    monkeypatch.setattr(int4.InvariantInt4Linear, "from_linear", refuse)


def _same_model(loaded, fresh) -> None:
    """Bit for bit the same model: structure, every tensor, configuration, and the logits of a forward."""
    assert repr(loaded) == repr(fresh)
    loaded_tensors, loaded_record = prepared._flatten(loaded)
    fresh_tensors, fresh_record = prepared._flatten(fresh)
    assert loaded_record == fresh_record
    assert loaded_tensors.keys() == fresh_tensors.keys()
    for name, tensor in fresh_tensors.items():
        assert loaded_tensors[name].dtype == tensor.dtype and torch.equal(loaded_tensors[name], tensor), name
    assert loaded.config.to_dict() == fresh.config.to_dict()
    assert loaded.generation_config.to_dict() == fresh.generation_config.to_dict()
    with torch.inference_mode():
        assert torch.equal(loaded(IDS).logits, fresh(IDS).logits)  # [1, 8, vocab]
    assert lean_decoder(fresh) is not None and lean_decoder(loaded) is not None  # decoding takes the lean path


def _quantized_from(model, folder: Path) -> None:
    """`model` gives the logits of `folder`'s weights as they are now, quantized afresh at int8."""
    from transformers import AutoModelForCausalLM

    reference = int8.quantize_invariant(AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa"))
    with torch.inference_mode():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_second_load_is_the_prepared_model_bit_for_bit(cache, folder, bits, monkeypatch) -> None:
    fresh, _ = load_causal_lm(str(folder), dtype=f"int{bits}", progress=False)
    (stored,) = _entries()
    assert stored.name.startswith(f"model-int{bits}-") and (stored / prepared.WEIGHTS).is_file()
    _no_quantizing(monkeypatch)
    loaded, tokenizer = load_causal_lm(str(folder), dtype=f"int{bits}", progress=False)
    _same_model(loaded, fresh)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert tokenizer.eos_token == "<|im_end|>"


def test_an_lm_head_tied_to_the_embeddings(cache, tmp_path, monkeypatch) -> None:
    """As in the Qwen2.5 models: the head is quantized apart from the embeddings, which stay float."""
    model = tiny_chat_qwen2(vocab_size=len(TOKENS) + 10, seed=3)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path / "tied")
    tiny_tokenizer().save_pretrained(tmp_path / "tied")
    fresh, _ = load_causal_lm(str(tmp_path / "tied"), dtype="int8", progress=False)
    _no_quantizing(monkeypatch)
    loaded, _ = load_causal_lm(str(tmp_path / "tied"), dtype="int8", progress=False)
    _same_model(loaded, fresh)


def test_a_changed_folder_is_prepared_again_and_the_old_entry_dropped(cache, folder) -> None:
    load_causal_lm(str(folder), dtype="int8", progress=False)
    (old,) = _entries()
    tiny_chat_qwen2(vocab_size=len(TOKENS) + 10, seed=7).save_pretrained(folder)  # other weights, same place
    changed, _ = load_causal_lm(str(folder), dtype="int8", progress=False)
    (new,) = _entries()
    assert new != old
    _quantized_from(changed, folder)


def test_weights_rewritten_with_the_same_size_and_time_are_prepared_again(cache, folder) -> None:
    """The key holds the files' contents, not their (size, modification time): other weights of the same shapes
    written over the old ones, their modification time set back, are quantized afresh."""
    load_causal_lm(str(folder), dtype="int8", progress=False)
    (old,) = _entries()
    before = {path: path.stat() for path in folder.iterdir()}
    tiny_chat_qwen2(vocab_size=len(TOKENS) + 10, seed=7).save_pretrained(folder)  # other weights, same shapes
    for path, stat in before.items():
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert {path: (path.stat().st_size, path.stat().st_mtime_ns) for path in folder.iterdir()} == {
        path: (stat.st_size, stat.st_mtime_ns) for path, stat in before.items()}
    changed, _ = load_causal_lm(str(folder), dtype="int8", progress=False)
    (new,) = _entries()
    assert new != old
    _quantized_from(changed, folder)


def test_a_changed_kernel_source_changes_the_key(folder, tmp_path, monkeypatch) -> None:
    """What the int4 kernel (and the attention kernel) make of the stored tensors is part of the key."""
    kernels = Path(shutil.copytree(int4.KERNEL_SOURCES, tmp_path / "kernels"))
    monkeypatch.setattr(int4, "KERNEL_SOURCES", kernels)
    before = prepared.entry(folder, 4)
    source = kernels / "int4.cpp"
    source.write_text(source.read_text() + "\n// another kernel\n")
    assert prepared.entry(folder, 4) != before


def test_a_files_digest_is_read_once_per_version(cache, folder, monkeypatch) -> None:
    """The digests are kept with each file's identity: a second key reads no file, a rewritten one is read again
    even with its size and modification time as they were (its status-change time moved)."""
    read: list[str] = []
    digest = digests.digest
    monkeypatch.setattr(digests, "digest", lambda path: read.append(path.name) or digest(path))
    first = prepared.key(folder, 8)
    assert sorted(read) == sorted(p.name for p in folder.iterdir() if p.is_file())
    read.clear()
    assert prepared.key(folder, 8) == first and read == []
    config = folder / "config.json"
    before = config.stat()
    config.write_bytes(config.read_bytes().replace(b"{", b" ", 1).replace(b"\n", b"{", 1))  # same size
    os.utime(config, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert config.stat().st_size == before.st_size
    assert prepared.key(folder, 8) != first and read == ["config.json"]


def test_an_unreadable_entry_is_prepared_again(cache, folder, capsys) -> None:
    fresh, _ = load_causal_lm(str(folder), dtype="int8", progress=False)
    (stored,) = _entries()
    weights = stored / prepared.WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a damaged disk, say
    again, _ = load_causal_lm(str(folder), dtype="int8", progress=False)
    assert "cannot be read" in capsys.readouterr().err
    _same_model(again, fresh)
    (restored,) = _entries()
    assert restored == stored and restored.joinpath(prepared.WEIGHTS).stat().st_size > weights.stat().st_size // 2


def test_a_cut_short_record_is_prepared_again(cache, folder, capsys) -> None:
    fresh, _ = load_causal_lm(str(folder), dtype="int8", progress=False)
    (stored,) = _entries()
    record = stored / prepared.RECORD
    record.write_bytes(record.read_bytes()[: record.stat().st_size // 2])
    again, _ = load_causal_lm(str(folder), dtype="int8", progress=False)
    assert "cannot be read" in capsys.readouterr().err
    _same_model(again, fresh)
    assert _entries() == [stored] and json.loads(record.read_text())["layers"]


def test_each_cpu_width_keeps_its_own_entry(cache, folder, monkeypatch) -> None:
    """A machine used at two widths (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU) prepares each once: switching
    back loads the first width's entry instead of quantizing again."""
    native = torch.backends.cpu.get_cpu_capability()
    other = "AVX2" if native != "AVX2" else "DEFAULT"
    load_causal_lm(str(folder), dtype="int8", progress=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    load_causal_lm(str(folder), dtype="int8", progress=False)
    assert len(_entries()) == 2 and any(other.lower() in entry.name for entry in _entries())
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: native)
    _no_quantizing(monkeypatch)
    load_causal_lm(str(folder), dtype="int8", progress=False)
    assert len(_entries()) == 2


def test_a_failed_write_leaves_no_entry_and_the_model_loads(cache, folder, monkeypatch, capsys) -> None:
    def half_then_fail(tensors, path):
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepared, "save_file", half_then_fail)
    model, _ = load_causal_lm(str(folder), dtype="int8", progress=False)
    assert "Could not store the prepared weights" in capsys.readouterr().err
    assert _entries() == []  # neither the entry nor its temporary
    assert model(IDS).logits.shape == (1, IDS.shape[1], len(TOKENS) + 10)


def test_a_dead_writers_temporary_is_removed_and_a_live_ones_kept(cache, folder) -> None:
    import subprocess
    import sys

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stem = prepared.entry(folder, 8).name.rsplit("-", 1)[0]  # model-int8-<CPU width>
    dead = prepared.root() / f".{stem}-0123.tmp-{finished.stdout.strip()}"
    live = prepared.root() / f".{stem}-0123.tmp-{os.getppid()}"  # pytest's parent: running
    for temporary in (dead, live):
        temporary.mkdir(parents=True)
        (temporary / prepared.WEIGHTS).write_bytes(b"cut short")
    load_causal_lm(str(folder), dtype="int8", progress=False)
    assert not dead.exists() and live.exists()


def test_first_preparation_shows_progress(cache, folder, capsys) -> None:
    load_causal_lm(str(folder), dtype="int8", progress=True)
    assert "Quantizing to int8" in capsys.readouterr().err


def test_float_and_drafter_int8_loads_store_nothing(cache, folder) -> None:
    load_causal_lm(str(folder), dtype="float32", progress=False)
    load_causal_lm(str(folder), dtype="int8", exact_int8=False, progress=False)  # torch.ao's dynamic int8
    assert _entries() == []


def test_models_clean_removes_the_prepared_weights(cache, folder, monkeypatch, capsys) -> None:
    load_causal_lm(str(folder), dtype="int8", progress=False)
    assert _entries()
    (cache / "models").mkdir()  # a converted model, kept without --all
    code, _, err = run_cli(monkeypatch, capsys, "models", "clean")
    assert code == 0 and "Removed the prepared weights" in err
    assert not prepared.root().exists() and (cache / "models").is_dir()
    code, _, _ = run_cli(monkeypatch, capsys, "models", "clean", "--all")
    assert code == 0 and not (cache / "models").exists()


@pytest.mark.slow
def test_default_draft_prepared_equals_a_fresh_quantization(tmp_path, monkeypatch) -> None:
    """A real model of the default pair at int4 where its kernel runs, else int8: quantized, stored in a temporary
    folder, loaded back, bit for bit. The draft model (tied embeddings, 24 layers): the target's architecture at a
    third of its size, so a third of the time to quantize afresh; the real-model tests load the target's prepared
    weights and check what they compute."""
    from specdecode.models.registry import DEFAULT_DRAFTER

    dtype = "int4" if int4.available() else "int8"
    monkeypatch.setattr(prepared, "root", lambda: tmp_path)
    fresh, tokenizer = load_causal_lm(DEFAULT_DRAFTER, dtype=dtype, progress=False)
    _no_quantizing(monkeypatch)
    loaded, _ = load_causal_lm(DEFAULT_DRAFTER, dtype=dtype, progress=False)
    ids = tokenizer("def fib(n):\n    if n < 2:", return_tensors="pt").input_ids  # [1, seq]
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, fresh(ids).logits)
    assert repr(loaded) == repr(fresh) and loaded.config.to_dict() == fresh.config.to_dict()
