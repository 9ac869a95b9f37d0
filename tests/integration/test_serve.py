"""`specdecode serve` on loopback with a tiny model pair: the official `openai` client, streaming, chat,
concurrency, bad requests, a client leaving mid-stream, /metrics, a bounded load test, and several choices (`n`)."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import http.client
import openai
import pytest

from specdecode.api import load_models
from specdecode.engine import GenerationConfig
from specdecode.errors import UserError
from specdecode.serve.app import Server, ServerThread, create_app
from specdecode.serve.limits import choice_configs
from specdecode.serve.protocol import MAX_CHOICES, MAX_PROMPTS, SEED_RANGE, APIError, CompletionRequest, parse
from specdecode.types import SamplingParams

MODEL = "tiny"
PROMPTS = ["the cat sat", "hello there", "one two three four", "the the the"]


@pytest.fixture(scope="module")
def models(tiny_folder):
    return load_models(str(tiny_folder), str(tiny_folder), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def server(models):
    state = Server(models, MODEL, default_method="pld", methods=["pld", "ar", "draft", "draft-tree-fixed"])
    running = ServerThread(create_app(state))
    yield running, state
    running.stop()


@pytest.fixture
def client(server):
    running, _ = server
    return openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)


def expected(models, method: str, prompt_ids: list[int], max_tokens: int, stop=()) -> str:
    return models.engine(method).generate(prompt_ids, GenerationConfig(max_new_tokens=max_tokens, stop=stop)).text


def completion_ids(models, prompt: str) -> list[int]:
    return models.tokenizer(prompt, add_special_tokens=True)["input_ids"]


def test_models_and_methods(client, server):
    running, state = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("another")
    methods = get(running.url, "/v1/methods").json()
    assert methods["default"] == "pld"
    assert {"ar", "pld", "draft"} <= {m["id"] for m in methods["data"]}


@pytest.mark.parametrize("method", ["pld", "draft", "ar"])
def test_completion_equals_the_engine_greedy(client, models, method):
    for prompt in PROMPTS[:2]:
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                             extra_body={"method": method})
        assert response.choices[0].text == expected(models, method, completion_ids(models, prompt), 20)
        assert response.usage.completion_tokens <= 20
        assert response.usage.prompt_tokens == len(completion_ids(models, prompt))
        stats = response.model_extra["speculative"]
        assert stats["method"] == method
        assert stats["target_forwards"] >= 1
        if method == "ar":
            assert stats["drafted_tokens"] == 0


def test_streamed_completion_equals_the_plain_one(client, models):
    prompt, max_tokens = PROMPTS[3], 24
    # a fixed tree always drafts (the gated methods may not, with a drafter as costly as the target)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            stream=True, extra_body={"method": "draft-tree-fixed"}))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == expected(models, "draft-tree-fixed", completion_ids(models, prompt), max_tokens)
    steps = [c for c in chunks if c.model_extra.get("specdecode")]
    tokens = [t for c in steps for t in c.model_extra["specdecode"]["tokens"]]
    # a step the engine's timing gate plays plain (`engine.payoff`) outputs the target's own token, "target";
    # a new sequence starts with speculative steps, so some drafted tokens are accepted
    assert {t["origin"] for t in tokens} <= {"accepted", "corrected", "bonus", "target"}
    assert any(t["origin"] == "accepted" for t in tokens)
    # the page's coloured tokens spell the text (a step without tokens: a held-back partial character)
    spelt = "".join("".join(t["text"] for t in c.model_extra["specdecode"]["tokens"]) or c.choices[0].text
                    for c in steps)
    assert spelt == text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].model_extra["speculative"]["target_forwards"] >= 1


def test_chat_plain_and_streamed(client, models):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    ids = models.encode_chat(messages)
    want = expected(models, "pld", ids, 16)
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert response.choices[0].message.content == want
    assert response.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_tokenize_gives_what_a_request_feeds_and_detokenize_reads_it_back(server, models):
    running, state = server
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    context = models.target.max_context
    for body, ids in [({"prompt": "the cat sat"}, completion_ids(models, "the cat sat")),
                      ({"model": MODEL, "prompt": [5, 6, 7]}, [5, 6, 7]),
                      ({"messages": messages}, models.encode_chat(messages))]:
        reply = post(running.url, "/tokenize", body)
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"count": len(ids), "max_model_len": context, "tokens": ids}
    # vLLM's fields: a text without special tokens, the conversation without the assistant's turn opened, each
    # token's text
    text_alone = models.tokenizer("the cat sat", add_special_tokens=False)["input_ids"]
    closed = models.tokenizer(models.tokenizer.apply_chat_template(messages, tokenize=False),
                              add_special_tokens=False)["input_ids"]
    for body, ids in [({"prompt": "the cat sat", "add_special_tokens": False}, text_alone),
                      ({"messages": messages, "add_generation_prompt": False}, closed)]:
        assert post(running.url, "/tokenize", body).json()["tokens"] == ids
    strs = post(running.url, "/tokenize", {"prompt": "the cat sat", "return_token_strs": True}).json()["token_strs"]
    assert strs == models.tokenizer.convert_ids_to_tokens(completion_ids(models, "the cat sat"))
    reply = post(running.url, "/tokenize", {"prompt": "x", "return_token_strs": "yes"})
    assert reply.status_code == 400 and openai_error(reply)["param"] == "return_token_strs"
    ids = completion_ids(models, "the cat sat")
    reply = post(running.url, "/detokenize", {"tokens": ids})
    assert reply.status_code == 200 and reply.json() == {"prompt": models.tokenizer.decode(ids)}
    for path, body, status, param in [
            ("/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
            ("/tokenize", {"prompt": ["a", "b"]}, 400, "prompt"),
            ("/tokenize", {"prompt": ""}, 400, "prompt"),
            ("/tokenize", {"messages": []}, 400, "messages"),
            ("/tokenize", "{not json", 400, None),
            ("/detokenize", {"tokens": [models.target.vocab_size]}, 400, "tokens"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
            ("/detokenize", {"tokens": "abc"}, 400, "tokens")]:
        reply = post(running.url, path, body)
        assert reply.status_code == status and openai_error(reply)["param"] == param, (path, body, reply.text)


def test_stop_strings_and_seeded_sampling(client, models):
    ids = completion_ids(models, PROMPTS[0])
    full = expected(models, "pld", ids, 30)
    stop = full[5:7]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop])
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    # as many as an evaluation harness sends (HumanEval's, and lm-evaluation-harness's own), the first met ends it
    stops = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "<|endoftext|>", stop]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=stops)
    assert response.choices[0].text == full[: min(full.index(s) for s in stops if s in full)]
    sampled = [client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=1.0, seed=7,
                                         top_p=0.9).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]  # a seed reproduces a sampled answer
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=1.0, seed=7,
                                      top_p=0.9, extra_body={"method": "ar"}).choices[0].text
    assert plain == sampled[0]  # plain decoding's, whatever the method (docs/verification.md, "Randomness")


def test_a_vanishing_temperature_decodes_greedily(client, models):
    """Found by the fuzz: 1e-152 once turned the logits into inf and NaN (a 500)."""
    texts = [client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=t).choices[0].text
             for t in (0, 1e-152, 1e-6)]
    assert texts[0] == texts[1] == texts[2] == expected(models, "pld", completion_ids(models, PROMPTS[0]), 8)


def test_concurrent_requests_each_get_their_own_answer(client, models):
    want = {p: expected(models, "pld", completion_ids(models, p), 16) for p in PROMPTS}
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: client.completions.create(
            model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text, PROMPTS * 2))
    assert got == [want[p] for p in PROMPTS * 2]


class Reply:
    def __init__(self, status: int, text: str, headers: dict[str, str] | None = None):
        self.status_code, self.text, self.headers = status, text, headers or {}

    def json(self):
        return json.loads(self.text)


def request(url: str, method: str, path: str, body=None, headers: dict[str, str] | None = None) -> Reply:
    """A raw HTTP request (stdlib), for what the official client would refuse to send; `body`: bytes as
    they are, a str as UTF-8, anything else as JSON; `headers` beside `Content-Type: application/json`
    (a header given None is left out)."""
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    content = None if body is None else body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = {name: value for name, value in {"content-type": "application/json", **(headers or {})}.items()
               if value is not None}
    connection.request(method, path, body=content, headers=headers)
    response = connection.getresponse()
    reply = Reply(response.status, response.read().decode("utf-8", "replace"),
                  {name.lower(): value for name, value in response.getheaders()})
    connection.close()
    return reply


def get(url: str, path: str, headers: dict[str, str] | None = None) -> Reply:
    return request(url, "GET", path, headers=headers)


def post(url: str, path: str, body, headers: dict[str, str] | None = None) -> Reply:
    return request(url, "POST", path, body, headers=headers)


def openai_error(reply: Reply) -> dict:
    """The error of an answer in OpenAI's format (and nothing else in it)."""
    body = reply.json()
    assert set(body) == {"error"}, reply.text
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), reply.text
    assert "Traceback" not in reply.text
    return error


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions", "{not json", 400, "not valid JSON"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "gpt-9"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "method": "telepathy"}, 400, "telepathy"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [str(n) for n in range(33)]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "Token ids"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "the " * 200}, 400, "maximum context length"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1000}, 400, "maximum context length"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
])
def test_bad_requests_get_openai_style_errors(server, path, body, status, words):
    running, _ = server
    response = post(running.url, path, body)
    assert response.status_code == status, response.text
    error = openai_error(response)
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"


