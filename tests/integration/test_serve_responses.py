"""OpenAI's Responses API (`/v1/responses`) against `specdecode serve`, through the openai client and the Agents SDK's
default model class, on the tiny tool model (`conftest.tool_servers`: Qwen2.5's chat template, a server per method):
the same answer as the chat endpoint's for the same conversation (text, usage, tool calls, log-probabilities),
under plain decoding (`ar`) and `auto` alike, greedily; streamed events in order that add up to the same Response; a
400 naming the field for each thing the endpoint refuses."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import OpenAI
from openai.types.responses import Response

from conftest import TOOL_MODEL as MODEL
from test_serve_clients import run_agent

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
ADD = {"type": "function", "name": "add", "description": "Add two numbers.", "strict": True,
       "parameters": {"type": "object", "properties": {"a": SMALL, "b": SMALL}, "required": ["a", "b"],
                      "additionalProperties": False}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
ANSWER = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "shade": SMALL},
          "required": ["colour", "shade"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "name": "colour", "schema": ANSWER, "strict": True}


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url, api_key="none", max_retries=0)


def without_ids(response: dict) -> dict:
    """A Response's output and usage, its items' ids left out (each response makes its own)."""
    items = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    return {"output": items, "usage": response["usage"], "status": response["status"]}


def test_a_text_answer_is_the_chat_endpoints(tool_servers):
    answers = {}
    for method, url in tool_servers.items():
        chat = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
        response = client(url).responses.create(model=MODEL, instructions="Be brief.", input="Name a colour.",
                                                temperature=0, max_output_tokens=24, metadata={"run": method})
        assert isinstance(response, Response) and response.output_text == chat.choices[0].message.content
        assert chat.usage is not None and response.usage is not None
        assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
            chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
        # a random model's text runs to the limit: incomplete, as OpenAI's
        assert chat.choices[0].finish_reason == "length" and response.status == "incomplete"
        assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
        assert response.metadata == {"run": method} and response.model_extra["speculative"]["method"] == method
        answers[method] = response.output_text
    assert answers["auto"] == answers["ar"]


def test_input_items_read_as_the_chat_messages(tool_servers):
    url = tool_servers["ar"]
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Name "}, {"type": "input_text",
                                                                                    "text": "a colour."}]}]
    body = httpx.post(url + "/responses", json={"model": MODEL, "input": items, "temperature": 0,
                                                "max_output_tokens": 12}, timeout=120).json()
    Response.model_validate(body)
    messages = [{"role": "developer", "content": "Be brief."}, MESSAGES[1]]
    developer = client(url).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    assert body["output"][0]["content"][0]["text"] == developer.choices[0].message.content


def streamed(url: str, **request) -> tuple[list, Response]:
    events = list(client(url).responses.create(model=MODEL, stream=True, **request))
    return events, events[-1].response


def check_order(events: list) -> None:
    """Sequence numbers count up from 0; created, in_progress first, a final event last; each item's events between
    its added and done, each part's between its added and done."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    open_items: set[int] = set()
    for event in events[2:-1]:
        if event.type == "response.output_item.added":
            open_items.add(event.output_index)
        elif event.type == "response.output_item.done":
            open_items.remove(event.output_index)
        else:
            assert event.output_index in open_items, event.type
    assert not open_items


