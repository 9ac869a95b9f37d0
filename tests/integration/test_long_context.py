"""The long-context benchmark category: its lengths, determinism, opt-in default, and the harness on a long
prompt (tiny models: one whose context holds it, one whose context does not)."""

from __future__ import annotations

import ast
import json
import re
import sys

import pytest

from conftest import TOKENS, tiny_qwen2, tiny_tokenizer
from specdecode.api import load_models
from specdecode.bench import report
from specdecode.bench.datasets import (
    CATEGORIES, DEFAULT_CATEGORIES, LONG_CONTEXT, LONG_LENGTHS, LONG_TASKS_PER_KIND, Task, estimated_tokens,
    long_context,
)
from specdecode.bench.samples import sample_tasks
from specdecode.bench.harness import run_benchmark
from specdecode.bench.runners import build_runners
from specdecode.engine import GenerationConfig

pytestmark = pytest.mark.usefixtures("one_thread")
TOLERANCE = 0.10  # a user turn's tokens within 10% of its nominal length
KINDS = ("documents", "digest", "module-edit", "module-summary")


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return long_context()


def _length(task: Task) -> str:
    return task.task_id.split("/")[1]


def test_the_category_has_every_length_and_kind(tasks):
    assert CATEGORIES[LONG_CONTEXT] is long_context
    assert len({t.task_id for t in tasks}) == len(tasks) == len(LONG_LENGTHS) * len(KINDS) * LONG_TASKS_PER_KIND
    for length in LONG_LENGTHS:
        for kind in KINDS:
            ids = [t.task_id for t in tasks if t.task_id.startswith(f"long/{length}/{kind}/")]
            assert len(ids) == LONG_TASKS_PER_KIND, (length, kind, ids)
    assert all(t.category == f"{LONG_CONTEXT}/{_length(t)}" and len(t.turns) == 1 for t in tasks)


def test_tasks_reach_their_nominal_lengths_by_estimate(tasks):
    for task in tasks:
        nominal = LONG_LENGTHS[_length(task)]
        assert abs(estimated_tokens(task.turns[0]) / nominal - 1) < TOLERANCE, task.task_id


def test_tasks_reach_their_nominal_lengths_in_qwen_tokens_and_fit_the_default_target(tasks):
    """With the default target's tokenizer (from the converted model's folder, when it is in the cache):
    each user turn within 10% of its nominal length, and the longest chat prompt plus the most new tokens
    the CLI allows (4096) within the target's context."""
    from transformers import AutoTokenizer

    from specdecode.models.loading import converted_dir
    from specdecode.models.registry import DEFAULT_TARGET, MODELS

    folder = converted_dir(MODELS[DEFAULT_TARGET])
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"the default target's tokenizer is not in {folder}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    context = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    longest = 0
    for task in tasks:
        nominal = LONG_LENGTHS[_length(task)]
        tokens = len(tokenizer(task.turns[0], add_special_tokens=False)["input_ids"])
        assert abs(tokens / nominal - 1) < TOLERANCE, (task.task_id, tokens)
        messages = [{"role": "user", "content": task.turns[0]}]
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        longest = max(longest, len(chat["input_ids"] if isinstance(chat, dict) else chat))
    assert longest + 4096 <= context, (longest, context)


def test_tasks_are_deterministic_and_sampled_per_length(tasks):
    assert long_context() == tasks
    sample = sample_tasks([LONG_CONTEXT], 2, seed=0)
    assert sample == sample_tasks([LONG_CONTEXT], 2, seed=0)
    assert sample != sample_tasks([LONG_CONTEXT], 2, seed=1)
    assert [_length(t) for t in sample] == [length for length in LONG_LENGTHS for _ in range(2)]
    assert len(sample_tasks([LONG_CONTEXT], None, part="all")) == len(tasks)


def test_one_length_can_be_named_and_a_wrong_one_is_a_user_error(tasks):
    from specdecode.errors import UserError

    sample = sample_tasks([f"{LONG_CONTEXT}/8k"], 2, seed=0)
    assert len(sample) == 2 and all(_length(t) == "8k" for t in sample)
    assert sample == [t for t in sample_tasks([LONG_CONTEXT], 2, seed=0) if _length(t) == "8k"]
    for wrong in (f"{LONG_CONTEXT}/3k", "code/8k", "novels"):
        with pytest.raises(UserError, match="unknown category"):
            sample_tasks([wrong], 1)


