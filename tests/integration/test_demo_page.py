"""The demonstration page in headless Chromium (Debian's `chromium`, driven over the DevTools protocol):
it loads, a prompt streams, coloured tokens appear, the race runs; a screenshot is kept in
`results/artifacts/demo-page.png`."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from websockets.sync.client import connect

from specdecode.api import load_models
from specdecode.serve.app import Server, ServerThread, create_app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[2] / "results" / "artifacts"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (`make chromium` installs it)")


class Browser:
    """One headless Chromium page, commanded through the Chrome DevTools Protocol."""

    def __init__(self, profile: Path):
        with socket.socket() as probe:  # a free port for the DevTools protocol
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={port}",
             f"--user-data-dir={profile}", "--window-size=1200,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as response:
                    pages = [t for t in json.load(response) if t["type"] == "page"]
                if pages:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "chromium did not start"
            time.sleep(0.2)
        self.address = pages[0]["webSocketDebuggerUrl"]
        self.socket = None  # connected by the fixture, for the test's duration
        self.ids = itertools.count(1)

    def call(self, method: str, **params) -> dict:
        ident = next(self.ids)
        self.socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == ident:
                assert "error" not in message, message
                return message["result"]

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_for(self, expression: str, seconds: float = 60):
        deadline = time.monotonic() + seconds
        while not (value := self.js(expression)):
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.1)
        return value

    def close(self):
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def page_url(tiny_folder):
    models = load_models(str(tiny_folder), str(tiny_folder), dtype="float32", progress=False)
    running = ServerThread(create_app(Server(models, "tiny", default_method="draft-tree-fixed")))
    yield running.url + "/"
    running.stop()


@pytest.fixture
def browser(tmp_path):
    browser = Browser(tmp_path / "profile")
    try:
        with connect(browser.address, max_size=2**26, open_timeout=30) as socket:
            browser.socket = socket
            yield browser
    finally:
        browser.close()


def test_the_page_streams_coloured_tokens(browser, page_url):
    browser.call("Page.enable")
    browser.call("Page.navigate", url=page_url)
    browser.wait_for("document.querySelectorAll('#method option').length > 3")  # methods came from the server
    assert browser.js("document.getElementById('method').value") == "draft-tree-fixed"
    browser.js("document.getElementById('prompt').value = 'the cat sat on the mat'; "
               "document.getElementById('max-tokens').value = '40'; document.getElementById('run').click()")
    browser.wait_for("!document.getElementById('run').disabled && document.querySelectorAll('.tok').length > 0")
    origins = browser.js("[...document.querySelectorAll('.output .tok')].map(t => t.classList[1])")
    assert len(origins) == 40 and "accepted" in origins and set(origins) <= {"accepted", "corrected", "bonus", "target"}
    stats = browser.js("document.querySelector('.stats').textContent")
    assert "tokens/s" in stats and "tokens per target forward" in stats and "acceptance" in stats

    browser.js("document.getElementById('race').click()")
    browser.wait_for("document.getElementById('race-result') !== null")
    panes = browser.js("[...document.querySelectorAll('.pane')].map(p => p.querySelectorAll('.tok').length)")
    assert panes == [40, 40]
    texts = browser.js("[...document.querySelectorAll('.pane .output')].map(o => "
                       "[...o.querySelectorAll('.tok')].map(t => t.textContent).join(''))")
    assert texts[0] == texts[1]  # plain and speculative decoding give the same answer
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = browser.call("Page.captureScreenshot", format="png")["data"]
    (ARTIFACTS / "demo-page.png").write_bytes(base64.b64decode(shot))
    assert (ARTIFACTS / "demo-page.png").stat().st_size > 10_000


def test_the_page_reports_a_server_error(browser, page_url):
    browser.call("Page.navigate", url=page_url)
    browser.wait_for("document.querySelectorAll('#method option').length > 3")
    browser.js("document.getElementById('max-tokens').value = '100000'; document.getElementById('run').click()")
    message = browser.wait_for("document.querySelector('.error')?.textContent")
    assert "maximum context length" in message


def test_the_page_says_when_an_answer_stopped_short(browser, page_url):
    """Stopped by the user, or its connection lost mid-answer (a read that fails, or a stream that ends without
    [DONE]), the page says so under the partial answer: it used to keep a stopped answer's figures as if it had
    ended, and to say only "network error". The key field is locked while a run goes on (a new key reloaded the
    page's lists under it)."""
    browser.call("Page.navigate", url=page_url)
    browser.wait_for("document.querySelectorAll('#method option').length > 3")
    slow = ("const read = ReadableStreamDefaultReader.prototype.read, held = new WeakMap(); "  # 100 bytes a read
            "ReadableStreamDefaultReader.prototype.read = async function () { "
            "await new Promise(r => setTimeout(r, 20)); let rest = held.get(this); "
            "if (!rest || !rest.length) { const got = await read.call(this); if (got.done) return got; "
            "rest = got.value; } held.set(this, rest.slice(100)); return {done: false, value: rest.slice(0, 100)}; };")
    browser.js(slow + "document.getElementById('prompt').value = 'the cat sat on the mat'; "
               "document.getElementById('max-tokens').value = '60'; document.getElementById('run').click()")
    browser.wait_for("document.querySelectorAll('.tok').length > 0")
    assert browser.js("document.getElementById('api-key').disabled")
    browser.js("document.getElementById('stop').click()")
    assert "stopped" in browser.wait_for("document.querySelector('.error')?.textContent")
    assert not browser.js("document.getElementById('api-key').disabled")
    for failing in ("throw new TypeError('network error')", "return {done: true, value: undefined}"):
        browser.call("Page.navigate", url=page_url)
        browser.wait_for("document.querySelectorAll('#method option').length > 3")
        browser.js(slow + "const sliced = ReadableStreamDefaultReader.prototype.read; let calls = 0; "
                   "ReadableStreamDefaultReader.prototype.read = async function () { "
                   f"if (++calls > 3) {{ {failing}; }} return sliced.call(this); }}; "
                   "document.getElementById('prompt').value = 'the cat sat on the mat'; "
                   "document.getElementById('max-tokens').value = '60'; document.getElementById('run').click()")
        message = browser.wait_for("document.querySelector('.error')?.textContent")
        assert "connection to the server was lost" in message, message
