"""The command line on a tiny local model folder: output, --json, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import TOKENS, tiny_chat_qwen2, tiny_tokenizer
from specdecode.cli import main
from specdecode.methods import METHODS


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["specdecode", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


def test_generate_json(monkeypatch, capsys, tiny_folder):
    code, out, _ = run(
        monkeypatch, capsys, "generate", "the cat", "--target", str(tiny_folder), "--method", "ar",
        "--json", "--max-new-tokens", "6", "--dtype", "float32",
    )
    assert code == 0
    result = json.loads(out)
    for key in ["text", "token_ids", "new_tokens", "seconds", "tokens_per_second", "target_forwards",
                "mean_accepted_tokens", "method"]:
        assert key in result
    assert result["method"] == "ar" and len(result["token_ids"]) == result["new_tokens"] <= 6
    assert result["target_forwards"] == result["new_tokens"]


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ar"])
def test_every_method_matches_ar_through_the_cli(monkeypatch, capsys, tiny_folder, method):
    common = ["--target", str(tiny_folder), "--drafter", str(tiny_folder), "--json", "--max-new-tokens", "12",
              "--dtype", "float32", "--chat"]
    _, plain, _ = run(monkeypatch, capsys, "generate", "the the the", "--method", "ar", *common)
    code, spec, _ = run(monkeypatch, capsys, "generate", "the the the", "--method", method, *common)
    assert code == 0 and json.loads(spec)["token_ids"] == json.loads(plain)["token_ids"]


def test_generate_human_output_streams_text_and_prints_table(monkeypatch, capsys, tiny_folder):
    code, out, err = run(monkeypatch, capsys, "generate", "the", "--target", str(tiny_folder), "--method", "pld",
                         "--max-new-tokens", "5")
    assert code == 0 and "tokens/s" in err + out


@pytest.fixture(scope="module")
def narrow_folder(tmp_path_factory):
    """Same tokenizer, different logits width: not a valid drafter for tiny_folder's model."""
    folder = tmp_path_factory.mktemp("narrow")
    tiny_chat_qwen2(vocab_size=len(TOKENS)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "", "--method", "ar"],
        ["generate", "   ", "--method", "ar"],
        ["generate", "x", "--method", "nope"],
        ["generate", "x", "--max-new-tokens", "-1"],
        ["generate", "x", "--max-new-tokens", "99999999999"],
        ["generate", "x", "--temperature", "-0.5"],
        ["generate", "x", "--top-p", "0"],
        ["generate", "x", "--top-k", "-3"],
        ["generate", "x", "--dtype", "float8"],
        ["generate", "the " * 200, "--method", "ar"],  # the tiny model holds 128 positions
        ["generate", "x", "--method", "draft", "--drafter", "NARROW"],
        ["generate", "x", "--target", "/no/such/folder"],
    ],
)
def test_bad_input_gives_one_line_error_and_exit_2(monkeypatch, capsys, tiny_folder, narrow_folder, args):
    args = [narrow_folder.as_posix() if a == "NARROW" else a for a in args]
    if "--target" not in args:
        args += ["--target", str(tiny_folder)]
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == 2, (out, err)
    assert "Traceback" not in err and err.strip(), err


def test_methods_lists_every_method(monkeypatch, capsys):
    code, out, _ = run(monkeypatch, capsys, "methods")
    assert code == 0 and all(name in out for name in METHODS)
