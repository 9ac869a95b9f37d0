"""The command line on a tiny local model folder: output, --json, and one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from conftest import TOKENS, tiny_chat_qwen2, tiny_tokenizer
from conftest import run_cli as run
from specdecode.methods import METHODS, resolve, variant_names


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
    assert result["tree_budget"] is None  # a chain


def cli_args(variant: str) -> list[str]:
    """`draft-tree-fixed` -> --method draft --tree --choices default."""
    base = resolve(variant)[0].name
    return ["--method", base] + (["--tree"] if "-tree" in variant else []) + (
        ["--choices", "default"] if variant.endswith("-fixed") else [])


@pytest.mark.parametrize("variant", [m for m in variant_names() if m != "ar" and not resolve(m)[0].trained])
def test_every_method_matches_ar_through_the_cli(monkeypatch, capsys, tiny_folder, variant):
    common = ["--target", str(tiny_folder), "--drafter", str(tiny_folder), "--json", "--max-new-tokens", "12",
              "--dtype", "float32", "--chat"]
    _, plain, _ = run(monkeypatch, capsys, "generate", "the the the", "--method", "ar", *common)
    code, spec, _ = run(monkeypatch, capsys, "generate", "the the the", *cli_args(variant), *common)
    result = json.loads(spec)
    assert code == 0 and result["token_ids"] == json.loads(plain)["token_ids"]
    assert result["method"] == variant
    expected_budget = None if "-tree" not in variant else "whole" if variant.endswith("-fixed") else "auto"
    assert result["tree_budget"] == expected_budget


def test_tree_budget_in_json(monkeypatch, capsys, tiny_folder):
    code, out, _ = run(monkeypatch, capsys, "generate", "the the the cat the", "--target", str(tiny_folder),
                       "--method", "pld", "--tree", "--budget", "3", "--json", "--max-new-tokens", "16",
                       "--dtype", "float32")
    result = json.loads(out)
    assert code == 0 and result["tree_budget"] == 3 and result["method"] == "pld-tree"
    assert result["mean_draft_tokens"] <= 3


def test_generate_human_output_streams_text_and_prints_table(monkeypatch, capsys, tiny_folder):
    code, out, err = run(monkeypatch, capsys, "generate", "the", "--target", str(tiny_folder), "--method", "pld",
                         "--max-new-tokens", "5")
    assert code == 0 and "tok/s" in err + out  # the table's column


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
        ["generate", "", "--method", "ar"],  # (blanks are a prompt, as the server takes them: an indentation)
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
        ["generate", "x", "--method", "ar", "--tree"],
        ["generate", "x", "--method", "pld", "--budget", "4"],
        ["generate", "x", "--method", "pld", "--tree", "--budget", "0"],
        ["generate", "x", "--method", "pld", "--tree", "--choices", "default"],
        ["generate", "x", "--method", "draft", "--tree", "--choices", "[[0], [0, 0, 1]]"],
        ["generate", "x", "--method", "draft", "--tree", "--choices", "zero"],
        ["generate", "x", "--method", "draft", "--tree", "--choices", "[[0], [1.5]]"],
        ["generate", "x", "--method", "draft", "--tree", "--choices", "[[0], [true]]"],
        ["generate", "x", "--method", "draft", "--tree", "--choices", "[[0], [300]]"],  # past the tiny vocabulary
        ["generate", "x", "--method", "draft", "--choices", "default"],
        ["bench", "--methods", "ar-tree"],
        ["bench", "--categories", ","],  # (it ran every default category)
        ["bench", "--methods", " , "],
        ["generate", "x", "--backend", "llamacpp", "--dtype", "int8"],
    ],
)
def test_bad_input_gives_one_line_error_and_exit_2(monkeypatch, capsys, tiny_folder, narrow_folder, args):
    args = [narrow_folder.as_posix() if a == "NARROW" else a for a in args]
    if "--target" not in args:
        args += ["--target", str(tiny_folder)]
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == 2, (out, err)
    assert "Traceback" not in err and err.strip(), err


def test_a_file_where_a_folder_goes_is_a_one_line_error_before_any_work(monkeypatch, capsys, tiny_folder, tmp_path):
    """The folders a command writes into are made first: a file in the way (or a folder where the datastore's file
    goes) is said in one line, exit 2, before the models load or the corpus is read."""
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello")
    for args in (["bench", "--methods", "ar", "--out", str(afile), "--target", str(tiny_folder)],
                 ["train", "medusa", "--data", str(tmp_path / "features"), "--out", str(afile),
                  "--target", str(tiny_folder)],
                 ["train", "medusa", "--data", str(afile), "--out", str(tmp_path / "heads"),
                  "--target", str(tiny_folder)],
                 ["datastore", "build", str(tmp_path / "corpus"), str(tmp_path), "--target", str(tiny_folder)]):
        code, out, err = run(monkeypatch, capsys, *args)
        assert code == 2 and "Traceback" not in err, (args, out, err)
        assert ("is a file" in err or "is a folder" in err) and err.strip().count("\n") == 0, err


def test_bench_quick_keeps_the_sizes_the_command_line_gives(monkeypatch, capsys):
    """--quick sets 1 prompt a category, 64 tokens and 1 repeat, but not over an option given with it."""
    from specdecode.bench import main

    asked = []
    monkeypatch.setattr(main, "run", lambda **kwargs: asked.append(kwargs))
    for extra, want in (([], (1, 64, 1)), (["--max-new-tokens", "8", "--repeats", "2"], (1, 8, 2)),
                        (["--per-category", "3"], (3, 64, 1))):
        code, out, err = run(monkeypatch, capsys, "bench", "--quick", "--methods", "ar", *extra)
        assert code == 0, err
        assert (asked[-1]["per_category"], asked[-1]["max_new_tokens"], asked[-1]["repeats"]) == want


def test_serve_says_what_is_wrong_before_the_models_load(monkeypatch, capsys, tmp_path):
    """A port another server holds, or a default method left out of --methods: one line, exit 2, and no model loaded
    (the target named does not exist: loading it would fail otherwise)."""
    import socket

    missing = str(tmp_path / "no-such-model")
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        code, out, err = run(monkeypatch, capsys, "serve", "--port", str(port), "--target", missing)
        assert code == 2 and f"127.0.0.1:{port}" in err and "--port" in err, err
    code, out, err = run(monkeypatch, capsys, "serve", "--methods", "pld,ar", "--method", "suffix", "--target", missing)
    assert code == 2 and "--method" in err and "'suffix'" in err, err


def test_export_without_a_head_for_a_target_none_ships_for(monkeypatch, capsys, tiny_folder, tmp_path):
    code, _, err = run(monkeypatch, capsys, "export", "eagle", str(tmp_path / "out"), "--format", "vllm",
                       "--target", str(tiny_folder))
    assert code == 2 and "no EAGLE-3 head ships for" in err and "--head" in err, err


def test_generate_says_when_the_context_cut_the_output_short(monkeypatch, capsys, tiny_folder):
    """The tiny model holds 128 positions: asked for more, the output stops there, and the command says so (on
    stderr: --json's output stays one object)."""
    code, out, err = run(monkeypatch, capsys, "generate", "the cat sat", "--method", "ar", "--max-new-tokens", "500",
                         "--json", "--target", str(tiny_folder))
    summary = json.loads(out)
    assert code == 0 and summary["new_tokens"] < 500 and summary["finish_reason"] == "length"
    assert "stopped at the model's context of 128 tokens" in err, err


def test_bench_refuses_a_reference_that_is_not_a_row_before_any_work(monkeypatch, capsys, tiny_folder, tmp_path):
    out = tmp_path / "run"
    code, _, err = run(monkeypatch, capsys, "bench", "--methods", "ar,pld", "--reference", "suffix", "--out", str(out),
                       "--target", str(tiny_folder))
    assert code == 2 and "'suffix' is not a row" in err and not out.exists(), err


def test_an_error_is_printed_whole_on_a_narrow_terminal(monkeypatch, capsys, tmp_path):
    """The message of a user's mistake goes out as one line, whatever the width, so that a path in it can be
    copied whole (the terminal wraps it; a log keeps it intact)."""
    missing = tmp_path / ("a-folder-with-a-name-longer-than-the-terminal-is-wide-" * 2)
    monkeypatch.setenv("COLUMNS", "40")
    code, _, err = run(monkeypatch, capsys, "generate", "x", "--target", str(missing))
    assert code == 2 and str(missing) in err, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [err.strip().splitlines()[-1]], err


def test_methods_lists_every_method(monkeypatch, capsys):
    code, out, _ = run(monkeypatch, capsys, "methods")
    assert code == 0 and all(name in out for name in METHODS)


def test_serve_starts_the_server_and_refuses_a_method_it_cannot_run(monkeypatch, capsys, tiny_folder):
    import uvicorn

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, log_level, **options: served.update(
        app=app, host=host, port=port))
    code, _, _ = run(monkeypatch, capsys, "serve", "--target", str(tiny_folder), "--no-drafter", "--dtype", "float32",
                     "--port", "8123")
    assert code == 0 and served["port"] == 8123 and served["host"] == "127.0.0.1"
    server = served["app"].state.server
    assert server.model_name == tiny_folder.name and "draft" not in server.methods() and "pld" in server.methods()
    server.worker.stop()
    code, _, err = run(monkeypatch, capsys, "serve", "--target", str(tiny_folder), "--no-drafter", "--method", "draft")
    assert code == 2 and "needs the draft model" in err


