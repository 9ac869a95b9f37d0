"""Caches that never break a start: every cache file is written whole or not at all (`paths.write_atomically`),
and one found unreadable (cut short, damaged) is moved aside as `*.broken` with a one-line warning and made
again (`paths.set_aside`). Each kind of cache file is cut short here and the function or command that reads
it run again. (The cost curve's own cases: tests/exact/test_budget.py; a damaged prepared-weights entry:
tests/integration/test_prepared_weights.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conftest import run_cli, tiny_qwen2, tiny_tokenizer
from specdecode import paths
from specdecode.drafters.retrieval import build
from specdecode.drafters.self_speculative.drafter import calibration_prompts
from specdecode.drafters.self_speculative.search import search_exit
from specdecode.models import costs, dtype_choice, precision
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")


def cut_short(path: Path) -> bytes:
    """Cut `path` to half its bytes, as a kill or a full disk mid-write would have left a plain write."""
    content = path.read_bytes()[: max(1, path.stat().st_size // 2)]
    path.write_bytes(content)
    return content


def assert_set_aside(path: Path, content: bytes, caplog) -> None:
    """`path` was moved aside as `*.broken` (its content kept), with one warning naming both."""
    aside = path.with_name(path.name + ".broken")
    assert aside.read_bytes() == content
    [record] = [r for r in caplog.records if r.name == "specdecode.cache"]
    assert record.levelno == logging.WARNING and str(path) in record.getMessage() and str(aside) in record.getMessage()
    assert "\n" not in record.getMessage()


# --- The helper ---------------------------------------------------------------------------------------


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "cache" / "file.json"
    paths.write_atomically(path, '{"old": 1}')

    def fails_midway(temporary: Path) -> None:
        temporary.write_text('{"new": ')
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        paths.write_atomically(path, fails_midway)
    assert json.loads(path.read_text()) == {"old": 1}
    assert [p.name for p in path.parent.iterdir()] == ["file.json"]
    paths.write_atomically(path, b'{"new": 2}')
    assert json.loads(path.read_text()) == {"new": 2}


# --- Each kind of cache file ----------------------------------------------------------------------------


def test_a_cut_short_dtype_choice_is_timed_again(monkeypatch, tmp_path, caplog):
    """`costs/precision3-*.json`: `--dtype auto` (and so `specdecode serve`) times the paths again."""
    monkeypatch.setattr(costs, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(dtype_choice, "cache_dir", lambda: tmp_path)
    whole = {"int8": (0.14, 0.20), "int4": (0.10, 0.17)}  # seconds of one- and eight-token forwards
    monkeypatch.setattr(precision, "measure_paths", lambda hidden, intermediate: whole)
    monkeypatch.setattr(precision, "time_forwards", lambda model: whole[model])
    loaded: list[str] = []
    assert precision.fastest("models/tiny", 64, 128, lambda path: loaded.append(path) or path) == "int4"
    [path] = tmp_path.glob("precision3-*.json")
    content = cut_short(path)
    with caplog.at_level(logging.WARNING):
        assert precision.fastest("models/tiny", 64, 128, lambda path: loaded.append(path) or path) == "int4"
    assert loaded == ["int8", "int4"] * 2  # timed again
    assert json.loads(path.read_text())["choice"] == "int4"
    assert_set_aside(path, content, caplog)


def test_a_cut_short_record_of_dtype_choices_leaves_specdecode_methods_working(monkeypatch, capsys, tmp_path, caplog):
    """`dtype-auto.json`: `specdecode methods` lists the methods, and the next choice is recorded afresh."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    dtype_choice.remember("models/qwen2.5-coder-1.5b-instruct", "int4")
    path = tmp_path / dtype_choice.LATEST
    content = cut_short(path)
    with caplog.at_level(logging.WARNING):
        code, out, _ = run_cli(monkeypatch, capsys, "methods")
    assert code == 0 and "auto here" in out
    assert_set_aside(path, content, caplog)
    dtype_choice.remember("models/tiny", "int8")
    assert json.loads(path.read_text()) == {"tiny": "int8"}


def test_a_cut_short_layer_search_is_searched_again(tmp_path, caplog):
    target = HFCausalLM(tiny_qwen2(seed=5, layers=2))
    prompts = calibration_prompts(None, target.vocab_size, count=2, length=8)
    options = dict(budget_seconds=60, continuation=4, curve=CostCurve.linear(0.05), folder=tmp_path, progress=False)
    first = search_exit(target, prompts, **options)
    [path] = tmp_path.glob("*.json")
    content = cut_short(path)
    with caplog.at_level(logging.WARNING):
        again = search_exit(target, prompts, **options)
    assert not again.from_cache and again.best == first.best
    assert search_exit(target, prompts, **options).from_cache  # the new result, cached
    assert_set_aside(path, content, caplog)


def test_a_cut_short_default_datastore_is_built_again(caplog):
    """The standard-library datastore (built, in tests, from one package: conftest's `small_default_datastore`)."""
    tokenizer = tiny_tokenizer()
    path = build.default_datastore(tokenizer, progress=False)
    content = cut_short(path)
    with caplog.at_level(logging.WARNING):
        assert build.default_datastore(tokenizer, progress=False) == path
    assert path.stat().st_size > len(content)
    assert_set_aside(path, content, caplog)


def test_a_cache_folder_that_is_a_file_is_a_user_error(tmp_path, monkeypatch):
    """Said once, in one line (was: a store's warning, then an error blaming the model being loaded)."""
    from specdecode.errors import UserError
    from specdecode.paths import cache_dir

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "afile"))
    with pytest.raises(UserError, match="is a file"):
        cache_dir()