CHAT = {"model": MODEL, "max_tokens": 2}
DEEP = '{"model": "tiny", "prompt": "hi", "stop": ' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.parametrize("path, body, param, words", [
    # the cases of issue 15, each once a 500 or a silent misreading
    ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800x"}', None, "not valid JSON"),  # a lone surrogate
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content", "text part"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages[0].content", "text part"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "text only"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 2**63}, "seed", "less than"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', None, "not valid JSON"),  # invalid UTF-8
    ("/v1/completions", DEEP, None, "not valid JSON"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "8"}, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream", "boolean"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "0.5"}, "temperature", "number"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", "0 with echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, "echo",
     "not streamed"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, "best_of", "not supported"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"3": 101}}, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}, None, "out of the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty", "less than"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "greater"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 1e-300}, "repetition_penalty",
     "greater than or equal to 0.01"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "min_p": 1.5}, "min_p", "less than"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
     "top_logprobs", "needs logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools[0].function", "Missing"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calls"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice", "needs `tools`"),
    # a field of several forms: the error of the form given (was "should be 'none', 'auto' or 'required'", param
    # `tool_choice.literal['none','auto','required']`), and no class name
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": {"type": "function"}}, "tool_choice.function", "Missing"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x"}], "tool_choice": "any"},
     "tool_choice", "'none', 'auto' or 'required'"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x"}], "response_format": "json"},
     "response_format", "valid dictionary"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id",
     "tool_call_id"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_token": 8}, "max_token", "Unrecognized"),
    ("/v1/completions", {"model": MODEL, "prompt": "the " * 200}, "prompt", "maximum context length"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, "prompt", "string"),
    ("/v1/completions", [1, 2], None, "JSON object"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, "stop", "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a" * 257]}, "stop", "at most 256"),
])
def test_client_mistakes_are_4xx_in_openai_format_without_internals(server, path, body, param, words):
    running, _ = server
    reply = post(running.url, path, body)
    assert reply.status_code == 400, reply.text
    error = openai_error(reply)
    assert words in error["message"] and error["param"] == param
    assert "Error:" not in error["message"] and "pydantic" not in error["message"]


