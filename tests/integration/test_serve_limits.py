"""What one request may cost the server, on the tiny model.

Clients that leave (streaming or not; batched or alone) stop their generation within one step, counted
on a drafter that waits at every step until the test lets it go on, so no count depends on how fast the
machine is. Also: a full queue answers 429 with Retry-After; a request past its deadline ends where it
is; max_tokens has a server maximum and a default (null: the endpoint's default); a method being prepared
answers 503 while the others run to the end; a 50 MB body is refused from its headers while health checks
answer, and a 413 or 415 reaches a client that sends its whole body before reading; slow clients are cut off; a
prompt too long for the context by its bytes alone is refused before it is tokenized."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdecode.api import Models, load_models
from specdecode.drafters.base import Drafter
from specdecode.engine import SpeculativeEngine
from specdecode.errors import UserError
from specdecode.serve.app import Limits, Server, ServerThread, create_app
from specdecode.serve.guard import Guard
from specdecode.types import Draft
from test_serve import get, metric, openai_error, post

MODEL = "tiny"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tiny_folder):
    return load_models(str(tiny_folder), str(tiny_folder), dtype="float32", progress=False)


class GatedDrafter(Drafter):
    """Drafts nothing, but waits at every step until the test lets it go on; counts the steps begun."""

    name = "gated"

    def __init__(self, batchable: bool):
        self.batchable = batchable
        self.steps = 0
        self.begun = threading.Semaphore(0)  # released as each step begins
        self.gate = threading.Semaphore(0)  # each step takes one to end

    def propose(self, context, max_tokens, params, generator) -> Draft:
        self.steps += 1
        self.begun.release()
        if not self.gate.acquire(timeout=120):
            raise RuntimeError("the test never let the step end")
        return Draft.empty()

    def wait_for_step(self) -> None:
        assert self.begun.acquire(timeout=60), "no step began"

    def for_sequence(self, memory=None) -> GatedDrafter:
        return self  # every batched sequence's: the test holds them all at one gate


@contextlib.contextmanager
def serving(models: Models, drafter: GatedDrafter | None = None, limits: Limits = Limits(), guard: Guard = Guard(),
            **options):
    """A server on loopback; with a drafter, `pld` (batched) and `draft` (alone) draft with it."""
    if drafter is not None:
        plain = models
        models = dataclasses.replace(plain)  # its `drafter` is replaced, the module's models are not
        models.drafter_for = lambda choice: drafter if choice.name == "pld" else plain.drafter_for(choice)
    options.setdefault("methods", ["pld", "ar", "draft"])
    state = Server(models, MODEL, default_method=options["methods"][0], limits=limits, **options)
    if drafter is not None:
        state.engines.shared["draft"] = SpeculativeEngine(models.target, models.tokenizer, drafter, method="draft")
    running = ServerThread(create_app(state, guard))
    try:
        yield running, state
    finally:
        if drafter is not None:
            drafter.gate.release(10_000)
        running.stop()


def wait_until(condition, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def raw_post(url: str, body: bytes, path: str = "/v1/completions") -> socket.socket:
    """A connection that has sent one POST to `path` and reads nothing yet."""
    connection = socket.create_connection(address(url), timeout=60)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    connection.sendall(head + body)
    return connection


def read_until(connection: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = connection.recv(65536)
        assert chunk, f"the connection closed before {marker!r}: {data!r}"
        data += chunk
    return data


def completion(method: str, max_tokens: int, stream: bool = False, **extra) -> dict:
    return {"model": MODEL, "prompt": "the cat sat", "max_tokens": max_tokens, "temperature": 0, "method": method,
            "stream": stream, **extra}


# --- Clients that leave -----------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "responses"])
@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("method", ["pld", "draft"], ids=["batched", "alone"])
def test_a_client_that_leaves_stops_its_generation_within_one_step(models, method, streaming, endpoint):
    drafter = GatedDrafter(batchable=method == "pld")
    with serving(models, drafter) as (running, state):
        body = completion(method, 50, streaming) if endpoint == "completions" else {
            "model": MODEL, "input": "the cat sat", "max_output_tokens": 50, "temperature": 0, "method": method,
            "stream": streaming}
        connection = raw_post(running.url, json.dumps(body).encode(), f"/v1/{endpoint}")
        drafter.wait_for_step()
        if streaming:  # the first step's tokens reach the client; the second step begins
            drafter.gate.release()
            read_until(connection, b"data: ")
            drafter.wait_for_step()
        connection.close()  # while a step is under way
        wait_until(lambda: metric(running.url, "specdecode_cancelled_requests_total") == 1,
                   "the server to notice the client leaving")
        steps_when_it_left = drafter.steps
        drafter.gate.release(10_000)
        # the worker goes on to the next request: the one that left is dropped before any further step
        reply = post(running.url, "/v1/completions", completion("ar", 4))
        assert reply.status_code == 200, reply.text
        assert drafter.steps == steps_when_it_left == (2 if streaming else 1)
        assert metric(running.url, f'specdecode_requests_total{{endpoint="/v1/{endpoint}",status="499"}}') == (
            0 if streaming else 1)  # a streamed answer had begun (200)


@pytest.mark.parametrize("method", ["pld", "draft"], ids=["batched", "alone"])
def test_a_request_past_its_deadline_ends_where_it_is(models, method):
    drafter = GatedDrafter(batchable=method == "pld")
    with (serving(models, drafter, limits=Limits(request_seconds=1.0)) as (running, state),
          ThreadPoolExecutor(1) as pool):
        answer = pool.submit(post, running.url, "/v1/completions", completion(method, 50))
        drafter.wait_for_step()  # it began before its deadline
        time.sleep(1.2)  # the step is held past the deadline
        drafter.gate.release(10_000)
        reply = answer.result(timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        assert reply.json()["usage"]["completion_tokens"] == 1  # the one step it had made
        assert drafter.steps == 1
        assert metric(running.url, "specdecode_expired_requests_total") == 1


def test_a_full_queue_answers_429_with_retry_after(models):
    drafter = GatedDrafter(batchable=True)
    with serving(models, drafter, limits=Limits(max_queue=1)) as (running, state), ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, running.url, "/v1/completions", completion("pld", 2))
        drafter.wait_for_step()  # the first is decoding: it left the queue
        second = pool.submit(post, running.url, "/v1/completions", completion("pld", 2))
        wait_until(lambda: metric(running.url, "specdecode_waiting_requests") == 1, "the second to queue")
        third = post(running.url, "/v1/completions", completion("pld", 2))
        assert third.status_code == 429
        assert openai_error(third)["code"] == "queue_full"
        assert int(third.headers["retry-after"]) >= 1
        drafter.gate.release(10_000)
        assert first.result(timeout=60).status_code == second.result(timeout=60).status_code == 200
        assert metric(running.url, "specdecode_waiting_requests") == 0


def test_each_sampled_choice_takes_a_place_in_the_queue(models):
    """A request of n sampled choices runs n generations: it needs n places, or gets 429 and holds none; one that
    needs more places than the queue has gets 400, not a 429 that no retry could get past."""
    with serving(models, limits=Limits(max_queue=2)) as (running, state):
        sampled = {**completion("pld", 4), "temperature": 1.0, "seed": 3}
        never = post(running.url, "/v1/completions", {**sampled, "n": 3})
        assert never.status_code == 400 and openai_error(never)["code"] == "too_many_generations", never.text
        batch = post(running.url, "/v1/completions", {**sampled, "prompt": [[1, 2]] * 3})
        assert batch.status_code == 400 and openai_error(batch)["code"] == "too_many_generations", batch.text
        assert state.worker.enter()  # another request waits
        over = post(running.url, "/v1/completions", {**sampled, "n": 2})
        assert over.status_code == 429 and openai_error(over)["code"] == "queue_full"
        state.worker.leave()
        assert state.worker.queued == 0  # the places it took are given back
        for n, body in [(2, sampled), (3, {**sampled, "temperature": 0})]:  # greedy copies take one place
            reply = post(running.url, "/v1/completions", {**body, "n": n})
            assert reply.status_code == 200, reply.text
            assert len(reply.json()["choices"]) == n


# --- Tokens ------------------------------------------------------------------------------------------


def test_max_tokens_has_a_server_maximum_and_a_default(models):
    with serving(models, limits=Limits(max_tokens=12, default_max_tokens=5)) as (running, _):
        over = post(running.url, "/v1/completions", completion("ar", 13))
        assert over.status_code == 400 and openai_error(over)["param"] == "max_tokens"
        assert "at most 12" in openai_error(over)["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}], "temperature": 0, "method": "ar"}
        reply = post(running.url, "/v1/chat/completions", chat)
        assert reply.status_code == 200, reply.text
        usage, finish = reply.json()["usage"], reply.json()["choices"][0]["finish_reason"]
        assert usage["completion_tokens"] == 5 or (usage["completion_tokens"] < 5 and finish == "stop")
        both = post(running.url, "/v1/chat/completions", {**chat, "max_tokens": 3, "max_completion_tokens": 4})
        assert both.status_code == 400 and "not both" in openai_error(both)["message"]
        newer = post(running.url, "/v1/chat/completions", {**chat, "max_completion_tokens": 3})
        assert newer.json()["usage"]["completion_tokens"] <= 3
        # min_tokens above the default, no limit named: the answer may have min_tokens (within the maximum)
        longer = post(running.url, "/v1/chat/completions", {**chat, "min_tokens": 8, "ignore_eos": True})
        assert longer.status_code == 200 and longer.json()["usage"]["completion_tokens"] == 8, longer.text
        beyond = post(running.url, "/v1/chat/completions", {**chat, "min_tokens": 13})
        assert beyond.status_code == 400 and openai_error(beyond)["param"] == "min_tokens", beyond.text
    # a completion that names no max_tokens asks for OpenAI's 16, or the server's maximum where that is less
    for most, want in ((12, 12), (20, 16)):
        with serving(models, limits=Limits(max_tokens=most, default_max_tokens=5)) as (running, _):
            body = {**completion("ar", 1), "ignore_eos": True}
            for unnamed in ({k: v for k, v in body.items() if k != "max_tokens"}, {**body, "max_tokens": None}):
                reply = post(running.url, "/v1/completions", unnamed)
                assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == want, reply.text


def test_a_null_max_tokens_means_the_endpoints_default(models):
    """OpenAI's API reads null as a field left out: on /v1/completions that is 16 tokens (OpenAI's), on chat
    the server's --default-max-tokens (OpenAI's: the rest of the context), here 5 and 30 apart."""
    with serving(models, limits=Limits(max_tokens=40, default_max_tokens=30), methods=["ar"]) as (running, _):
        for body in [completion("ar", None), {k: v for k, v in completion("ar", 1).items() if k != "max_tokens"}]:
            reply = post(running.url, "/v1/completions", body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 16, body
            assert reply.json()["choices"][0]["finish_reason"] == "length"
    with serving(models, limits=Limits(max_tokens=40, default_max_tokens=5), methods=["ar"]) as (running, _):
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}], "temperature": 0}
        for limits in [{}, {"max_tokens": None}, {"max_completion_tokens": None},
                       {"max_tokens": None, "max_completion_tokens": None}]:
            reply = post(running.url, "/v1/chat/completions", {**chat, **limits})
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 5, limits
            assert reply.json()["choices"][0]["finish_reason"] == "length"


def test_a_prompt_too_long_by_its_bytes_is_refused_before_tokenizing(models):
    with serving(models, methods=["ar"]) as (running, state):
        calls = []
        encode = state._encode_completion
        state._encode_completion = lambda prompt: calls.append(prompt) or encode(prompt)
        limit = state.prompt_bytes  # the context times the most bytes a token stands for
        assert limit >= models.target.max_context * len("<|endoftext|>")
        by_bytes = post(running.url, "/v1/completions", completion("ar", 4, prompt="x" * (limit + 1)))
        assert by_bytes.status_code == 400 and "bytes cannot fit" in openai_error(by_bytes)["message"]
        assert openai_error(by_bytes)["code"] == "context_length_exceeded" and not calls
        by_tokens = post(running.url, "/v1/completions", completion("ar", 4, prompt="x" * (limit // 2)))
        assert by_tokens.status_code == 400 and "prompt tokens" in openai_error(by_tokens)["message"]
        assert openai_error(by_tokens)["param"] == "prompt" and len(calls) == 1


# --- Methods being prepared ---------------------------------------------------------------------------


def test_a_cold_method_answers_503_while_the_others_run(models):
    begun, release = threading.Event(), threading.Event()
    slow = dataclasses.replace(models)

    def drafter_for(choice):
        if choice.name == "jacobi":  # a long preparation (a layer search, say), held by the test
            begun.set()
            release.wait(120)
        return Models.drafter_for(slow, choice)

    slow.drafter_for = drafter_for  # (a method that joins the batch is prepared by its drafter; the others' engines
    # are built through it too)
    state = Server(slow, MODEL, default_method="pld", methods=["pld", "ar", "jacobi", "lookahead", "eagle"],
                   prepare=["pld", "ar"])
    running = ServerThread(create_app(state))
    try:
        status = {m["id"]: m["status"] for m in get(running.url, "/v1/methods").json()["data"]}
        assert status == {"pld": "ready", "ar": "ready", "jacobi": "cold", "lookahead": "cold", "eagle": "cold"}
        cold = post(running.url, "/v1/completions", completion("jacobi", 4))  # its first request starts it
        assert begun.is_set()
        assert cold.status_code == 503 and openai_error(cold)["code"] == "method_not_ready"
        assert int(cold.headers["retry-after"]) >= 1
        assert {m["id"]: m["status"] for m in get(running.url, "/v1/methods").json()["data"]}["jacobi"] == "preparing"
        # meanwhile the others are served to the end: the preparation stalls them by no step at all
        for method in ["pld", "ar"]:
            reply = post(running.url, "/v1/completions", completion(method, 8))
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
        # a method whose preparation is quick is served on its first request
        assert post(running.url, "/v1/completions", completion("lookahead", 4)).status_code == 200
        release.set()
        state.wait_until_prepared(60)
        assert post(running.url, "/v1/completions", completion("jacobi", 4)).status_code == 200
        # a method that cannot run here (no trained head for this target) says why, as a 400
        eagle = post(running.url, "/v1/completions", completion("eagle", 4))
        assert eagle.status_code == 400 and openai_error(eagle)["code"] == "method_unavailable"
        methods = {m["id"]: m for m in get(running.url, "/v1/methods").json()["data"]}
        assert methods["jacobi"]["status"] == "ready"
        assert methods["eagle"]["status"] == "unavailable" and methods["eagle"]["reason"]
    finally:
        release.set()
        running.stop()


def test_methods_can_be_restricted(models):
    with serving(models, methods=["ar"]) as (running, _):
        reply = post(running.url, "/v1/completions", completion("pld", 4))
        assert reply.status_code == 400 and openai_error(reply)["code"] == "unknown_method"
        assert [m["id"] for m in get(running.url, "/v1/methods").json()["data"]] == ["ar"]
    with pytest.raises(UserError, match="no eagle head"):  # named, and it cannot run: refused at start-up
        Server(models, MODEL, default_method="ar", methods=["ar", "eagle"])


# --- Bodies and slow clients ----------------------------------------------------------------------------


def read_response(connection: socket.socket) -> tuple[int, bytes]:
    data = read_until(connection, b"\r\n\r\n")
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += connection.recv(65536)
    return int(head.split()[1]), body


def test_a_50_mb_body_is_refused_from_its_headers_while_health_checks_answer(models):
    with serving(models, methods=["ar"]) as (running, _):
        connection = socket.create_connection(address(running.url), timeout=60)
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 52428800\r\n\r\n")  # and not a byte of the body yet
        status, body = read_response(connection)
        assert status == 413 and b"request_too_large" in body
        assert get(running.url, "/health").status_code == 200
        assert connection.recv(1) == b""  # closed: the rest of the body is never read
        connection.close()


def whole_chunks(size: int, chunk: int = 1 << 16):
    """A body of `size` bytes in chunks (http.client sends an iterable as chunked transfer encoding)."""
    for start in range(0, size, chunk):
        yield b" " * min(chunk, size - start)


@pytest.mark.parametrize("chunked, content_type, status, code", [
    (False, "application/json", 413, "request_too_large"),
    (True, "application/json", 413, "request_too_large"),
    (False, "text/plain", 415, "unsupported_media_type"),
], ids=["413-content-length", "413-chunked", "415"])
def test_an_early_refusal_reaches_a_client_that_sends_its_whole_body_before_reading(models, chunked, content_type,
                                                                                     status, code):
    """Python's http.client sends the whole body, then reads. The server refuses early (from the headers,
    or once a chunked body passes the limit); closing then, with the body's rest unread, would reset the
    connection, and the client's system would drop the answer with it. 16 MiB is well beyond what the
    sockets' buffers hold on loopback."""
    size = 16 << 20
    with serving(models, methods=["ar"], guard=Guard(max_body_bytes=64 << 10)) as (running, _):
        for _ in range(2):  # and the server goes on answering
            connection = http.client.HTTPConnection(running.url.removeprefix("http://"), timeout=60)
            connection.request("POST", "/v1/completions", body=whole_chunks(size) if chunked else b" " * size,
                               headers={"content-type": content_type})
            response = connection.getresponse()
            assert response.status == status
            assert json.loads(response.read())["error"]["code"] == code
            connection.close()
        assert post(running.url, "/v1/completions", completion("ar", 2)).status_code == 200


def test_a_chunked_body_is_refused_once_it_passes_the_limit(models):
    with serving(models, methods=["ar"], guard=Guard(max_body_bytes=2048)) as (running, _):
        connection = socket.create_connection(address(running.url), timeout=60)
        chunk = b"800\r\n" + b" " * 2048 + b"\r\n"  # 2 KiB a chunk
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n" + chunk * 2 + b"0\r\n\r\n")
        status, _ = read_response(connection)
        assert status == 413
        connection.close()


def test_slow_clients_are_cut_off(models):
    with serving(models, methods=["ar"], guard=Guard(read_seconds=0.5)) as (running, _):
        silent = socket.create_connection(address(running.url), timeout=30)
        half_head = socket.create_connection(address(running.url), timeout=30)
        half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        half_body = socket.create_connection(address(running.url), timeout=30)  # a body that never ends
        half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"mo")
        assert silent.recv(1024) == b"" and half_head.recv(1024) == b""  # closed by the server
        status, body = read_response(half_body)
        assert status == 408 and b"request_timeout" in body
        assert get(running.url, "/health").status_code == 200  # a whole request in time is served
        for connection in (silent, half_head, half_body):
            connection.close()