def test_a_stream_adds_up_to_the_response(tool_servers):
    for url in tool_servers.values():
        request = {"input": MESSAGES, "temperature": 0, "max_output_tokens": 24}
        whole = client(url).responses.create(model=MODEL, **request)
        events, final = streamed(url, **request)
        check_order(events)
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert "".join(e.delta for e in deltas) == whole.output_text == final.output_text
        assert all(e.model_extra["specdecode"]["tokens"] for e in deltas)  # ours: the step's tokens
        assert without_ids(final.model_dump(exclude_none=True)) == without_ids(whole.model_dump(exclude_none=True))
        # the client's stream helper takes a completed response only: one a schema's grammar ends
        shaped = request | {"max_output_tokens": 64, "text": {"format": FORMAT}}
        whole = client(url).responses.create(model=MODEL, **shaped)
        with client(url).responses.stream(model=MODEL, **shaped) as stream:
            events = list(stream)
            final = stream.get_final_response()
        check_order(events)
        assert final.status == "completed" and final.output_text == whole.output_text
        assert without_ids(final.model_dump(exclude_none=True)) == without_ids(whole.model_dump(exclude_none=True))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_calls_and_their_outputs(tool_servers, choice):
    calls = {}
    for method, url in tool_servers.items():
        request = {"input": "What is the weather in Paris?", "tools": [ADD, WEATHER], "tool_choice": choice,
                   "temperature": 0, "max_output_tokens": 120}
        response = client(url).responses.create(model=MODEL, **request)
        made = [item for item in response.output if item.type == "function_call"]
        assert made and (choice == "required" or all(item.name == "get_weather" for item in made))
        for item in made:
            schema = {"add": ADD, "get_weather": WEATHER}[item.name]["parameters"]
            jsonschema.validate(json.loads(item.arguments), schema)
        chat = client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": request["input"]}], temperature=0, max_tokens=120,
            tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in request[
                "tools"]], tool_choice=choice if isinstance(choice, str) else {"type": "function", "function": {
                    "name": choice["name"]}})
        assert [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls or []] == [
            (item.name, item.arguments) for item in made]
        streamed_calls = [e.item for e in streamed(url, **request)[0] if e.type == "response.output_item.done"]
        assert [(item.name, item.arguments) for item in streamed_calls] == [(i.name, i.arguments) for i in made]
        # the next turn: the calls and their outputs as input items
        turn = [{"role": "user", "content": request["input"]}, *[item.model_dump() for item in made],
                *[{"type": "function_call_output", "call_id": item.call_id, "output": "sunny"} for item in made]]
        answer = client(url).responses.create(model=MODEL, input=turn, tools=[ADD, WEATHER], temperature=0,
                                              max_output_tokens=16)
        assert answer.status in ("completed", "incomplete") and answer.output
        calls[method] = ([(i.name, i.arguments) for i in made], answer.output_text)
    assert calls["auto"] == calls["ar"]


def test_a_call_cut_by_the_length_limit_is_an_incomplete_item(tool_servers):
    """A call cut inside its arguments is its item with the arguments written so far, status "incomplete" (a whole
    call before it "completed"), whole and streamed alike; the response is incomplete."""
    url = tool_servers["auto"]
    request = {"input": "What is the weather in Paris?", "tools": [ADD, WEATHER], "tool_choice": "required",
               "temperature": 0, "max_output_tokens": 120}
    whole = client(url).responses.create(model=MODEL, **request)
    seen = 0
    for limit in range(8, whole.usage.output_tokens, 4):
        cut = client(url).responses.create(model=MODEL, **request | {"max_output_tokens": limit})
        items = [item for item in cut.output if item.type == "function_call"]
        streamed_items = [e.item for e in streamed(url, **request | {"max_output_tokens": limit})[0]
                          if e.type == "response.output_item.done"]
        assert cut.status == "incomplete" and all(item.type == "function_call" for item in cut.output)
        assert [item.type for item in streamed_items] == [item.type for item in cut.output]  # (no empty message)
        for each in (items, streamed_items):
            for item in each:
                try:
                    json.loads(item.arguments)
                    assert item.status == "completed"
                except json.JSONDecodeError:
                    assert item.status == "incomplete" and item is each[-1]
                    seen += 1
    assert seen  # some limit fell inside a call's arguments