def test_neutral_values_of_unsupported_fields_are_accepted(server):
    running, _ = server
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": None, "echo": False, "best_of": 1,
            "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "n": 1, "user": "someone"}
    assert post(running.url, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("method, path, status, words", [
    ("GET", "/v1/nowhere", 404, "Invalid URL"),
    ("POST", "/../../etc/passwd", 404, "Invalid URL"),
    ("GET", "/v1/completions", 405, "not allowed"),
    ("DELETE", "/v1/models", 405, "not allowed"),
])
def test_unknown_paths_and_methods_are_openai_errors(server, method, path, status, words):
    running, _ = server
    reply = request(running.url, method, path)
    assert reply.status_code == status and words in openai_error(reply)["message"]


def test_a_server_error_says_nothing_of_its_cause_and_is_counted(server, monkeypatch):
    running, state = server
    before = metric(running.url, 'specdecode_requests_total{endpoint="/v1/completions",status="500"}')

    def broken(prompt):
        raise RuntimeError("the secret inner workings")

    monkeypatch.setattr(state, "_encode_completion", broken)
    reply = post(running.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 500
    error = openai_error(reply)
    assert error["type"] == "server_error" and "secret" not in reply.text and "RuntimeError" not in reply.text
    after = metric(running.url, 'specdecode_requests_total{endpoint="/v1/completions",status="500"}')
    assert after == before + 1
    assert metric(running.url, "specdecode_waiting_requests") == 0  # its place in the queue was given back


def test_the_official_client_raises_on_bad_requests(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="the " * 200)


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    total = 0.0
    for line in get(url, "/metrics", headers).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_client_leaving_mid_stream_stops_its_generation(server, client, models):
    running, state = server
    before = metric(running.url, "specdecode_cancelled_requests_total")
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "stream": True,
            "method": "ar"}
    connection = http.client.HTTPConnection(running.url.removeprefix("http://"), timeout=30)
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data:")
    connection.close()  # mid-stream
    deadline = time.monotonic() + 20
    while metric(running.url, "specdecode_cancelled_requests_total") == before:
        assert time.monotonic() < deadline, "the server did not notice the client leaving"
        time.sleep(0.05)
    # the worker is free again and the cache was dropped
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert response.choices[0].text == expected(models, "pld", completion_ids(models, PROMPTS[1]), 8)


def test_a_stream_that_fails_mid_answer_is_not_counted_as_a_client_leaving(server, monkeypatch):
    """A streamed answer whose generation fails after its first tokens (its drafter's fault: the batch ends that
    sequence alone) gets the error in the stream, and the count of generations stopped because the client left stays
    as it was (it counted every stream that did not finish)."""
    from specdecode.drafters.prompt_lookup import PromptLookupDrafter

    running, _ = server
    before = metric(running.url, "specdecode_cancelled_requests_total")
    propose, calls = PromptLookupDrafter.propose, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("a drafter's fault")
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(PromptLookupDrafter, "propose", failing)
    reply = post(running.url, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 40,
                                                  "temperature": 0, "stream": True, "method": "pld"})
    events = [line for line in reply.text.split("\n\n") if line.startswith("data: {")]
    assert '"choices"' in events[0] and '"server_error"' in events[-1], reply.text
    assert metric(running.url, "specdecode_cancelled_requests_total") == before


