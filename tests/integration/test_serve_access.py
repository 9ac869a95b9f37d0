"""Who may talk to the server: API keys as OpenAI's `Authorization: Bearer` (one per flag, 16 characters at
least), required beyond loopback; a Host allow-list against DNS rebinding; no cross-site requests (JSON
bodies only, a foreign `Origin` refused unless allowed); /docs off by default; /metrics behind the key."""

from __future__ import annotations

import sys

import openai
import pytest
from fastapi import FastAPI
from websockets.sync.client import connect

from conftest import run_cli
from specdecode.api import load_models
from specdecode.cli import main
from specdecode.errors import UserError
from specdecode.serve.app import Server, ServerThread, create_app
from specdecode.serve.guard import Guard, check_exposure
from test_demo_page import CHROMIUM, Browser
from test_serve import get, openai_error, post, request

MODEL = "tiny"
KEYS = ("key-one-0123456789", "key-two-0123456789")  # at least 16 characters each

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tiny_folder):
    return load_models(str(tiny_folder), None, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def keyed(models):
    running = ServerThread(create_app(Server(models, MODEL, "ar", methods=["ar"]), Guard(api_keys=KEYS)))
    yield running
    running.stop()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_every_endpoint_but_the_page_and_health_needs_the_key(keyed):
    for path in ["/v1/models", "/v1/methods"]:
        missing, wrong = get(keyed.url, path), get(keyed.url, path, bearer("key-three"))
        assert missing.status_code == wrong.status_code == 401
        assert openai_error(missing)["code"] == openai_error(wrong)["code"] == "invalid_api_key"
        assert "key-three" not in wrong.text and missing.headers["www-authenticate"] == "Bearer"
        assert get(keyed.url, path, bearer(KEYS[1])).status_code == 200
    refused = post(keyed.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 401
    assert get(keyed.url, "/health").status_code == get(keyed.url, "/").status_code == 200


METRICS_KEY = "metrics-key-0123456789"


@pytest.mark.parametrize("keys, metrics_key, answers", [
    (KEYS[:1], None, {KEYS[0]: 200, "key-three-0123456789": 401, None: 401}),  # one tenant: its key
    (KEYS, None, {KEYS[0]: 403, KEYS[1]: 403}),  # several: none of theirs (every tenant's traffic)
    (KEYS, METRICS_KEY, {KEYS[0]: 401, METRICS_KEY: 200, None: 401}),
    ((), METRICS_KEY, {METRICS_KEY: 200, None: 401}),
])
def test_metrics_answer_to_one_tenant_or_to_their_own_key(models, keys, metrics_key, answers):
    """/metrics counts every tenant's requests (their prompts' and answers' sizes, what was accepted): a tenant's
    key read what the others sent. With several keys it answers only to `--metrics-key`."""
    guard = Guard(api_keys=keys, metrics_key=metrics_key)
    running = ServerThread(create_app(Server(models, MODEL, "ar", methods=["ar"]), guard))
    try:
        got = {key: get(running.url, "/metrics", bearer(key) if key else None).status_code for key in answers}
        if metrics_key is None and len(keys) > 1:
            assert "--metrics-key" in openai_error(get(running.url, "/metrics", bearer(KEYS[0])))["message"]
        if keys:  # the tenants' own endpoints answer to their keys as before
            assert get(running.url, "/v1/models", bearer(keys[-1])).status_code == 200
    finally:
        running.stop()
    assert got == answers


def test_the_official_client_sends_its_key(keyed):
    reply = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEYS[0], max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "the cat"}], max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens <= 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_docs_are_off_unless_asked_for_and_then_behind_the_key(keyed, models):
    assert get(keyed.url, "/docs", bearer(KEYS[0])).status_code == 404
    assert get(keyed.url, "/openapi.json", bearer(KEYS[0])).status_code == 404
    documented = ServerThread(create_app(Server(models, MODEL, "ar", methods=["ar"]), Guard(api_keys=KEYS, docs=True)))
    try:
        assert get(documented.url, "/openapi.json").status_code == 401
        assert "/v1/completions" in get(documented.url, "/openapi.json", bearer(KEYS[0])).json()["paths"]
        assert get(documented.url, "/docs", bearer(KEYS[0])).status_code == 200
    finally:
        documented.stop()


