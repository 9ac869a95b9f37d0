"""The clients agents and evaluation harnesses run, against `specdecode serve`: the OpenAI Agents SDK running an agent
with two function tools to its final answer, LangChain's `ChatOpenAI(...).bind_tools`, instructor extracting a pydantic
model, and lm-evaluation-harness's `local-completions` on a log-likelihood task and a generation task read from local
files (no hub: HF_HUB_OFFLINE, a local tokenizer). Each runs under plain decoding (`ar`) and under `auto`, greedily, and
gets the same answer, calls and scores from both; lm-eval's also with `batch_size` 4 (a batch of prompts a request).

On a tiny random model (`conftest.tiny_tool_folder`: Qwen2.5's chat template) nothing calls a tool of its own accord,
so the calls are forced (`tool_choice` required or a named function, which the grammar engine enforces) and the tools'
arguments bounded (a random model would write an unbounded integer until max_tokens); the loop still runs end to end.
The agent runs on the real pair too (`test_real_models.py`, beside the pair's other tests: one load)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field

from conftest import TOOL_MODEL as MODEL
METHODS = ["ar", "auto"]
SMALL = Annotated[int, Field(ge=0, le=99)]


@pytest.fixture(scope="module")
def folder(tiny_tool_folder):
    return tiny_tool_folder


@pytest.fixture(scope="module")
def servers(tool_servers):
    """One server per method (METHODS), each its default: {method: base URL ending in /v1}."""
    assert set(tool_servers) == set(METHODS)
    return tool_servers


class Final(BaseModel):
    """An agent's last answer in a form whose grammar ends it (`run_agent`'s `shaped`)."""

    total: SMALL
    city: Literal["Paris", "Oslo", "Rome"]


def run_agent(url: str, model: str, turns: int = 4, max_tokens: int = 120, responses: bool = False,
              shaped: bool = False, streamed: bool = False) -> tuple[Any, list[tuple]]:
    """The Agents SDK's loop with two function tools: the model must call at least one (`required`), the tool runs,
    its result goes back, and the next turn (the SDK resets the choice to auto) answers in text. `responses`: through
    the SDK's default model class, `OpenAIResponsesModel` (/v1/responses), instead of `OpenAIChatCompletionsModel`.
    `shaped`: once a tool has run, no tool may be called and the answer is a `Final`: the SDK refuses a Response that
    `max_output_tokens` cut short (`incomplete`), as a random model's free text always is, where a schema's grammar
    ends the answer. `streamed`: the SDK's streamed run (`Runner.run_streamed`), its events read to the end."""
    import asyncio

    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunHooks, Runner,
                        function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    called: list[tuple] = []

    class ToAnswer(RunHooks):
        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    @function_tool
    def add(a: SMALL, b: SMALL) -> int:
        """Add two numbers."""
        called.append(("add", a, b))
        return a + b

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Rome"]) -> str:
        """The weather in a city."""
        called.append(("get_weather", city))
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    agent = Agent(name="helper", instructions="Answer with the tools.", tools=[add, get_weather],
                  model=kind(model=model, openai_client=client), output_type=Final if shaped else None,
                  reset_tool_choice=not shaped,  # (shaped: `ToAnswer` sets it)
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=max_tokens))
    question, hooks = "What is 2 + 3, and what is the weather in Paris?", ToAnswer() if shaped else None
    if not streamed:
        return Runner.run_sync(agent, question, max_turns=turns, hooks=hooks).final_output, called

    async def run() -> Any:
        result = Runner.run_streamed(agent, question, max_turns=turns, hooks=hooks)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds  # (the model's own stream, not one event at the end)
        return result.final_output

    return asyncio.run(run()), called


def test_an_agent_runs_to_its_final_answer_the_same_under_auto(servers):
    answers = {method: run_agent(url, MODEL) for method, url in servers.items()}
    final, called = answers["ar"]
    assert called and all(name in ("add", "get_weather") for name, *_ in called)
    assert isinstance(final, str) and final
    assert answers["auto"] == answers["ar"]


def langchain_call(url: str, model: str) -> list[dict]:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def multiply(a: SMALL, b: SMALL) -> int:
        """Multiply two numbers."""
        return a * b

    llm = ChatOpenAI(base_url=url, api_key="none", model=model, temperature=0, max_tokens=120, max_retries=0)
    message = llm.bind_tools([multiply], tool_choice="multiply").invoke("What is 3 times 4?")
    return [{"name": call["name"], "args": call["args"]} for call in message.tool_calls]


