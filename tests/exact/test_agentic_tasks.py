"""The benchmark's agentic category (`bench.agentic`): each task is an agent's request, its earlier calls and the
tools' answers, and its tools; the model's own chat template (Qwen2.5's) renders them, the conversation standing
after a tool's answer; the harness hands our runners that prompt."""

from __future__ import annotations

from conftest import QWEN25_TEMPLATE, tiny_tokenizer
from specdecode.api import Models
from specdecode.bench.base import Output, Runner
from specdecode.bench.datasets import CATEGORIES, DEFAULT_CATEGORIES
from specdecode.bench.harness import run_task
from specdecode.bench.samples import sample_tasks
from specdecode.engine import GenerationConfig


def test_the_category_stands_after_each_call_but_the_last_and_runs_only_when_named():
    tasks = sample_tasks(["agentic"], None, part="all")
    assert len(tasks) == 12 and len({t.task_id for t in tasks}) == 12
    for task in tasks:
        depth = int(task.task_id.rpartition("/")[2])
        assert len(task.history) == 2 * depth and task.tools and len(task.turns) == 1
        assert [m["role"] for m in task.history] == ["assistant", "tool"] * depth
        names = {tool["function"]["name"] for tool in task.tools}
        assert all(call["function"]["name"] in names for m in task.history for call in m.get("tool_calls", []))
    assert "agentic" in CATEGORIES and "agentic" not in DEFAULT_CATEGORIES


def test_the_template_renders_calls_answers_and_tools():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN25_TEMPLATE.read_text()
    task = next(t for t in sample_tasks(["agentic"], None, part="all") if t.task_id == "fix-median/3")
    text = tokenizer.apply_chat_template([{"role": "user", "content": task.turns[0]}, *task.history],
                                         tools=list(task.tools), add_generation_prompt=True, tokenize=False)
    assert text.count("<tool_call>") == 3 + 2 and text.count("<tool_response>") == 3  # (+2: the system prompt's)
    assert '"name": "write_file"' in text and text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_the_harness_encodes_the_history_with_the_tools():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN25_TEMPLATE.read_text()
    models = Models(target=type("Target", (), {"max_context": 100_000})(), tokenizer=tokenizer, draft=None)
    task = sample_tasks(["agentic"], None, part="all")[0]
    prompts = []

    def run(prompt_ids, config):
        prompts.append(prompt_ids)
        return Output(token_ids=[5], seconds=0.1, steps=[])

    record = run_task(models, Runner("pld", True, False, run), task, GenerationConfig(max_new_tokens=8), 0)
    assert record.ok and tokenizer.decode(prompts[0]).count("<tool_response>") == len(task.history) // 2


def test_a_template_that_renders_no_tools_is_a_recorded_failure():
    """The tiny tokenizer's own template takes no tools: it would drop them and every earlier call without a word, so
    the run is recorded as failed, naming why, and the runner never called."""
    tokenizer = tiny_tokenizer()
    models = Models(target=type("Target", (), {"max_context": 100_000})(), tokenizer=tokenizer, draft=None)
    task = sample_tasks(["agentic"], None, part="all")[0]
    called = []
    runner = Runner("pld", True, False, lambda ids, config: called.append(ids) or Output([5], 0.1, steps=[]))
    record = run_task(models, runner, task, GenerationConfig(max_new_tokens=8), 0)
    assert not record.ok and "renders no tools" in record.error and not called