@pytest.mark.parametrize("method, kind", [("eagle", "eagle"), ("medusa", "medusa"), ("medusa-typical", "medusa")])
def test_a_trained_method_without_a_head_for_the_target_says_how_to_train_one(monkeypatch, capsys, tiny_folder,
                                                                              method, kind):
    """...and to pass it with --head, never to write it into the installed package."""
    code, _, err = run(monkeypatch, capsys, "generate", "the cat", "--target", str(tiny_folder), "--method", method,
                       "--dtype", "float32")
    err = " ".join(err.split())  # as rich wrapped it
    assert code == 2 and f"no {kind} head" in err and f"specdecode train {kind}" in err and "--head DIR" in err
    assert "specdecode/heads" not in err


def test_progress_reaches_a_log_once_a_minute():
    """Under `nohup ... > log` rich draws nothing until the end; our bar writes its line there every minute."""
    import io

    from rich.console import Console
    from rich.progress import MofNCompleteColumn, TextColumn

    from specdecode.progress import Progress

    now = [0.0]
    log = io.StringIO()
    with Progress(TextColumn("{task.description}"), MofNCompleteColumn(), console=Console(file=log, width=80),
                  clock=lambda: now[0]) as bar:
        task = bar.add_task("answers", total=10)
        bar.advance(task)
        assert log.getvalue() == ""  # not a minute yet
        now[0] = 61.0
        bar.advance(task)
        assert log.getvalue().split() == ["answers", "2/10"]
        now[0] = 90.0
        bar.update(task, completed=5)
        assert "5/10" not in log.getvalue()
        now[0] = 122.0
        bar.update(task, completed=6)
    lines = log.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["2/10", "6/10", "6/10"]  # the last is rich's own, at the end