def test_metrics(server, client):
    running, _ = server
    client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0)
    text = get(running.url, "/metrics").text
    for name in ["specdecode_requests_total", "specdecode_generated_tokens_total", "specdecode_drafted_tokens_total",
                 "specdecode_accepted_tokens_total", "specdecode_accepted_by_position_total",
                 "specdecode_request_seconds_bucket", "specdecode_time_to_first_token_seconds_bucket"]:
        assert name in text, name
    assert metric(running.url, 'specdecode_requests_total{endpoint="/v1/completions",status="200"}') >= 1
    assert metric(running.url, "specdecode_generated_tokens_total") >= 16


def test_a_prompt_sent_again_takes_its_context_from_the_batchs_cache(server, client, models):
    """The batch keeps an ended request's context (`BatchEngine.keep_ended`): the same prompt again, alone, takes all
    of it but its last token instead of feeding it, says so in `usage` and `/metrics`, and answers the same."""
    running, _ = server
    prompt = "A prompt no other test sends, twice over: " + PROMPTS[2]
    before = metric(running.url, "specdecode_cached_prompt_tokens_total")
    replies = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"method": "pld"}) for _ in range(2)]
    length = len(completion_ids(models, prompt))
    assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, length - 1]
    assert replies[0].choices[0].text == replies[1].choices[0].text == expected(models, "pld", completion_ids(
        models, prompt), 8)
    assert metric(running.url, "specdecode_cached_prompt_tokens_total") - before == length - 1