def test_langchain_bind_tools(servers):
    calls = {method: langchain_call(url, MODEL) for method, url in servers.items()}
    assert calls["ar"] and calls["ar"][0]["name"] == "multiply"
    args = calls["ar"][0]["args"]  # (LangChain's schema allows other keys: a random model may write one)
    assert 0 <= args["a"] <= 99 and 0 <= args["b"] <= 99
    assert calls["auto"] == calls["ar"]


class City(BaseModel):
    name: Literal["Paris", "Oslo", "Rome"]
    country: Literal["France", "Norway", "Italy"]
    millions: SMALL


def instructor_extract(url: str, model: str) -> City:
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=url, api_key="none", max_retries=0), mode=instructor.Mode.TOOLS)
    return client.chat.completions.create(model=model, response_model=City, max_retries=0, temperature=0,
                                          max_tokens=120, messages=[{"role": "user", "content": "Paris, 2 million."}])


def test_instructor_extracts_a_pydantic_model(servers):
    cities = {method: instructor_extract(url, MODEL) for method, url in servers.items()}
    assert isinstance(cities["ar"], City)
    assert cities["auto"].model_dump() == cities["ar"].model_dump()  # (each keeps its own raw response)


CHOICES = [  # a small multiple-choice task, scored by log-likelihood
    {"question": "The cat sat on the", "choices": [" mat", " dog", " moon"], "answer": 0},
    {"question": "One, two,", "choices": [" three", " blue", " cat"], "answer": 0},
    {"question": "The sky is", "choices": [" green", " blue"], "answer": 1},
]
QUESTIONS = [{"question": "Q: 2 + 2 =", "answer": "4"}, {"question": "Q: the capital of France is", "answer": "Paris"}]


def write_tasks(folder) -> None:
    """Two lm-eval tasks read from local JSON lines files (`dataset_path: json`)."""
    for name, rows in (("choice", CHOICES), ("questions", QUESTIONS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\n"
    (folder / "tiny_choice.yaml").write_text(
        f"task: tiny_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "tiny_questions.yaml").write_text(
        f"task: tiny_questions\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'questions.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")


def lm_eval_scores(url: str, model: str, tokenizer: str, tasks_folder, batch_size: int = 1) -> tuple[dict, dict]:
    """(each task's metrics, each request's raw answers: log-likelihoods and generations) from `local-completions`,
    `batch_size` prompts a request."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{url}/completions", "model": model, "tokenizer": tokenizer,
                    "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1,
                    "max_retries": 1, "batch_size": batch_size},
        tasks=["tiny_choice", "tiny_questions"], task_manager=TaskManager(include_path=str(tasks_folder)),
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    assert results is not None
    metrics = {task: {k: v for k, v in values.items() if k != "alias"} for task, values in results["results"].items()}
    raw = {task: [sample["resps"] for sample in samples] for task, samples in results["samples"].items()}
    return metrics, raw


def answered(url: str) -> float:
    """The completions a server has answered (its /metrics)."""
    import httpx

    lines = httpx.get(url.removesuffix("/v1") + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith('specdecode_requests_total{endpoint="/v1/completions",status="200"}'))


def test_lm_eval_scores_equal_under_ar_and_auto(servers, folder, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_tasks(tmp_path)
    scores = {method: lm_eval_scores(url, MODEL, str(folder), tmp_path) for method, url in servers.items()}
    metrics, raw = scores["ar"]
    assert set(metrics) == {"tiny_choice", "tiny_questions"} and "acc,none" in metrics["tiny_choice"]
    assert len(raw["tiny_choice"]) == len(CHOICES) and len(raw["tiny_questions"]) == len(QUESTIONS)
    assert scores["auto"][0] == metrics
    for ours, theirs in zip(raw["tiny_choice"], scores["auto"][1]["tiny_choice"]):  # each choice's log-likelihood
        assert [float(x[0][0]) for x in ours] == pytest.approx([float(x[0][0]) for x in theirs], abs=1e-4)
    assert scores["auto"][1]["tiny_questions"] == raw["tiny_questions"]
    # lm-eval's batch_size: several prompts a request (a batch of prompts), scored as one a request scores them
    before = answered(servers["auto"])
    batched = lm_eval_scores(servers["auto"], MODEL, str(folder), tmp_path, batch_size=4)
    prompts = sum(len(c["choices"]) for c in CHOICES) + len(QUESTIONS)
    assert answered(servers["auto"]) - before < prompts / 2  # batches of prompts were sent
    assert batched[0] == metrics
    for ours, theirs in zip(raw["tiny_choice"], batched[1]["tiny_choice"]):
        assert [float(x[0][0]) for x in ours] == pytest.approx([float(x[0][0]) for x in theirs], abs=1e-4)
    assert batched[1]["tiny_questions"] == raw["tiny_questions"]