def test_generate_under_a_constraint(monkeypatch, capsys, tiny_folder, tmp_path):
    """--json-schema, --regex and --grammar: the output is in the language, the same under speculation."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}},
                                  "required": ["n"], "additionalProperties": False}))
    grammar = tmp_path / "colours.lark"
    grammar.write_text('start: "the " colour\ncolour: "red" | "green"')
    common = ["--target", str(tiny_folder), "--drafter", str(tiny_folder), "--json", "--max-new-tokens", "30",
              "--dtype", "float32"]
    for constraint, valid in ((["--json-schema", str(schema)], lambda text: 0 <= json.loads(text)["n"] <= 99),
                              (["--regex", "(yes|no) [0-9]"], lambda text: text[:-1] in ("yes ", "no ")),
                              (["--grammar", str(grammar)], lambda text: text in ("the red", "the green"))):
        outputs = []
        for method in ("ar", "draft"):
            code, out, _ = run(monkeypatch, capsys, "generate", "the cat", "--method", method, *constraint, *common)
            result = json.loads(out)
            assert code == 0 and result["finish_reason"] == "eos" and valid(result["text"]), result["text"]
            outputs.append(result["token_ids"])
        assert outputs[0] == outputs[1]


@pytest.mark.parametrize("args, words", [
    (["--regex", "(open"], "unclosed group"),
    (["--json-schema", "SCHEMA"], "Invalid type"),
    (["--json-schema", "/no/such/schema.json"], "cannot read"),
    (["--grammar", "GRAMMAR"], "unknown name"),
    (["--regex", "a", "--grammar", "GRAMMAR"], "one constraint"),
    (["--regex", "[^\\s\\S]"], "empty"),
])
def test_a_bad_constraint_is_exit_2_with_the_engines_message(monkeypatch, capsys, tiny_folder, tmp_path, args, words):
    (tmp_path / "schema.json").write_text('{"type": "nope"}')
    (tmp_path / "bad.lark").write_text("start: missing")
    args = [str(tmp_path / "schema.json") if a == "SCHEMA" else str(tmp_path / "bad.lark") if a == "GRAMMAR" else a
            for a in args]
    code, out, err = run(monkeypatch, capsys, "generate", "the cat", "--method", "ar", "--target", str(tiny_folder),
                         "--dtype", "float32", *args)
    assert code == 2 and words in " ".join(err.split()) and "Traceback" not in err, err


def test_the_demo_leaves_out_the_head_methods_no_head_ships_for(tiny_folder):
    """`specdecode demo --target OTHER` ran every method and failed after loading on the first head method (no head
    ships for another target); it leaves them out now, and keeps them for the default target."""
    from specdecode.demo import DEMO_METHODS, HEAD_METHODS, demo_methods
    from specdecode.models.registry import DEFAULT_TARGET

    assert demo_methods(DEFAULT_TARGET) == DEMO_METHODS
    assert demo_methods(str(tiny_folder)) == [name for name in DEMO_METHODS if name not in HEAD_METHODS]


def test_the_demo_prints_prompts_and_answers_as_they_are(tiny_folder, monkeypatch, capsys):
    """The demo printed text through Rich's markup: `values[i:i + window]` in its own first prompt showed as
    `values`, `list[float]` in an answer as `list`, and a `[/b]` ended the run with a MarkupError."""
    from specdecode import demo
    from specdecode.engine import GenerationResult

    text = "def f(values: list[float]) -> list[float]: [b]bold[/b] [/] values[i:i + window]"
    monkeypatch.setattr(demo, "DEMO_PROMPTS", [text])
    monkeypatch.setattr(demo, "demo_methods", lambda target: ["ar", "pld"])
    generate = GenerationResult.__init__

    def bracketed(self, *args, **kwargs):  # every answer the same bracketed text
        generate(self, *args, **kwargs)
        if self.text:
            self.text = text
    monkeypatch.setattr(GenerationResult, "__init__", bracketed)
    monkeypatch.setenv("COLUMNS", "300")
    demo.run_demo(str(tiny_folder), str(tiny_folder), "float32", "float32", max_new_tokens=6)
    out = capsys.readouterr().out
    assert out.count(text) == 3  # the prompt, and each method's answer


def test_version(monkeypatch, capsys):
    from importlib.metadata import version

    code, out, _ = run(monkeypatch, capsys, "--version")
    assert code == 0 and out.strip() == f"specdecode {version('specdecode')}"


def test_methods_says_what_auto_loads_as_it_loads_it():
    """`specdecode methods` listed every shipped head and the draft model as auto's parts; auto drafts with one
    head on torch and loads the draft model only where no head drafts (`MethodChoice.loads_draft_model`)."""
    from specdecode.cli.generate import auto_here
    from specdecode.drafters.auto import shipped_kind
    from specdecode.methods import choose
    from specdecode.models.registry import DEFAULT_DRAFTER, DEFAULT_TARGET

    line = auto_here()
    kind = shipped_kind(DEFAULT_TARGET)
    assert kind is not None and not choose("auto").loads_draft_model(DEFAULT_TARGET)
    on_torch, on_llamacpp = line.split("; on llama.cpp, ")
    assert f"the {kind} head's tree" in on_torch and "the draft model is not loaded" in on_torch
    assert sum(other in on_torch for other in ("medusa", "eagle3")) == 1
    assert choose("auto").loads_draft_model(DEFAULT_TARGET, "llamacpp") and DEFAULT_DRAFTER in on_llamacpp
