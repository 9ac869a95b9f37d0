"""A server the benchmark starts as a child process on a free loopback port: llama.cpp's llama-server as a
peer (`llamacpp_peers`), or any engine a script puts side by side (benchmarks/engines.py: `specdecode
serve` too). Its output goes to a log file, it is up once `GET /health` answers 200, and it dies with the
process that started it, however that one ends. Also what the scripts that time such a server share: a streamed
request's events as they arrive (`streamed`), and what a run's settings.json says of the run (`run_settings`).
"""

from __future__ import annotations

import ctypes
import http.client
import json
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterator
from pathlib import Path

from specdecode.errors import UserError


def free_port() -> int:
    """A loopback port nobody listens on now (the child binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def streamed(url: str, path: str, body: dict) -> Iterator[tuple[float, dict]]:
    """POST `body` (a streamed request) to `path` of the server at `url` (http://host:port): each server-sent event's
    JSON, with when it arrived (`time.perf_counter()`), as it comes. A status other than 200 raises RuntimeError."""
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=3600)
    try:
        connection.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{body.get('method', path)}: {response.status} {response.read()[:300]!r}")
        for line in response:
            if line.startswith(b"data: {"):
                yield time.perf_counter(), json.loads(line[len(b"data: "):])
    finally:
        connection.close()


def run_settings() -> dict:
    """What a timed run's settings.json says of it: when, on what machine, the command, the commit."""
    from specdecode.models.costs import machine

    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "command": shlex.join(sys.argv),
            "commit": commit()}


def commit() -> str:
    """The checkout's commit, short; where the package is not a checkout's (installed, maybe inside another
    project's repository), its version."""
    package = Path(__file__).resolve().parents[1]
    try:
        found = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], capture_output=True,
                               text=True, check=False, cwd=package)
    except OSError:  # no git
        found = None
    lines = found.stdout.split() if found is not None and found.returncode == 0 else []
    if len(lines) == 2 and Path(lines[0]).resolve() == package.parent:
        return lines[1]
    from importlib import metadata

    try:
        return f"specdecode {metadata.version('specdecode')}"
    except metadata.PackageNotFoundError:
        return "unknown"


def parse_run_arguments(parser, argv, name: str):
    """A served benchmark's arguments, with the ones every such script takes added to `parser`: the target's path and
    torch threads (in-process and served), the report folder (default benchmarks/reports/NAME-<date-time>) and
    --render."""
    from pathlib import Path

    parser.add_argument("--dtype", default="auto", help="the target's path, in-process and served")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, in-process and served")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--render", type=Path, default=None, help="only write DIR's report from its records")
    args = parser.parse_args(argv)
    args.out = args.out or Path("benchmarks/reports") / time.strftime(f"{name}-%Y-%m-%d-%H%M")
    return args


def _die_with_parent() -> None:
    """In the server's process: be killed when the benchmark dies, however it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    """`command` (which listens on `port` of 127.0.0.1) as a child process; `wait_until_up`, then `url`;
    `stop()`, or a `with` block, ends it."""

    def __init__(self, name: str, command: list[str], port: int):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name.replace(' ', '-')}-", suffix=".log", delete=False)
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                        preexec_fn=_die_with_parent)
        weakref.finalize(self, self.process.kill)

    def wait_until_up(self, timeout: float) -> None:
        """Return once `/health` answers 200; a one-line UserError naming the log if the server exits or
        does not answer within `timeout` seconds (it is then stopped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise UserError(f"{self.name} exited with status {self.process.returncode} ({self._last_words()}); "
                                f"see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise UserError(f"{self.name} did not come up in {timeout:.0f} s; see {self.log.name}")

    def _last_words(self) -> str:
        """The log's last error message, its lines joined (a console wraps them), else its last line."""
        self.log.flush()
        with open(self.log.name, errors="replace") as log:
            lines = [line.strip() for line in log if line.strip()]
        errors = [i for i, line in enumerate(lines) if "error" in line.lower()]
        words = " ".join(lines[errors[-1]:]) if errors else lines[-1] if lines else "no output"
        return words if len(words) <= 300 else words[:297] + "..."

    def stop(self) -> None:
        """Ask the server to end (SIGTERM), and kill it if it has not within ten seconds."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