def test_a_wrong_host_is_refused(keyed, models):
    port = keyed.url.rsplit(":", 1)[1]
    for host in ["evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", ""]:
        reply = get(keyed.url, "/health", {"host": host})
        assert reply.status_code == 400 and openai_error(reply)["code"] == "invalid_host", host
    for host in [f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST.", f"[::1]:{port}"]:
        assert get(keyed.url, "/health", {"host": host}).status_code == 200, host
    anyone = ServerThread(create_app(Server(models, MODEL, "ar", methods=["ar"]), Guard(allowed_hosts=("*",))))
    try:
        assert get(anyone.url, "/health", {"host": "evil.example"}).status_code == 200
    finally:
        anyone.stop()


def test_a_server_beyond_loopback_needs_a_key():
    for host in ["0.0.0.0", "::", "192.168.1.20", "example.com"]:
        with pytest.raises(UserError, match="API key"):
            Guard.for_address(host)
        guard = Guard.for_address(host, api_keys=KEYS, allowed_hosts=("my.server",))
        assert "my.server" in guard.allowed_hosts and "localhost" in guard.allowed_hosts
    for host in ["127.0.0.1", "localhost", "::1", "127.0.0.2"]:
        check_exposure(host, Guard())
    unkeyed = FastAPI()  # never served: refused before it binds
    unkeyed.state.guard = Guard()
    with pytest.raises(UserError, match="API key"):
        ServerThread(unkeyed, host="0.0.0.0")


def test_the_command_refuses_to_listen_beyond_loopback_without_a_key(monkeypatch, capsys, tiny_folder):
    monkeypatch.delenv("SPECDECODE_API_KEY", raising=False)
    monkeypatch.setattr(sys, "argv", ["specdecode", "serve", "--host", "0.0.0.0", "--target", str(tiny_folder),
                                      "--no-drafter", "--method", "ar"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert "API key" in capsys.readouterr().err


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (`make chromium` installs it)")
def test_the_page_asks_for_the_key(keyed, tmp_path):
    browser = Browser(tmp_path / "profile")
    try:
        with connect(browser.address, max_size=2**26, open_timeout=30) as socket:
            browser.socket = socket
            browser.call("Page.navigate", url=keyed.url + "/")
            assert "API key" in browser.wait_for("document.getElementById('panes')?.textContent")
            assert browser.js("document.getElementById('key-label').hidden") is False
            browser.js(f"const key = document.getElementById('api-key'); key.value = '{KEYS[1]}'; "
                       "key.dispatchEvent(new Event('change'))")
            browser.wait_for("document.querySelectorAll('#method option').length > 0")
            browser.js("document.getElementById('max-tokens').value = '4'; document.getElementById('run').click()")
            browser.wait_for("!document.getElementById('run').disabled && document.querySelectorAll('.tok').length > 0")
            assert browser.js("document.querySelectorAll('.output .tok').length") == 4
    finally:
        browser.close()


# --- Keys, one per flag -----------------------------------------------------------------------------


def test_an_api_key_is_one_word_of_at_least_16_characters():
    with pytest.raises(UserError, match="at least 16 characters"):
        Guard(api_keys=(KEYS[0], "fifteen-chars-k"))
    with pytest.raises(UserError, match="one word"):
        Guard(api_keys=("correct horse battery staple",))
    assert Guard(api_keys=("sixteen-chars-ok",)).tenant("Bearer sixteen-chars-ok") is not None


@pytest.mark.parametrize("args, words", [
    (["--api-key", "correct horse battery staple"], "one word"),  # once four one-word keys, one of 5 letters
    (["--api-key", "a b"], "one word"),  # once two keys, passing the exposure check
    (["--api-key", KEYS[0], "--api-key", "short-key"], "at least 16 characters"),
    (["--api-key", "  "], "one word"),
    (["--api-key", KEYS[0], "--allowed-origin", "http://localhost:3000/app"], "allowed origin"),
])
def test_the_command_refuses_a_bad_key_or_origin_in_one_line(monkeypatch, capsys, tiny_folder, args, words):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **options: app.state.server.worker.stop())  # were it to start
    monkeypatch.delenv("SPECDECODE_API_KEY", raising=False)
    code, out, err = run_cli(monkeypatch, capsys, "serve", "--host", "0.0.0.0", "--target", str(tiny_folder),
                             "--no-drafter", "--method", "ar", *args)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in out + err
    assert words in " ".join(err.split()), err  # one message (wrapped to the terminal's width)


@pytest.mark.parametrize("variable, flags", [
    (None, ["--api-key", KEYS[0], "--api-key", KEYS[1]]),  # each flag one key
    (f" {KEYS[0]}  {KEYS[1]}\n", []),  # the variable split on whitespace
])
def test_the_command_installs_one_key_per_flag_and_splits_the_variable(monkeypatch, capsys, tiny_folder, variable,
                                                                       flags):
    import uvicorn

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **options: served.update(app=app))
    if variable is None:
        monkeypatch.delenv("SPECDECODE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("SPECDECODE_API_KEY", variable)
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--host", "0.0.0.0", "--target", str(tiny_folder),
                           "--no-drafter", "--method", "ar", "--dtype", "float32",
                           "--allowed-origin", "HTTP://LocalHost:3000/", *flags)
    assert code == 0, err
    served["app"].state.server.worker.stop()
    assert served["app"].state.guard.api_keys == KEYS
    assert served["app"].state.guard.allowed_origins == ("http://localhost:3000",)  # as a browser writes it


# --- Cross-site requests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyless(models):
    running = ServerThread(create_app(Server(models, MODEL, "ar", methods=["ar"]), Guard()))
    yield running
    running.stop()


COMPLETION = {"model": MODEL, "prompt": "the cat", "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize("content_type", [
    "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/jsonp", "", None])
