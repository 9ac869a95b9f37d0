"""llama.cpp's own speculative decoding, as the peers of the `llamacpp` backend.

- `llama-server` (built by `scripts/build-llama-server.sh` from the llama.cpp sources the pinned
  llama-cpp-python vendors, so both run the same llama.cpp): plain, with the draft model (`-md`), and
  with each of its n-gram modes (`--spec-type ngram-...`), all at their default settings, one slot.
  Requests carry token ids, so both sides decode exactly the same prompt; the prompt cache is off, as
  our engine prefills every prompt too.
- llama-cpp-python's own prompt-lookup drafter (`LlamaPromptLookupDecoding`, 10 tokens).
- llama-server plain, with the draft model and with n-gram drafting as OpenAI-compatible engines
  (`engine_rows`): the `--engine` rows of benchmarks/engines.py, beside our own server.

Timing is wall time around each request, like our engine's (prefill included). Note that llama.cpp's
`ignore_eos` bans end-of-generation tokens while our engine's decodes past them: compare outputs with it
off (the benchmark's default).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import urllib.request
from pathlib import Path

import torch

from specdecode.bench.base import Output, Runner
from specdecode.bench.server_process import ServerProcess, free_port
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
    raise UserError(f"llama-server is not built: run `make llama-server` ({BUILD_SCRIPT}, about 7 minutes, once), "
                    "or set SPECDECODE_LLAMA_SERVER to a llama-server binary")


class LlamaServer(ServerProcess):
    """One llama-server process (one slot) on a loopback port, up once constructed; stopped with this object."""

    def __init__(self, model: Path, args: list[str], threads: int, n_ctx: int = 4096, timeout: float = 180.0):
        port = free_port()
        self.n_ctx = n_ctx
        command = [str(server_binary()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                   "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", "1", *args]
        super().__init__("llama-server", command, port)
        self.wait_until_up(timeout)

    def complete(self, prompt_ids: list[int], config: GenerationConfig) -> tuple[list[int], float, float]:
        """The new tokens, the request's seconds and the server's own prefill seconds."""
        params = config.sampling
        body = {
            "prompt": prompt_ids, "n_predict": config.max_new_tokens, "cache_prompt": False,
            "return_tokens": True, "ignore_eos": config.ignore_eos, "temperature": params.temperature,
            "top_k": params.top_k, "top_p": params.top_p, "seed": config.seed if config.seed is not None else -1,
        }
        request = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as response:
            reply = json.loads(response.read())
        return reply["tokens"], time.perf_counter() - start, reply["timings"]["prompt_ms"] / 1000


def mode_arguments(name: str, draft: Path | None) -> list[str]:
    """llama-server's arguments for `SERVER_MODES[name]`, with the draft model's GGUF in its place."""
    return [str(draft) if a == "{draft}" else a for a in SERVER_MODES[name]]


# llama-server as `specdecode bench --engine` rows beside other engines (benchmarks/engines.py, the tests):
# label -> mode; the first is the plain server, the others' reference
ENGINE_ROWS = {"llama": "llama-server", "llama-draft": "llama-server-draft", "llama-ngram": "llama-server-ngram-simple"}


@contextlib.contextmanager
def engine_rows(target: Path, draft: Path, threads: int, n_ctx: int = 4096, timeout: float = 180.0):
    """llama-server plain, with `draft` as its draft model and with n-gram drafting (`ENGINE_ROWS`), each
    serving `target` on its own loopback port (given `timeout` seconds to come up), all stopped when the
    block ends; yields each row's `--engine` option by label. Requests skip the prompt cache (our engine
    prefills every prompt too), and the speculative rows' outputs must equal the plain row's (the same
    weights), not `ar`'s."""
    plain = next(iter(ENGINE_ROWS))
    with contextlib.ExitStack() as servers:
        options = {}
        for label, mode in ENGINE_ROWS.items():
            server = servers.enter_context(LlamaServer(target, mode_arguments(mode, draft), threads, n_ctx, timeout))
            options[label] = (f'{label}=openai:{server.url}/v1;extra_body={{"cache_prompt":false}}'
                              + ("" if label == plain else f";reference={plain}"))
        yield options


def server_runner(models, name: str):
    draft = models.require_draft().path if "{draft}" in SERVER_MODES[name] else None
    # the same context as our llama.cpp backend's (`LlamaCppLM`: the trained length up to 32k), so the peers run
    # the long-context category's prompts too
    server = LlamaServer(models.target.path, mode_arguments(name, draft), threads=torch.get_num_threads(),
                         n_ctx=models.target.max_context)

    def run(prompt_ids: list[int], config: GenerationConfig) -> Output:
        tokens, seconds, prefill = server.complete(prompt_ids, config)
        return Output(tokens, seconds, None, prefill)

    return Runner(name, True, True, run, max_context=server.n_ctx)  # the server lives as long as `run` holds it


def prompt_lookup_runner(models):
    """llama-cpp-python's Llama with its LlamaPromptLookupDecoding draft (10 tokens, its default)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads, n_ctx = torch.get_num_threads(), models.target.max_context  # as `server_runner`'s
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
