"""A property-based fuzz of both endpoints' bodies: 1,000 bodies each, from valid requests and valid ones
with one field gone wrong to arbitrary JSON and bytes, and not one 5xx; every refusal is OpenAI's error
object. Valid bodies generate at most 3 tokens on the tiny model (the server's max_tokens), so the fuzz
stays fast."""

from __future__ import annotations

import collections
import http.client
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdecode.api import load_models
from specdecode.serve.app import Limits, Server, ServerThread, create_app

MODEL = "tiny"
EXAMPLES = 1000

pytestmark = pytest.mark.usefixtures("one_thread")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
text = st.text(st.characters(codec="utf-8"), max_size=24)
words = st.text(st.characters(codec="utf-8"), min_size=1, max_size=24)

# Each field's plausible values; a body may also give a field any JSON at all.
COMMON = {
    "max_tokens": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 5),
    "stop": st.none() | words | st.lists(words, max_size=4),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": st.sampled_from(["alice", "bob"]) | text,
    "method": st.sampled_from(["ar", "pld", "suffix", "suffix-tree"]),
    "frequency_penalty": st.sampled_from([0, 0.0, 0.5]),
    "presence_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 200).map(str), st.floats(-100, 100), max_size=2),
    # vLLM's fields (min_tokens mostly 0: above 0 it is refused beside a constraint)
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 200), max_size=3),
    "min_tokens": st.sampled_from([0, 0, 1]),
}
COMPLETION = {
    **COMMON,
    # a text, token ids, or a batch of either (lm-evaluation-harness sends batches)
    "prompt": words | st.lists(st.integers(0, 200), min_size=1, max_size=8) | st.lists(words, min_size=1, max_size=3)
    | st.lists(st.lists(st.integers(0, 200), min_size=1, max_size=6), min_size=1, max_size=3),
    "echo": st.booleans(),
    "best_of": st.just(1),
    "logprobs": st.none() | st.integers(0, 5),
    # a constraint (one field per endpoint, so that most bodies ask for one at most): mostly plausible ones, now
    # and then a schema, expression or grammar of any content (the grammar engine's refusals are 400s)
    "structured_outputs": st.one_of(
        st.sampled_from([{"regex": "[a-z]{1,3}"}, {"regex": "(yes|no)"}, {"grammar": 'start: "a" | "b"'}]),
        st.sampled_from([{"regex": "[a-z]{1,3}"}, {"grammar": 'start: "a"+'}]),
        st.fixed_dictionaries({}, optional={"regex": words, "grammar": text})),
}
part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"])},
                                optional={"content": st.none() | text | st.lists(part, max_size=3)})
CHAT = {
    **COMMON,
    "messages": st.lists(message, min_size=1, max_size=3),
    "max_completion_tokens": st.integers(1, 3),
    "logprobs": st.booleans(),
    "tools": st.just([]),
    "response_format": st.one_of(st.sampled_from([
        {"type": "text"}, {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}, "strict": True}},
    ]), st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": st.just("answer"), "schema": st.dictionaries(st.sampled_from(["type", "enum", "pattern"]),
                                                              json_values, max_size=2)})})),
}
REQUIRED = {"/v1/completions": ("prompt",), "/v1/chat/completions": ("messages",)}


def either(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly a plausible one, sometimes any JSON at all."""
    return st.one_of(valid, valid, valid, json_values)


def bodies(path: str, fields: dict) -> st.SearchStrategy[bytes]:
    """Request bodies: valid ones; valid ones with one field (or an unknown one) of any JSON; objects of
    the endpoint's fields each plausible or any JSON; arbitrary JSON; arbitrary bytes; a lone surrogate."""
    required = {"model": st.just(MODEL), **{name: fields[name] for name in REQUIRED[path]}}
    optional = {name: value for name, value in fields.items() if name not in required}
    valid = st.fixed_dictionaries(required, optional=optional)
    one_wrong = st.tuples(valid, st.sampled_from([*required, *optional, "unknown"]), json_values).map(
        lambda t: {**t[0], t[1]: t[2]})
    wild = st.fixed_dictionaries({name: either(value) for name, value in required.items()},
                                 optional={name: either(value) for name, value in optional.items()})
    objects = st.one_of(valid, valid, one_wrong, one_wrong, wild)
    as_json = objects.map(lambda body: json.dumps(body).encode())
    return st.one_of(
        as_json, as_json, as_json,
        json_values.map(lambda value: json.dumps(value).encode()),
        st.binary(max_size=40),
        valid.map(lambda body: json.dumps(body).replace('"', '"\\ud800', 1).encode()),  # a lone surrogate
    )


class Client:
    """One keep-alive connection, opened again when the server closes it."""

    def __init__(self, url: str):
        self.address = url.removeprefix("http://")
        self.connection = http.client.HTTPConnection(self.address, timeout=60)

    def post(self, path: str, body: bytes) -> tuple[int, str, str]:
        for _ in range(2):
            try:
                self.connection.request("POST", path, body=body, headers={"content-type": "application/json"})
                response = self.connection.getresponse()
                return response.status, response.getheader("content-type", ""), response.read().decode("utf-8")
            except (http.client.HTTPException, ConnectionError):
                self.connection.close()
                self.connection = http.client.HTTPConnection(self.address, timeout=60)
        raise AssertionError("the server closed the connection twice in a row")


@pytest.fixture(scope="module")
def client(tiny_folder):
    models = load_models(str(tiny_folder), None, dtype="float32", progress=False)
    state = Server(models, MODEL, default_method="ar", methods=["ar", "pld", "suffix", "suffix-tree"],
                   limits=Limits(max_tokens=3, default_max_tokens=3), memory_owners=4)
    running = ServerThread(create_app(state))
    yield Client(running.url)
    running.stop()


def check(status: int, kind: str, text: str) -> None:
    assert status < 500, text
    if status >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", text
        assert "Traceback" not in text and "Error:" not in error["message"], text
    elif "text/event-stream" in kind:
        events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), text
    else:
        assert json.loads(text)["choices"], text


@pytest.mark.parametrize("path, fields", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
                         ids=["completions", "chat"])
def test_no_body_makes_a_5xx(client, path, fields):
    statuses = collections.Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=bodies(path, fields))
    def fuzz(body: bytes) -> None:
        status, kind, text = client.post(path, body)
        statuses[status] += 1
        check(status, kind, text)

    fuzz()
    print(f"{path}: {sum(statuses.values())} bodies, statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= EXAMPLES
    assert statuses[200] >= EXAMPLES // 10  # the fuzz reaches generation, not only validation
