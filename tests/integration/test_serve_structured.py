"""Structured output through the server: the official `openai` client's `response_format` (a pydantic model
through `client.beta.chat.completions.parse`, `json_object`, a named `json_schema`), the `structured_outputs`
extension (a regular expression, a Lark grammar) on both endpoints, each answer what the engine gives under
the same constraint; a 400 with the grammar engine's message for a bad constraint, and `finish_reason:
"length"` when max_tokens ends inside the structure."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from pydantic import BaseModel, Field

from specdecode.api import load_models
from specdecode.constraints import Constraint
from specdecode.engine import GenerationConfig
from specdecode.serve.app import Server, ServerThread, create_app
from test_serve import MODEL, openai_error, post

pytestmark = pytest.mark.usefixtures("one_thread")


class Pet(BaseModel):  # bounded, so that a tiny random model ends it within its 128-token context
    name: str = Field(max_length=4)
    legs: int = Field(ge=0, le=8)
    kind: str = Field(pattern="^(cat|dog)$")


@pytest.fixture(scope="module")
def models(tiny_folder):
    return load_models(str(tiny_folder), str(tiny_folder), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def server(models):
    state = Server(models, MODEL, default_method="pld", methods=["pld", "ar", "draft"])
    running = ServerThread(create_app(state))
    yield running, state
    running.stop()


@pytest.fixture
def client(server):
    running, _ = server
    return openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)


def engine_chat(models, messages: list[dict], constraint: Constraint, max_tokens: int):
    """What the engine itself answers the conversation under `constraint`, greedily."""
    ids = models.encode_chat(messages)
    config = GenerationConfig(max_new_tokens=max_tokens, constraint=constraint)
    return models.engine("ar").generate(ids, config)


MESSAGES = [{"role": "user", "content": "describe a pet"}]


def test_the_official_client_parses_into_a_pydantic_model(client, models):
    schema = Pet.model_json_schema()
    expected = engine_chat(models, MESSAGES, Constraint.json_schema(openai.lib._pydantic.to_strict_json_schema(Pet)),
                           90)
    completion = client.beta.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet,
                                                    max_tokens=90, temperature=0, extra_body={"method": "draft"})
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and expected.finish_reason == "eos"
    assert choice.message.content == expected.text
    pet = choice.message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and set(schema["required"]) == {"name", "legs", "kind"}


def test_json_object_and_a_named_schema(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=90, temperature=0,
                                           response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": schema, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(reply.choices[0].message.content) in ({"ok": True}, {"ok": False})


@pytest.mark.parametrize("extension, check", [
    ({"regex": "(yes|no), [0-9]{2}"}, lambda text: re.fullmatch("(yes|no), [0-9]{2}", text)),
    ({"grammar": 'start: "pick " choice\nchoice: "red" | "green" | "blue"'},
     lambda text: text in ("pick red", "pick green", "pick blue")),
])
def test_structured_outputs_on_both_endpoints(client, extension, check):
    completion = client.completions.create(model=MODEL, prompt="the cat", max_tokens=30, temperature=0,
                                           extra_body={"structured_outputs": extension})
    assert completion.choices[0].finish_reason == "stop" and check(completion.choices[0].text)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, stream=True,
                                          extra_body={"structured_outputs": extension, "method": "ar"})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices)
    assert check(text)


def test_max_tokens_inside_the_structure_is_length(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "string", "format": "zzz"}}}},
     "response_format.json_schema.schema", "Unknown format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "needs"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "Input should be"),
    ({"structured_outputs": {"regex": "(open"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar", "unknown name"),
    ({"structured_outputs": {"regex": "a", "grammar": 'start: "a"'}}, "structured_outputs.grammar", "one constraint"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex",
     "one constraint"),
    # languages found empty only by a matcher, made before the request joins the queue
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs.regex", "empty"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
     "response_format.json_schema.schema", "empty"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
     "response_format.json_schema", "goes with"),
])
def test_bad_constraints_are_400_with_the_engines_message(server, extra, param, words):
    running, _ = server
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})):
        reply = post(running.url, path, {**body, **extra})
        assert reply.status_code == 400, reply.text
        error = openai_error(reply)
        assert words in error["message"] and error["param"] == param, error


def test_text_is_the_neutral_response_format_and_true_any_json(server):
    running, _ = server
    reply = post(running.url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                       "response_format": {"type": "text"}})
    assert reply.status_code == 200
    reply = post(running.url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                       "response_format": {"type": "json_schema", "json_schema": {
                                                           "name": "anything", "schema": True}}})
    assert reply.status_code == 200, reply.text


def test_a_schema_the_grammar_engine_cannot_follow_fails_its_own_request(server):
    """Its forced run has no end (no finite JSON satisfies it): a 400 naming its field, while requests decoded
    beside it in the batch answer as they would alone."""
    running, _ = server
    endless = {"$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"],
                               "additionalProperties": False}}, "$ref": "#/$defs/n"}
    plain = {"model": MODEL, "prompt": "the cat", "max_tokens": 12, "temperature": 0, "method": "pld"}
    alone = post(running.url, "/v1/completions", plain).json()["choices"][0]["text"]
    bodies = [plain, {**plain, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "n", "schema": endless}}}, plain]
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda body: post(running.url, "/v1/completions", body), bodies))
    assert [r.status_code for r in replies] == [200, 400, 200], [r.text for r in replies]
    assert "cannot be followed" in openai_error(replies[1])["message"]
    assert openai_error(replies[1])["param"] == "response_format.json_schema.schema"  # the field it came from
    assert all(r.json()["choices"][0]["text"] == alone for r in (replies[0], replies[2]))


def test_the_grammar_engines_vocabulary_is_built_off_the_worker(server, monkeypatch):
    """Its first build takes seconds on a large vocabulary: made on the worker it would hold every request up."""
    import llguidance.hf

    from specdecode.constraints import grammar

    running, _ = server
    built_on = []
    build = llguidance.hf.from_tokenizer
    monkeypatch.setattr(grammar, "_TOKENIZERS", type(grammar._TOKENIZERS)())  # as on a new server
    monkeypatch.setattr(llguidance.hf, "from_tokenizer",
                        lambda *a, **k: built_on.append(threading.current_thread().name) or build(*a, **k))
    body = {"model": MODEL, "prompt": "pick one", "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"regex": "(yes|no)"}}
    for _ in range(2):
        assert post(running.url, "/v1/completions", body).status_code == 200
    assert len(built_on) == 1 and built_on[0].startswith("specdecode-tokenize")


def test_constraints_are_compiled_off_the_event_loop(server, monkeypatch):
    """A large schema or a request's tools take a while to compile (and one longer than CACHED_SOURCE is compiled
    with every request): on the event loop it held every connection up."""
    from specdecode.constraints import grammar

    running, _ = server
    compiled_on = []
    check = grammar._check_depth
    monkeypatch.setattr(grammar, "_check_depth", lambda kind, source: compiled_on.append(
        threading.current_thread().name) or check(kind, source))
    schema = {"type": "object", "properties": {"off_the_loop": {"type": "integer"}}, "required": ["off_the_loop"]}
    body = {"model": MODEL, "prompt": "a number", "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    assert post(running.url, "/v1/completions", body).status_code == 200
    assert compiled_on and all(name.startswith("specdecode-tokenize") for name in compiled_on), compiled_on
