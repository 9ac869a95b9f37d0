"""llama.cpp's own speculative decoding, as the peers of the `llamacpp` backend.

- `llama-server` (built by `scripts/build-llama-server.sh` from the llama.cpp sources the pinned
  llama-cpp-python vendors, so both run the same llama.cpp): plain, with the draft model (`-md`), and
  with each of its n-gram modes (`--spec-type ngram-...`), all at their default settings, one slot.
  Requests carry token ids, so both sides decode exactly the same prompt; the prompt cache is off, as
  our engine prefills every prompt too.
- llama-cpp-python's own prompt-lookup drafter (`LlamaPromptLookupDecoding`, 10 tokens).

Timing is wall time around each request, like our engine's (prefill included). Note that llama.cpp's
`ignore_eos` bans end-of-generation tokens while our engine's decodes past them: compare outputs with it
off (the benchmark's default).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

import torch

from specdecode.bench.base import Output, Runner
from specdecode.engine import GenerationConfig
from specdecode.errors import UserError

BUILD_SCRIPT = "scripts/build-llama-server.sh"

# name -> llama-server arguments beyond the model; "{draft}" stands for the draft model's GGUF
SERVER_MODES = {
    "llama-server": [],
    # this llama.cpp loads a -md model but drafts with it only when asked to (--spec-type defaults to none)
    "llama-server-draft": ["-md", "{draft}", "--spec-type", "draft-simple"],
    "llama-server-ngram-simple": ["--spec-type", "ngram-simple"],
    "llama-server-ngram-map-k": ["--spec-type", "ngram-map-k"],
    "llama-server-ngram-mod": ["--spec-type", "ngram-mod"],
    "llama-server-ngram-cache": ["--spec-type", "ngram-cache"],
}


def server_binary() -> Path:
    """llama-server: $SPECDECODE_LLAMA_SERVER, the build script's output, or on PATH."""
    from specdecode.models.loading import cache_dir

    candidates = [os.environ.get("SPECDECODE_LLAMA_SERVER"), cache_dir() / "llama.cpp/bin/llama-server",
                  shutil.which("llama-server")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise UserError(f"llama-server is not built: run {BUILD_SCRIPT} (about 7 minutes, once), or set "
                    "SPECDECODE_LLAMA_SERVER to a llama-server binary")


def _die_with_parent() -> None:
    """In the server's process: be killed when the benchmark dies, however it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process (one slot) on a loopback port, stopped with this object."""

    def __init__(self, model: Path, args: list[str], threads: int, n_ctx: int = 4096, timeout: float = 180.0):
        self.port = _free_port()
        self.n_ctx = n_ctx
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        command = [str(server_binary()), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                   "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", "1", *args]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        weakref.finalize(self, self.process.kill)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise UserError(f"llama-server exited with status {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.process.kill()
        raise UserError(f"llama-server did not come up in {timeout:.0f} s; see {self.log.name}")

    def complete(self, prompt_ids: list[int], config: GenerationConfig) -> tuple[list[int], float, float]:
        """The new tokens, the request's seconds and the server's own prefill seconds."""
        params = config.sampling
        body = {
            "prompt": prompt_ids, "n_predict": config.max_new_tokens, "cache_prompt": False,
            "return_tokens": True, "ignore_eos": config.ignore_eos, "temperature": params.temperature,
            "top_k": params.top_k, "top_p": params.top_p, "seed": config.seed if config.seed is not None else -1,
        }
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as response:
            reply = json.loads(response.read())
        return reply["tokens"], time.perf_counter() - start, reply["timings"]["prompt_ms"] / 1000


def server_runner(models, name: str):
    args = [str(models.require_draft().path) if a == "{draft}" else a for a in SERVER_MODES[name]]
    server = LlamaServer(models.target.path, args, threads=torch.get_num_threads())

    def run(prompt_ids: list[int], config: GenerationConfig) -> Output:
        tokens, seconds, prefill = server.complete(prompt_ids, config)
        return Output(tokens, seconds, None, prefill)

    return Runner(name, True, True, run, max_context=server.n_ctx)  # the server lives as long as `run` holds it


def prompt_lookup_runner(models):
    """llama-cpp-python's Llama with its LlamaPromptLookupDecoding draft (10 tokens, its default)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads, n_ctx = torch.get_num_threads(), 4096
    llm = Llama(model_path=str(models.target.path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10), verbose=False)
    eos = models.target.eos_token_ids

    def run(prompt_ids: list[int], config: GenerationConfig) -> Output:
        params = config.sampling
        if config.seed is not None:
            llm.set_seed(config.seed)
        out: list[int] = []
        start = time.perf_counter()
        prefill = None
        for token in llm.generate(prompt_ids, temp=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                  reset=True):
            prefill = prefill or time.perf_counter() - start
            out.append(token)  # the end-of-sequence token too, as our engine and llama-server count it
            if (token in eos and not config.ignore_eos) or len(out) >= config.max_new_tokens:
                break
        return Output(out, time.perf_counter() - start, None, prefill)

    return Runner("llama-cpp-python-pld", True, True, run, max_context=n_ctx)
