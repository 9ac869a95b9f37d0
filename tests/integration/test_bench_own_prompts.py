"""`specdecode bench --prompts FILE`: a user's own prompts as tasks (`bench.own_prompts`), read strictly (a line
that is not a prompt is named), and run and reported as the benchmark's categories are; `--render DIR`: a run's
report written again from its folder (`bench.render`)."""

from __future__ import annotations

import json
import sys

import pytest

from specdecode.bench.own_prompts import read_prompts
from specdecode.errors import UserError


def write(path, lines: list) -> object:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n",
                    encoding="utf-8")
    return path


def test_a_jsonl_file_and_a_text_file_become_tasks(tmp_path):
    jsonl = write(tmp_path / "mine.jsonl", [{"prompt": "Write a haiku."}, "", {"id": "chat", "turns": ["Hi", "And?"]},
                                            {"prompt": "Résumé ✓", "category": "unicode", "id": 7}])
    tasks = read_prompts(jsonl)
    assert [(t.category, t.task_id, t.turns) for t in tasks] == [
        ("own", "1", ("Write a haiku.",)), ("own", "chat", ("Hi", "And?")), ("unicode", "7", ("Résumé ✓",))]
    text = write(tmp_path / "mine.txt", ["first prompt", "   ", "second {prompt}"])
    assert [(t.category, t.task_id, t.turns) for t in read_prompts(text)] == [
        ("own", "1", ("first prompt",)), ("own", "3", ("second {prompt}",))]


@pytest.mark.parametrize("lines, says", [
    ([], "holds no prompt"),
    (["", "  "], "holds no prompt"),
    (["{oops"], "line 1: not a JSON object"),
    (["[1, 2]"], "line 1: not a JSON object"),
    ([{"prompt": "a"}, {"promt": "b"}], "line 2: unknown field 'promt'"),
    ([{"prompt": "a", "turns": ["b"]}], "a prompt or turns"),
    ([{"prompt": " "}], "not blank"),
    ([{"turns": []}], "not blank"),
    ([{"prompt": "a", "category": "code"}], "not one of the benchmark's"),
    ([{"prompt": "a", "category": "overall"}], "the report's column of every prompt"),
    ([{"prompt": "a", "id": "x"}, {"prompt": "b", "id": "x"}], "the id 'x' comes twice"),
    ([{"prompt": "a", "id": True}], "an id is a text or a whole number"),
])
def test_what_is_not_a_prompt_is_named(tmp_path, lines, says):
    with pytest.raises(UserError, match=says):
        read_prompts(write(tmp_path / "mine.jsonl", lines))


def test_json_lines_by_any_of_their_names_and_with_a_byte_order_mark(tmp_path):
    for name in ("a.ndjson", "b.JSONL"):
        assert read_prompts(write(tmp_path / name, [{"prompt": "hi"}]))[0].turns == ("hi",)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "hi"}).encode())
    assert read_prompts(tmp_path / "bom.jsonl")[0].turns == ("hi",)
    with pytest.raises(UserError, match="give JSON Lines"):  # (its lines were read as text prompts)
        read_prompts(write(tmp_path / "c.json", [{"prompt": "hi"}]))


def test_a_missing_or_binary_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        read_prompts(tmp_path / "nowhere.jsonl")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserError, match="cannot be read as UTF-8"):
        read_prompts(tmp_path / "binary.txt")


def test_the_command_line_runs_and_reports_them(tiny_folder, tmp_path, monkeypatch, capsys):
    from specdecode.cli import main

    prompts = write(tmp_path / "mine.jsonl", [{"prompt": "the cat sat"}, {"id": "two", "turns": ["hello", "again"]}])

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["specdecode", "bench", "--target", str(tiny_folder), "--drafter",
                                          str(tiny_folder), "--dtype", "float32", "--draft-dtype", "float32",
                                          "--repeats", "1", "--max-new-tokens", "6", "--threads", "1", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        out, err = capsys.readouterr()
        return exit_info.value.code or 0, (out + err).replace("\n", "")

    code, out = run("--methods", "ar,pld", "--prompts", str(prompts), "--out", str(tmp_path / "run"))
    assert code == 0, out
    records = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    assert sorted((r["method"], r["task_id"]) for r in records) == [
        ("ar", "1"), ("ar", "two"), ("pld", "1"), ("pld", "two")]
    assert all(r["category"] == "own" for r in records)
    report = (tmp_path / "run" / "report.md").read_text()
    assert f"--prompts {prompts}" in report and "own: 2" in report and "--categories" not in report
    code, out = run("--prompts", str(tmp_path / "nowhere.jsonl"), "--out", str(tmp_path / "refused"))
    assert code == 2 and "no such file" in out and "Traceback" not in out

    # --render: the report written again from the folder, the same; from the records alone (a run stopped with
    # Ctrl-C writes no report, nor what its rows were), with a note saying what it lacks
    (tmp_path / "run" / "report.md").rename(tmp_path / "first.md")
    code, out = run("--render", str(tmp_path / "run"))
    assert code == 0, out
    assert (tmp_path / "run" / "report.md").read_text() == (tmp_path / "first.md").read_text()
    for name in ("report.md", "settings.json", "outcome.json"):
        (tmp_path / "run" / name).unlink()
    code, out = run("--render", str(tmp_path / "run"))
    again = (tmp_path / "run" / "report.md").read_text()
    assert code == 0 and "a run stopped before its end" in again and "| pld |" in again, out
    code, out = run("--render", str(tmp_path / "refused"))
    assert code == 2 and "no records.jsonl there" in out