def test_the_agents_sdk_with_its_default_responses_model(tool_servers):
    answers = {method: run_agent(url, MODEL, responses=True, shaped=True) for method, url in tool_servers.items()}
    final, called = answers["ar"]
    assert called and all(name in ("add", "get_weather") for name, *_ in called)
    assert final.city in ("Paris", "Oslo", "Rome") and 0 <= final.total <= 99
    assert answers["auto"] == answers["ar"]
    assert run_agent(tool_servers["ar"], MODEL, shaped=True) == answers["ar"]  # the chat endpoint's, the same
    # the SDK's streamed run reads the Responses events as they come, and ends with the same calls and answer
    assert run_agent(tool_servers["auto"], MODEL, responses=True, shaped=True, streamed=True) == answers["ar"]


def test_a_json_schema_format_gives_json_valid_against_it(tool_servers):
    for url in tool_servers.values():
        response = client(url).responses.create(model=MODEL, input="Name a colour.", temperature=0,
                                                max_output_tokens=64, text={"format": FORMAT})
        jsonschema.validate(json.loads(response.output_text), ANSWER)
        assert response.status == "completed" and response.text is not None
        assert response.text.format is not None and response.text.format.type == "json_schema"


def test_log_probabilities_are_the_chat_endpoints(tool_servers):
    url = tool_servers["auto"]
    chat = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8,
                                               logprobs=True, top_logprobs=2)
    response = client(url).responses.create(model=MODEL, input=MESSAGES, temperature=0, max_output_tokens=8,
                                            include=["message.output_text.logprobs"], top_logprobs=2)
    [part] = response.output[0].content
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    ours = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in part.logprobs or []]
    theirs = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content]
    assert ours == theirs and len(ours) == 8
    # streamed: every token's, steps that wrote no text (an incomplete character) included, each on a delta, and
    # every token's `specdecode` entry; the same figures as the whole answer's
    for limit in (8, 24):
        request = {"input": MESSAGES, "temperature": 0, "max_output_tokens": limit, "top_logprobs": 2,
                   "include": ["message.output_text.logprobs"]}
        whole = client(url).responses.create(model=MODEL, **request)
        events, final = streamed(url, **request)
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        for answer in (whole, final):
            assert answer.usage is not None and len(answer.output[0].content[0].logprobs or []) == limit
        assert final.output[0].content[0].logprobs == whole.output[0].content[0].logprobs
        assert sum(len(e.logprobs) for e in deltas) == limit
        assert sum(len(e.model_extra["specdecode"]["tokens"]) for e in deltas) == limit