def test_a_body_not_declared_json_is_refused_with_415(keyless, content_type):
    """The content types a web page's form or `fetch` may send to another site without a preflight, and
    none at all: a body read as JSON anyway would let any page the user visits make the server work."""
    for path in ["/v1/completions", "/v1/chat/completions"]:
        reply = post(keyless.url, path, COMPLETION, {"content-type": content_type})
        assert reply.status_code == 415 and openai_error(reply)["code"] == "unsupported_media_type", reply.text


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_a_json_body_is_taken_with_or_without_its_charset(keyless, content_type):
    reply = post(keyless.url, "/v1/completions", COMPLETION, {"content-type": content_type})
    assert reply.status_code == 200, reply.text


def test_a_request_from_another_sites_page_is_refused_with_403(keyless):
    port = keyless.url.rsplit(":", 1)[1]
    for origin in ["http://evil.com", f"http://evil.com:{port}", f"http://localhost:{int(port) + 1}", "null",
                   f"https://127.0.0.1:{port}.evil.com", "http://localhost:3001"]:
        reply = post(keyless.url, "/v1/completions", COMPLETION, {"origin": origin})
        assert reply.status_code == 403 and openai_error(reply)["code"] == "invalid_origin", origin
        assert "access-control-allow-origin" not in reply.headers
    # the page's own origin (as a browser writes it: the Host header's host and port), and no origin at all
    for host, origin in [(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"),
                         (f"localhost:{port}", f"http://localhost:{port}"), (None, None)]:
        reply = post(keyless.url, "/v1/completions", COMPLETION, {"host": host, "origin": origin})
        assert reply.status_code == 200, (origin, reply.text)
    # what costs no work is answered to any page (a browser keeps the answer from it without CORS)
    for path in ["/v1/models", "/health", "/metrics", "/"]:
        assert get(keyless.url, path, {"origin": "http://evil.com"}).status_code == 200, path


def test_an_allowed_origins_page_may_call_the_api_with_cors(models):
    allowed = {"origin": "http://localhost:3000"}
    keyed = ServerThread(create_app(Server(models, MODEL, "ar", methods=["ar"]),
                                    Guard(api_keys=KEYS, allowed_origins=("HTTP://LocalHost:3000/",))))
    try:
        reply = post(keyed.url, "/v1/completions", COMPLETION, {**allowed, **bearer(KEYS[0])})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == allowed["origin"]
        # a browser's preflight carries no key; a refusal reaches the page too
        preflight = request(keyed.url, "OPTIONS", "/v1/chat/completions", None, {
            **allowed, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == allowed["origin"]
        assert {"authorization", "content-type"} <= set(preflight.headers["access-control-allow-headers"].lower()
                                                        .replace(" ", "").split(","))
        refused = post(keyed.url, "/v1/completions", COMPLETION, allowed)
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == allowed["origin"]
        other = request(keyed.url, "OPTIONS", "/v1/completions", None, {
            "origin": "http://evil.com", "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in other.headers
        other = post(keyed.url, "/v1/completions", COMPLETION, {"origin": "http://evil.com", **bearer(KEYS[0])})
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    finally:
        keyed.stop()


@pytest.mark.parametrize("origin", ["localhost:3000", "http://localhost:3000/app", "http://", "http://a:b",
                                    "http://user@localhost", "null", "*"])
def test_an_allowed_origin_must_be_an_origin(origin):
    with pytest.raises(UserError, match="allowed origin"):
        Guard(allowed_origins=(origin,))