def test_a_prompt_sent_again_after_another_takes_its_context_from_a_copy(server, client, models):
    """A request in between, to an emptied batch, keeps only what it takes of the cache: the first's context leaves
    it, copied out (`Server`'s `prefix_cache`), and the first prompt sent again takes all of it but its last token
    from the copy, and answers the same."""
    prompt = "Another prompt no other test sends, sent twice: " + PROMPTS[1]
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    client.completions.create(model=MODEL, prompt="Zebras " + PROMPTS[3], max_tokens=4, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == len(completion_ids(models, prompt)) - 1
    assert again.choices[0].text == first.choices[0].text == expected(models, "pld", completion_ids(models, prompt), 8)
    assert metric(server[0].url, "specdecode_prefix_cache_bytes") > 0


def test_a_request_that_does_not_cache_its_prompt_takes_and_leaves_nothing(server, client, models):
    """`cache_prompt: false` (as llama-server's): the request feeds its whole prompt and leaves nothing for the next
    one; a request without it leaves its context, which the next takes."""
    prompt = "Quokkas, in a third prompt no other test sends: " + PROMPTS[0]
    cached = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body=extra).usage.prompt_tokens_details.cached_tokens
              for extra in [{"cache_prompt": False}, {"cache_prompt": False}, {}, {}]]
    assert cached == [0, 0, 0, len(completion_ids(models, prompt)) - 1]


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_the_chunk_seconds_and_policy_given_are_the_batchs(models):
    """`specdecode serve --chunk-seconds`, `--chunk-policy`: what one step of the batch feeds of prompts takes at most
    (left out, the engine's default), and when a long prompt's chunk goes into a step."""
    from specdecode.models.costs import CHUNK_SECONDS

    for given, expected_seconds, policy in [(0.25, 0.25, "every"), (None, CHUNK_SECONDS, "turns")]:
        state = Server(models, MODEL, default_method="ar", methods=["ar"], chunk_seconds=given, chunk_policy=policy)
        try:
            share = state.worker.batch._share if state.worker.batch is not None else None
            assert share is not None and share.seconds == expected_seconds and share.policy == policy
        finally:
            state.close()
    with pytest.raises(UserError, match="chunk_seconds"):
        Server(models, MODEL, default_method="ar", methods=["ar"], chunk_seconds=0.0)


def test_load_200_requests_from_8_clients(server, client, models):
    running, state = server
    want = [expected(models, "ar", completion_ids(models, p), 8) for p in PROMPTS]

    def one(index: int) -> str:
        stream = index % 2 == 0
        response = client.completions.create(model=MODEL, prompt=PROMPTS[index % 4], max_tokens=8, temperature=0,
                                             stream=stream, extra_body={"method": ["pld", "ar", "draft"][index % 3]})
        return "".join(c.choices[0].text for c in response) if stream else response.choices[0].text

    with ThreadPoolExecutor(8) as pool:  # a first round warms every path up
        list(pool.map(one, range(40)))
    before = resident_bytes()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(200)))
    after = resident_bytes()
    assert len(answers) == 200
    assert answers == [want[i % 4] for i in range(200)]  # every method, streamed or not, gives greedy's answer
    assert after - before < 50 * 2**20, f"resident memory grew by {(after - before) / 2**20:.0f} MiB"
    assert metric(running.url, "specdecode_running_requests") == 0
    assert (metric(running.url, 'specdecode_batch_size_bucket{le="1.0"}')
            < metric(running.url, "specdecode_batch_size_count"))
    assert metric(running.url, "specdecode_waiting_requests") == 0


def test_ignore_eos_decodes_on_past_end_of_sequence_tokens(client, models):
    """vLLM's `ignore_eos`: an answer made of end-of-sequence tokens (a bias forces them) runs to max_tokens."""
    eos = min(models.target.eos_token_ids)
    ask = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logit_bias": {str(eos): 100}}
    ended = client.completions.create(**ask)
    assert ended.usage.completion_tokens == 1 and ended.choices[0].finish_reason == "stop"
    for method in ("pld", "draft"):
        going = client.completions.create(**ask, extra_body={"ignore_eos": True, "method": method})
        assert going.usage.completion_tokens == 6 and going.choices[0].finish_reason == "length"