BASE = {"model": MODEL, "input": "Hi.", "max_output_tokens": 4}
REFUSED = [  # (the request's fields beside BASE's, the field its 400 names)
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "auto", "efort": "low"}}, "reasoning.efort"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [ADD, {"type": "file_search", "vector_store_ids": ["x"]}]}, "tools[1].type"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
    ({"tools": [ADD], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [ADD | {"defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tools": [ADD | {"name": "no spaces"}]}, "tools[0].name"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"tools": [1]}, "tools[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "item_reference", "id": "msg_1"}]}, "input[1].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "colour": "red"}]}, "input[0].colour"),
    ({"input": [{"type": "function_call", "call_id": 1, "name": "add", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "not json"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": '{"a": 1', "status":
                 "incomplete"}]}, "input[0].status"),  # (the server's own cut call: its arguments are not whole)
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "{}", "caller": {
        "type": "program", "caller_id": "x"}}]}, "input[0].caller"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "5"}]}, "input[0].call_id"),  # no call
    ({"include": ["message.output_text.logprob"]}, "include[0]"),  # (a typo: no log-probabilities, said so)
    ({"input": [{"type": "function_call", "call_id": ["x"], "name": "add", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": {"a": 1}, "output": "5"}]}, "input[0].call_id"),
    ({"input": [{"type": ["message"], "role": "user", "content": "x"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"method": "no-such-method"}, "method"),
    ({"unknown_field": 1}, "unknown_field"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[param for _, param in REFUSED])
def test_what_is_refused_is_a_400_naming_its_field(tool_servers, fields, param):
    reply = httpx.post(tool_servers["ar"] + "/responses", json=BASE | fields, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, reply.text
    # the message names Responses' fields too, never the chat request's it became
    assert not re.search(r"`(messages|response_format|max_completion_tokens|tools\[\d+\]\.function)\b",
                         error["message"]), error["message"]


def test_a_clients_own_names_in_a_message_are_not_renamed(tool_servers):
    """A message names the Responses fields where it names the chat request's, but a client's own name that spells
    a chat field (a function called `max_tokens`) stays as the client wrote it."""
    reply = httpx.post(tool_servers["ar"] + "/responses", json=BASE | {
        "tools": [ADD], "tool_choice": {"type": "function", "name": "max_tokens"}}, timeout=60)
    assert reply.status_code == 400 and "`max_tokens`" in reply.json()["error"]["message"], reply.text


def test_fields_that_change_nothing_are_accepted(tool_servers):
    ignored = {"store": True, "prompt_cache_key": "k", "safety_identifier": "u", "service_tier": "auto",
               "tools": [], "tool_choice": "auto", "text": {"format": None},  # (an agent without tools sends these)
               "include": ["reasoning.encrypted_content"], "truncation": "disabled", "reasoning": {"summary": "auto"},
               "stream_options": {"include_obfuscation": False}, "parallel_tool_calls": False}
    plain = httpx.post(tool_servers["ar"] + "/responses", json=BASE | {"temperature": 0}, timeout=60).json()
    reply = httpx.post(tool_servers["ar"] + "/responses", json=BASE | {"temperature": 0} | ignored, timeout=60)
    assert reply.status_code == 200, reply.text
    assert Response.model_validate(reply.json()).output_text == Response.model_validate(plain).output_text
    assert reply.json()["store"] is False  # nothing was stored
    assert reply.json()["text"] == {"format": {"type": "text"}}


def test_chat_chunks_become_events_the_client_parses():
    """`Events` on chat chunks written by hand: text, a call, text again, then the end (one message item with all the
    text, then the call, as the whole Response has them); and a failure mid-stream (an error body, as a chat stream
    ends with one) as an `error` event naming the Responses field, in its `param` and its message, then
    `response.failed`."""
    from pydantic import TypeAdapter
    from openai.types.responses import ResponseStreamEvent

    from specdecode.serve.response_objects import Events, ResponsesReply

    def chunk(delta: dict, finish: str | None = None, **extra) -> dict:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Let me "}), chunk({"content": "add."}),
              chunk({"tool_calls": [call]}), chunk({"content": "Done."}), chunk({}, "stop", speculative={}),
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}, None]
    reply = ResponsesReply({"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}, lambda p: p)
    adapter = TypeAdapter(ResponseStreamEvent)
    events = Events(reply, MODEL)
    texts = [text for each in chunks for text in events.read(each)]
    parsed = [adapter.validate_python(json.loads(text.split("data: ", 1)[1])) for text in texts]
    assert all(text.startswith(f"event: {event.type}\n") for text, event in zip(texts, parsed))
    check_order(parsed)
    final = parsed[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text == "Let me add.Done." and final.usage.total_tokens == 7 and final.status == "completed"

    def renamed(error):
        error.param, error.message = "input", error.message.replace("`messages`", "`input`")
        return error

    failing = Events(ResponsesReply({"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}, renamed), MODEL)
    error = {"error": {"message": "`messages` too long.", "type": "invalid_request_error", "param": "messages",
                       "code": None}}
    texts = failing.read(chunk({"content": "Hi"})) + failing.read(error)
    parsed = [adapter.validate_python(json.loads(text.split("data: ", 1)[1])) for text in texts]
    assert [e.type for e in parsed[-2:]] == ["error", "response.failed"]
    assert parsed[-2].param == "input" and parsed[-2].message == "`input` too long."


def test_a_stored_response_is_a_404_that_says_none_is_stored(tool_servers):
    import openai

    responses = client(tool_servers["ar"]).responses
    for call in (responses.retrieve, responses.delete, responses.cancel, responses.input_items.list):
        with pytest.raises(openai.NotFoundError, match="stores no responses"):
            call("resp_1")
