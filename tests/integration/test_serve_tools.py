"""Tool calling on `specdecode serve`, with the official `openai` client, on a tiny model whose tokenizer has
Qwen2.5's own chat template (`conftest.tiny_tool_folder`): tools rendered by the template, calls read out of the
answer whole and streamed, `required` and named calls constrained so that their arguments validate against the
functions' schemas, and greedy calls the same whichever method speculates (a tiny random model calls nothing
of its own accord, so the calls are forced with `tool_choice`)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from specdecode.api import load_models
from specdecode.serve.app import Server, ServerThread, create_app

MODEL = "tiny-tools"
METHODS = ["ar", "pld", "draft", "draft-tree-fixed", "suffix"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two small numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def models(tiny_tool_folder):
    return load_models(str(tiny_tool_folder), str(tiny_tool_folder), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def client(models):
    running = ServerThread(create_app(Server(models, MODEL, default_method="ar", methods=METHODS)))
    yield openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)
    running.stop()


def ask(client, method: str = "ar", **kwargs):
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", ASK), temperature=0,
                                          max_tokens=kwargs.pop("max_tokens", 160), extra_body={"method": method},
                                          **kwargs)


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def calls_of(response) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, the arguments validated against the function's schema."""
    out = []
    for call in response.choices[0].message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        out.append((call.function.name, arguments))
    return out


def test_the_template_renders_the_tools(models):
    plain = models.encode_chat(ASK)
    with_tools = models.encode_chat(ASK, TOOLS)
    text = models.tokenizer.decode(with_tools)
    assert len(with_tools) > len(plain) + 100 and "<tools>" in text and '"get_weather"' in text


@pytest.mark.parametrize("method", METHODS)
def test_a_required_call_validates_and_speculation_calls_as_plain_decoding_does(client, method):
    response = ask(client, method, tools=TOOLS, tool_choice="required")
    assert response.choices[0].finish_reason == "tool_calls"
    calls = calls_of(response)
    assert calls and response.choices[0].message.content is None
    assert calls == calls_of(ask(client, "ar", tools=TOOLS, tool_choice="required"))


@pytest.mark.parametrize("parallel", [True, False])
def test_a_named_function_is_the_one_called(client, parallel):
    response = ask(client, "pld", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                   parallel_tool_calls=parallel)
    calls = calls_of(response)
    assert calls and {name for name, _ in calls} == {"add"}
    if not parallel:
        assert len(calls) == 1


def test_streamed_calls_are_the_whole_answers(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        whole = ask(client, "pld", tools=TOOLS, tool_choice=choice)
        chunks = list(ask(client, "pld", tools=TOOLS, tool_choice=choice, stream=True))
        calls: dict[int, dict] = {}
        for chunk in chunks:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == calls_of(whole)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_leaves_a_model_that_calls_nothing_answering_in_text(client):
    response = ask(client, "pld", tools=TOOLS, max_tokens=12)
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason in ("length", "stop")
    assert response.choices[0].message.content


def test_a_conversation_with_calls_and_their_results(client, models):
    """The assistant's earlier calls and the tools' answers go through the template, Qwen2.5's way."""
    first = ask(client, "ar", tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(),  # as the SDK dumps it: audio, annotations... null
                {"role": "tool", "tool_call_id": call.id, "content": '{"result": 5}'}]
    second = ask(client, "pld", messages=messages, tools=TOOLS, max_tokens=8)
    assert second.choices[0].message.content is not None
    rendered = models.tokenizer.decode(models.encode_chat(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "content": '{"result": 5}'}], TOOLS))
    assert "<tool_call>" in rendered and "<tool_response>" in rendered and rendered.endswith("assistant\n")


def test_tool_choice_none_and_a_missing_function(client):
    none = ask(client, "ar", tools=TOOLS, tool_choice="none", max_tokens=8)
    assert none.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="not among"):
        ask(client, "ar", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "sub"}})



def test_a_response_format_shapes_the_text_answer_not_the_calls(client):
    """As OpenAI's: with `required` the calls are made (the format is the later text answer's); with `auto` the
    answer is calls or JSON in the format (an agent with tools and an output type sends both)."""
    required = ask(client, "ar", tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert calls_of(required) and required.choices[0].finish_reason == "tool_calls"
    schema = {"type": "object", "properties": {"total": {"type": "integer"}}, "required": ["total"],
              "additionalProperties": False}
    said = []
    for method in ("ar", "pld", "suffix"):
        answer = ask(client, method, tools=TOOLS, response_format={
            "type": "json_schema", "json_schema": {"name": "sum", "schema": schema, "strict": True}})
        content = answer.choices[0].message.content
        assert calls_of(answer) or jsonschema.validate(json.loads(content), schema) is None
        said.append((content, calls_of(answer)))
    assert said[0] == said[1] == said[2]  # speculation changes nothing


def test_an_answer_cut_by_max_tokens_says_length_even_after_calls(client):
    """OpenAI's `finish_reason` is "length" for an answer `max_tokens` cut short, calls read before the cut or
    not: "tool_calls" would tell the client its calls are whole when the last may be missing. Under `required` no cut,
    even one before a call's arguments, leaves the call's beginning as content."""
    whole = ask(client, "ar", tools=TOOLS, tool_choice="required")
    assert whole.choices[0].finish_reason == "tool_calls"
    full = calls_of(whole)
    cuts = range(2, whole.usage.completion_tokens, 3)
    seen_calls = seen_cut = False
    for max_tokens in cuts:
        for stream in (False, True):
            if stream:
                chunks = list(ask(client, "pld", tools=TOOLS, tool_choice="required", max_tokens=max_tokens,
                                  stream=True))
                finish = chunks[-1].choices[0].finish_reason
                indices = {d.index for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []}
                count = len(indices)
                assert not any(c.choices[0].delta.content for c in chunks if c.choices), max_tokens
            else:
                cut = ask(client, "pld", tools=TOOLS, tool_choice="required", max_tokens=max_tokens)
                finish, calls = cut.choices[0].finish_reason, cut.choices[0].message.tool_calls or []
                count = len(calls)
                assert cut.choices[0].message.content is None, max_tokens
                whole_calls = [call for call in calls if parses(call.function.arguments)]
                assert calls[: len(whole_calls)] == whole_calls  # only the last may be cut short
                assert [(c.function.name, json.loads(c.function.arguments)) for c in whole_calls] == \
                    full[: len(whole_calls)]
                if len(whole_calls) < count:  # the cut call: its name and the arguments' text written so far
                    assert count == len(whole_calls) + 1 and calls[-1].function.name == full[count - 1][0]
                    assert cut.choices[0].message.content is None
                    seen_cut = True
            assert finish == "length", (max_tokens, stream)
            seen_calls = seen_calls or count > 0
    assert seen_calls  # some cut came after a whole call: the case that said "tool_calls"
    assert seen_cut  # and some inside a call's arguments


def test_tokenize_counts_the_tools_the_template_writes(client, models):
    url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    reply = httpx.post(url + "/tokenize", json={"messages": ASK, "tools": TOOLS}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == models.encode_chat(ASK, TOOLS) != models.encode_chat(ASK)