def test_stop_token_ids_end_the_answer(client, models, server):
    """vLLM's `stop_token_ids`: the answer ends at the first of them, `finish_reason` "stop"; the token counts among
    the answer's tokens, its text is left out of the answer's (vLLM's default), whole and streamed."""
    ids = models.engine("pld").generate(completion_ids(models, PROMPTS[1]), GenerationConfig(max_new_tokens=12))
    stop = ids.token_ids[5]
    end = ids.token_ids.index(stop)
    ask = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, extra_body={"stop_token_ids": [stop]})
    cut = client.completions.create(**ask)
    assert cut.usage.completion_tokens == end + 1 and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == models.tokenizer.decode(ids.token_ids[:end], skip_special_tokens=True)
    assert models.tokenizer.decode([stop]) not in ("", "\ufffd")  # (a token with a text of its own)
    streamed = list(client.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
    running, _ = server
    for bad, words in (([-1], "greater than or equal to 0"), ([10**6], "out of the vocabulary")):
        reply = post(running.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": bad})
        assert reply.status_code == 400 and words in openai_error(reply)["message"], reply.text



def test_min_tokens_holds_the_end_off(client, models, server):
    """vLLM's `min_tokens`: an end-of-sequence token a bias makes the likeliest comes only after so many tokens."""
    eos = min(models.target.eos_token_ids)
    ask = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "logit_bias": {str(eos): 100}}
    for method in ("pld", "draft"):
        held = client.completions.create(**ask, extra_body={"min_tokens": 5, "method": method})
        assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    running, _ = server
    for extra, words in (({"min_tokens": 13}, "more than"), ({"min_tokens": 2, "structured_outputs": {"regex": "a+"}},
                                                             "cannot hold open"), ({"min_tokens": -1}, "greater")):
        reply = post(running.url, "/v1/completions", {**ask, **extra})
        assert reply.status_code == 400 and words in openai_error(reply)["message"], reply.text


# --- Several choices (`n`) -------------------------------------------------------------------------------------
# Greedy choices are one generation's copies; sampled choice i is what a request of one choice seeded with seed + i
# gets, whichever method, batched or alone; streamed choices spell the whole ones; `usage` counts every choice; a
# client that leaves stops them all.

PROMPT = PROMPTS[0]
MESSAGES = [{"role": "user", "content": "the cat"}]


def complete(client, **kwargs):
    method = kwargs.pop("method", "pld")
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=kwargs.pop("max_tokens", 12),
                                     extra_body={"method": method}, **kwargs)


def test_greedy_choices_are_copies_of_one_generation(client, models):
    many, one = complete(client, temperature=0, n=3), complete(client, temperature=0)
    ids = completion_ids(models, PROMPT)
    want = expected(models, "pld", ids, 12)
    assert [(c.index, c.text, c.finish_reason) for c in many.choices] == [(i, want, one.choices[0].finish_reason)
                                                                           for i in range(3)]
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert many.usage.prompt_tokens == one.usage.prompt_tokens == len(ids)
    # one generation ran: its forwards are one request's
    assert many.model_extra["speculative"]["target_forwards"] == one.model_extra["speculative"]["target_forwards"]


@pytest.mark.parametrize("method", ["pld", "ar", "draft"])  # draft's sequences run alone, taking turns
def test_sampled_choice_i_is_the_one_choice_seeded_with_seed_plus_i(client, method):
    many = complete(client, method=method, temperature=1.0, seed=11, n=3, max_tokens=16)
    singles = [complete(client, method=method, temperature=1.0, seed=11 + i, max_tokens=16) for i in range(3)]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in many.choices}) == 3  # sampled apart
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert many.model_extra["speculative"]["target_forwards"] == sum(
        s.model_extra["speculative"]["target_forwards"] for s in singles)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_streamed_choices_spell_the_whole_ones(client, temperature):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": temperature, "seed": 5, "n": 3}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = defaultdict(str)
    finishes, roles = {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles += [choice.index] if choice.delta.role else []
            if choice.finish_reason:
                assert choice.index not in finishes  # one finish a choice
                finishes[choice.index] = choice.finish_reason
    assert dict(texts) == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert sorted(roles) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_client_leaving_a_stream_of_choices_stops_every_one(server, client):
    running, state = server
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "temperature": 1.0, "n": 3, "stream": True}
    connection = http.client.HTTPConnection(running.url.removeprefix("http://"), timeout=30)
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data:")
    connection.close()  # mid-stream
    deadline = time.monotonic() + 20
    while state.worker.batch.members:  # every choice's sequence leaves the batch
        assert time.monotonic() < deadline, "the server did not stop the choices"
        time.sleep(0.05)
    assert complete(client, temperature=0, n=2).choices[1].text


def test_choices_are_refused_beyond_the_most_a_request_may_ask():
    with pytest.raises(APIError, match="less than or equal to 16"):
        parse(json.dumps({"model": MODEL, "prompt": "x", "n": MAX_CHOICES + 1}).encode(), CompletionRequest)


def test_the_choices_seeds_wrap_within_the_seed_range():
    sampled = GenerationConfig(sampling=SamplingParams(temperature=1.0), seed=SEED_RANGE[1] - 2)
    assert [c.seed for c in choice_configs(sampled, 3)] == [SEED_RANGE[1] - 2, SEED_RANGE[1] - 1, SEED_RANGE[0]]
    unseeded = GenerationConfig(sampling=SamplingParams(temperature=1.0))
    assert [c.seed for c in choice_configs(unseeded, 2)] == [None, None]
    assert len(choice_configs(GenerationConfig(seed=3), 4)) == 1  # greedy: one generation, copied