def test_module_tasks_hold_valid_python_and_name_a_function_it_defines(tasks):
    for task in tasks:
        if "/module-" not in task.task_id:
            continue
        code = re.search(r"```python\n(.*)```", task.turns[0], re.S).group(1)
        tree = ast.parse(code)  # whole statements only
        assert code.startswith(f"# {task.task_id.rsplit('/', 1)[1]}.py\n")
        if "/module-edit/" in task.task_id:
            name = re.match(r"Rename the function `(\w+)`", task.turns[0]).group(1)
            assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, task.task_id


def test_document_tasks_ask_about_one_of_their_documents(tasks):
    from specdecode.bench.datasets import _benchkit

    questions = {}
    for row in _benchkit("boolq"):
        questions.setdefault(row["question"], set()).add(row["passage"])
    for task in tasks:
        if "/documents/" in task.task_id:
            question = task.turns[0].rsplit("Question: ", 1)[1][:-1]
            assert any(passage in task.turns[0] for passage in questions[question]), task.task_id


def test_long_context_is_opt_in(monkeypatch):
    """Not among the bench's default categories; run when named."""
    from specdecode.bench import main as bench_main
    from specdecode.cli import main

    assert LONG_CONTEXT not in DEFAULT_CATEGORIES
    assert DEFAULT_CATEGORIES == ["multi-turn", "code", "code-edit", "math", "qa", "rag", "summarisation",
                                  "translation"]
    asked = []
    monkeypatch.setattr(bench_main, "run", lambda **kwargs: asked.append(kwargs["categories"]))
    for extra in ([], ["--categories", LONG_CONTEXT]):
        monkeypatch.setattr(sys, "argv", ["specdecode", "bench", *extra])
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert not exit_info.value.code
    assert asked == [DEFAULT_CATEGORIES, [LONG_CONTEXT]]


# --- the harness on a long prompt -------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_task(tasks) -> Task:
    """The shortest 4k task: about 16k tokens of the tiny byte-level tokenizer."""
    return min((t for t in tasks if _length(t) == "4k"), key=lambda t: len(t.turns[0]))


def test_the_harness_runs_a_long_task_on_a_model_whose_context_holds_it(long_task, tmp_path):
    folder = tmp_path / "tiny-long"
    model = tiny_qwen2(seed=0, layers=2, hidden=64, vocab=len(TOKENS) + 10, max_positions=32768)
    model.config.eos_token_id = model.generation_config.eos_token_id = TOKENS.index("<|im_end|>")
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    models = load_models(str(folder), None, dtype="float32", progress=False)
    runners = build_runners(models, ["pld"])
    short = Task("qa", "short/1", ("the cat",))
    records = run_benchmark(models, runners, [short, long_task], GenerationConfig(max_new_tokens=8), repeats=1)
    long_records = {r.method: r for r in records if r.task_id == long_task.task_id}
    assert all(r.ok for r in records), [r.error for r in records]
    assert len(long_records["ar"].prompt_ids[0]) > 8192  # long in the tiny tokenizer's tokens, too
    assert long_records["pld"].token_ids == long_records["ar"].token_ids and len(long_records["ar"].token_ids) == 8
    summaries = report.summarise(records, {"ar": True, "pld": True})
    assert LONG_CONTEXT in report.markdown(summaries, {}, [])


def test_a_prompt_longer_than_the_context_is_a_clear_failure(tiny_folder, long_task, tmp_path, capsys):
    """The tiny model holds 128 positions: the long task is recorded as failed for every method, with the
    reason and without a traceback, while the short task runs; the report lists it and keeps it out."""
    models = load_models(str(tiny_folder), None, dtype="float32", progress=False)
    runners = build_runners(models, ["pld", "hf-plain"])
    short = Task("qa", "short/1", ("the cat",))
    records = run_benchmark(models, runners, [short, long_task], GenerationConfig(max_new_tokens=8), repeats=1)
    failed = [r for r in records if not r.ok]
    assert {r.method for r in failed} == {"ar", "pld", "hf-plain"}
    assert all(r.task_id == long_task.task_id for r in failed)
    assert all(r.ok for r in records if r.task_id == "short/1")
    assert all(re.fullmatch(r"UserError: the prompt has \d+ tokens; with 8 new tokens it needs \d+ positions, "
                            r"but [\w-]+'s model holds 128", r.error) for r in failed), failed[0].error
    assert "Traceback" not in capsys.readouterr().err
    summaries = report.summarise(records, {"ar": True, "pld": True, "hf-plain": True})
    text = report.markdown(summaries, {}, [])
    assert re.search(rf"pld FAILED on {re.escape(long_task.task_id)} \(repeat \d+\): UserError", text)
    assert all(s.cells[report.OVERALL].runs == 1 and s.cells[report.OVERALL].failures == 1 for s in summaries)
    assert all(p.stat().st_size > 1000 for p in report.plots(summaries, tmp_path))