# --- A batch of prompts (/v1/completions) --------------------------------------------------------------------------
# OpenAI's legacy form: `prompt` a list of texts or of token-id lists; choice p * n + i is prompt p's choice i.


def test_a_batch_of_prompts_answers_each_as_its_own_request(client, models):
    ids = [completion_ids(models, prompt) for prompt in PROMPTS[:3]]
    for prompt in (PROMPTS[:3], ids):
        batch = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        assert [c.text for c in batch.choices] == [expected(models, "pld", each, 10) for each in ids]
        assert [c.index for c in batch.choices] == [0, 1, 2]
        assert batch.usage.prompt_tokens == sum(map(len, ids))
        assert batch.usage.completion_tokens == sum(
            client.completions.create(model=MODEL, prompt=[p], max_tokens=10, temperature=0).usage.completion_tokens
            for p in PROMPTS[:3])


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_with_sampled_choices(client, stream):
    """Choice p * n + i: prompt p's choice i, seeded with seed + i, whole or streamed."""
    ask = {"model": MODEL, "max_tokens": 8, "temperature": 1.0}
    singles = [client.completions.create(**ask, prompt=prompt, seed=21 + i).choices[0].text
               for prompt in PROMPTS[:2] for i in range(2)]
    assert len(set(singles)) == 4
    ask["seed"] = 21
    if stream:
        texts: dict[int, str] = defaultdict(str)
        for chunk in client.completions.create(**ask, prompt=PROMPTS[:2], n=2, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert [texts[i] for i in range(4)] == singles
    else:
        batch = client.completions.create(**ask, prompt=PROMPTS[:2], n=2)
        assert [c.text for c in batch.choices] == singles


def test_a_batch_of_prompts_scored_as_evaluation_harnesses_score_them(client):
    """lm-evaluation-harness's log-likelihood requests: echo with logprobs, several prompts at once."""
    ask = {"model": MODEL, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    batch = client.completions.create(**ask, prompt=PROMPTS[:3])
    for choice, prompt in zip(batch.choices, PROMPTS[:3]):
        alone = client.completions.create(**ask, prompt=prompt).choices[0]
        assert choice.text == alone.text and choice.text.startswith(prompt)
        assert choice.logprobs.token_logprobs == alone.logprobs.token_logprobs
        assert choice.logprobs.text_offset == alone.logprobs.text_offset


def test_a_batch_of_prompts_is_checked_prompt_by_prompt(server):
    running, _ = server
    for prompt, words in [(["hi"] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS} prompts"),
                          (["hi", ""], "empty"), (["hi", [1, 2]], "not both"), (["hi", [1, "a"]], "not both"),
                          ([[1, 2], [1, "a"]], "a string or a list of token ids"),
                          (["hi", "the " * 200], "maximum context length")]:
        reply = post(running.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert reply.status_code == 400 and words in openai_error(reply)["message"], reply.text
    for ids in ([[1, 2], [-1]], [[2**70]], [[1, 10**6]]):  # out of the vocabulary, echoed too (it decodes them)
        for echo in (False, True):
            body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "echo": echo}
            reply = post(running.url, "/v1/completions", body)
            assert reply.status_code == 400 and "Token ids must lie in" in openai_error(reply)["message"], reply.text


@pytest.mark.parametrize("backlog, ended", [(3, True), (4, False)])
def test_a_stream_whose_client_stops_reading_ends_its_generation(monkeypatch, backlog, ended):
    """Items a stream holds unread past BACKLOG end its generation where it is, as its deadline would (the worker
    expires a job past its deadline: `test_serve_limits`): an unread stream's answers filled memory to the end."""
    import asyncio
    import math
    from types import SimpleNamespace

    from specdecode.serve import replies

    monkeypatch.setattr(replies, "BACKLOG", backlog)

    async def pumped():
        job = SimpleNamespace(events=asyncio.Queue(), deadline=math.inf)
        for item in [0, 1, 2, RuntimeError("its last item")]:  # (an error ends the pump, as a result does)
            job.events.put_nowait(item)
        merged: asyncio.Queue = asyncio.Queue()
        await replies._pump(job, 0, merged)
        return job.deadline, merged.qsize()

    deadline, held = asyncio.run(pumped())
    assert held == 4 and (deadline == -math.inf) == ended
