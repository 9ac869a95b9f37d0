"""Any OpenAI-compatible engine as a row of the benchmark: `specdecode bench --engine LABEL=openai:URL;...`.

One option per engine: a label, `openai:` and the API's base URL (ending in /v1), then `;key=value` fields:
- `model=NAME`: the served model name (default: the first of the engine's /v1/models);
- `api=completions` (default) or `api=chat`. `completions` sends the prompt as token ids to
  /v1/completions: the very ids our methods see (the target's chat template, applied here), so the prompts
  are identical by construction, provided the engine serves a model with the target's tokenizer. `chat`
  sends the conversation to /v1/chat/completions, for engines that take no token ids or serve another
  tokenizer: the engine applies its own template, so its prompts may differ (the report compares the
  prompt token counts the engine reports with ours);
- `extra_body=JSON`: fields merged into every request body (`{"cache_prompt": false}` for llama-server and ours,
  so that a prompt sent again is fed again, `{"return_token_ids": true}` for a vLLM that streams token ids, a
  method for ours);
- `reference=LABEL`: the row whose greedy output this one must equal (default: `--reference`, `ar`);
- `lossless=false`: do not compare its output at all;
- `stats=auto|vllm|sglang|response|none`: where its speculative figures are read (`bench.engine_stats`);
  auto: vLLM's /metrics or SGLang's /get_server_info when the engine answers them, else the response's
  own fields (ours, llama-server), which are always read when present;
- `api_key_env=VAR`: the environment variable holding the engine's API key, sent as `Authorization: Bearer`
  (read from the environment, so that no key lands in the command line or the records);
- `timeout=SECONDS`: a request's limit (default TIMEOUT), past which it is a failure, however the engine
  keeps its stream alive.

Every request streams (`stream: true`, `stream_options.include_usage`): tokens are counted from `usage`
(the engine's count of token ids, never re-tokenised text), the time to the first token and the pace
after it from the stream; an answer that did not end (no finish_reason), that the engine cut short, or whose
count disagrees with its streamed ids or `max_tokens`, is a failure (`bench.event_stream`). Token ids are kept
where the engine streams them (ours: `specdecode.tokens`; vLLM: `token_ids` with `return_token_ids`); otherwise
outputs are compared as text.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specdecode.bench import engine_stats, event_stream
from specdecode.bench.base import Output, Runner
from specdecode.bench.engine_stats import ServerStats
from specdecode.engine import GenerationConfig
from specdecode.errors import UserError

SYNTAX = ("LABEL=openai:URL[;model=NAME][;api=completions|chat][;extra_body=JSON][;reference=LABEL][;lossless=false]"
          "[;api_key_env=VAR][;timeout=SECONDS]")
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
KEYS = {"model", "api", "extra_body", "reference", "lossless", "stats", "api_key_env", "timeout"}
STATS = ("auto", "vllm", "sglang", "response", "none")
TIMEOUT = 3600.0  # seconds for one request (a long answer on a CPU), by default
PROBE_TIMEOUT = 10.0  # seconds for the engine to answer a GET


@dataclass(frozen=True)
class EngineSpec:
    label: str
    url: str  # the API's base, e.g. http://127.0.0.1:8080/v1
    model: str | None = None
    api: str = "completions"
    extra_body: dict = field(default_factory=dict)
    reference: str | None = None
    lossless: bool = True
    stats: str = "auto"
    api_key_env: str | None = None  # the environment variable that holds the engine's API key
    timeout: float = TIMEOUT

    @property
    def root(self) -> str:
        """The server's root, where /metrics and /get_server_info live."""
        return self.url.removesuffix("/v1")


def parse_engine(option: str) -> EngineSpec:
    """One --engine option, or a UserError naming what is wrong with it."""
    label, equals, rest = option.partition("=")
    if not equals or not rest.startswith("openai:"):
        raise UserError(f"--engine {option!r}: expected {SYNTAX}")
    if not LABEL.fullmatch(label):
        raise UserError(f"--engine {option!r}: the label {label!r} must be letters, digits, '.', '_' or '-'")
    rest = rest.removeprefix("openai:")
    url, _, rest = rest.partition(";")
    url = url.rstrip("/")
    if not re.fullmatch(r"https?://[^\s;/]+(/\S*)?", url):
        raise UserError(f"--engine {label}: {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8080/v1)")
    fields: dict = {}
    position = 0
    while position < len(rest):
        key, equals, _ = rest[position:].partition("=")
        if not equals or key.strip() not in KEYS:
            raise UserError(f"--engine {label}: unknown field {key.strip()!r}; "
                            f"the fields are {', '.join(sorted(KEYS))}")
        key = key.strip()
        start = position + len(key) + 1
        if key == "extra_body":  # JSON may hold ';' itself: read one object, then expect ';' or the end
            try:
                value, end = json.JSONDecoder().raw_decode(rest, start)
            except json.JSONDecodeError as error:
                raise UserError(f"--engine {label}: extra_body is not valid JSON ({error.msg})") from None
            if not isinstance(value, dict):
                raise UserError(f"--engine {label}: extra_body must be a JSON object")
            if several := {"n", "best_of"} & set(value):  # (one answer a request: usage would count every choice's)
                raise UserError(f"--engine {label}: extra_body's {sorted(several)[0]} asks for several answers; "
                                "the bench reads one a request")
            if rest[end:end + 1] not in ("", ";"):
                raise UserError(f"--engine {label}: expected ';' after extra_body's JSON")
            position = end + 1
        else:
            value, _, _ = rest[start:].partition(";")
            position = start + len(value) + 1
        fields[key] = value
    if fields.get("api", "completions") not in ("completions", "chat"):
        raise UserError(f"--engine {label}: api must be completions or chat, not {fields['api']!r}")
    if fields.get("stats", "auto") not in STATS:
        raise UserError(f"--engine {label}: stats must be one of {', '.join(STATS)}")
    if fields.get("lossless", "true") not in ("true", "false"):
        raise UserError(f"--engine {label}: lossless must be true or false")
    try:
        timeout = float(fields.get("timeout", TIMEOUT))
    except ValueError:
        timeout = 0.0
    if not 0 < timeout < float("inf"):
        raise UserError(f"--engine {label}: timeout is a request's limit in seconds, not {fields['timeout']!r}")
    return EngineSpec(label, url, fields.get("model") or None, fields.get("api", "completions"),
                      fields.get("extra_body", {}), fields.get("reference") or None,
                      fields.get("lossless", "true") == "true", fields.get("stats", "auto"),
                      fields.get("api_key_env") or None, timeout)


class OpenAIEngine:
    """One configured endpoint: checked at construction (reachable, a model, token counts), then requests."""

    def __init__(self, spec: EngineSpec, probe_ids: list[int]):
        self.spec = spec
        self.per_request_counters = True  # off while several streams run at once (`run_levels`)
        models = self._get_json("/models", self.spec.url)
        names = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)] if isinstance(models, dict) else []
        if spec.model is None and not names:
            raise UserError(f"engine {spec.label}: {spec.url}/models lists no model; name one with ;model=NAME")
        self.model = spec.model or names[0]
        self.counters_source = self._counters_source()
        # one short request: a UserError now for a wrong model name, refused token ids, no usage counts...
        probe = GenerationConfig(max_new_tokens=2)
        if spec.api == "chat":
            self.chat([{"role": "user", "content": "Hello"}], probe)
        else:
            self.complete(probe_ids, probe)

    # --- HTTP -------------------------------------------------------------------------------------

    def _get(self, path: str, base: str, timeout: float = PROBE_TIMEOUT) -> bytes:
        url = base + path
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=self._headers({})),
                                        timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            raise UserError(f"engine {self.spec.label}: {url} answered HTTP {error.code}{_message(error)}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise UserError(f"engine {self.spec.label}: cannot reach {url} ({reason})") from None

    def _get_json(self, path: str, base: str):
        raw = self._get(path, base)
        try:
            return json.loads(raw)
        except ValueError:
            raise UserError(f"engine {self.spec.label}: {base + path} did not answer JSON: is it an OpenAI-compatible "
                            "API's base URL (ending in /v1)?") from None

    def _counters_source(self) -> str | None:
        """'vllm' or 'sglang' when the engine publishes counters apart from its responses."""
        wanted = self.spec.stats
        if wanted in ("response", "none"):
            return None
        if wanted in ("auto", "vllm"):
            try:
                if "vllm:" in self._get("/metrics", self.spec.root).decode():
                    return "vllm"
            except UserError:
                pass
        if wanted in ("auto", "sglang"):
            try:
                info = json.loads(self._get("/get_server_info", self.spec.root))
                if isinstance(info, dict) and "internal_states" in info:
                    return "sglang"
            except (UserError, ValueError):
                pass
        if wanted != "auto":
            raise UserError(f"engine {self.spec.label}: stats={wanted}, but {self.spec.root} publishes no "
                            f"{wanted} figures")
        return None

    def counters(self) -> ServerStats | None:
        """The engine's speculative counters now (vLLM, SGLang); None where its responses carry them."""
        if self.counters_source == "vllm":
            return engine_stats.from_vllm_metrics(self._get("/metrics", self.spec.root).decode(), self.model)
        if self.counters_source == "sglang":
            return engine_stats.from_sglang_server_info(json.loads(self._get("/get_server_info", self.spec.root)))
        return None

    # --- requests ---------------------------------------------------------------------------------

    def _body(self, config: GenerationConfig) -> dict:
        params = config.sampling
        body = {"model": self.model, "max_tokens": config.max_new_tokens, "temperature": params.temperature,
                "top_p": params.top_p, "stream": True, "stream_options": {"include_usage": True}}
        if params.top_k:
            body["top_k"] = params.top_k  # not OpenAI's; ours, vLLM's, SGLang's and llama-server's
        if config.seed is not None:
            body["seed"] = config.seed
        return body | self.spec.extra_body

    def complete(self, prompt_ids: list[int], config: GenerationConfig) -> Output:
        return self._stream("/completions", self._body(config) | {"prompt": prompt_ids})

    def chat(self, messages: list[dict], config: GenerationConfig, tools: tuple[dict, ...] = ()) -> Output:
        """The conversation as OpenAI's API takes it: the tools offered, and each earlier call's arguments as JSON
        text (the chat templates take them as objects, as the tasks keep them)."""
        sent = [{**message, "tool_calls": [_as_sent(call) for call in message["tool_calls"]]}
                if message.get("tool_calls") else message for message in messages]
        return self._stream("/chat/completions", self._body(config) | {"messages": sent}
                            | ({"tools": list(tools)} if tools else {}))

    def _stream(self, path: str, body: dict) -> Output:
        label, url = self.spec.label, self.spec.url + path
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=self._headers(
            {"Content-Type": "application/json", "Accept": "text/event-stream"}))
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=self.spec.timeout) as response:
                answer = event_stream.read(response, label, url, start, start + self.spec.timeout)
        except urllib.error.HTTPError as error:
            said = _message(error)  # (a 404 that names no model: a path the engine does not serve)
            chat_only = error.code == 404 and path == "/completions" and "model" not in said.lower()
            hint = " (an engine that serves chat only: add ;api=chat)" if chat_only else ""
            raise UserError(f"engine {label}: {url} answered HTTP {error.code}{said}{hint}") from None
        except (TimeoutError, urllib.error.URLError, ConnectionError) as error:
            raise UserError(f"engine {label}: cannot reach {url} ({getattr(error, 'reason', error)})") from None
        seconds = time.perf_counter() - start
        new_tokens = event_stream.counted(answer, label, body["max_tokens"])
        server = None
        if "speculative" in answer.final:
            server = engine_stats.from_specdecode(answer.final["speculative"], new_tokens)
        elif "timings" in answer.final:
            server = engine_stats.from_llama_timings(answer.final["timings"])
        return Output(answer.ids if answer.ids is not None else [], seconds, None,
                      answer.first if new_tokens else None, text="".join(answer.pieces), new_tokens=new_tokens,
                      server=server, prompt_tokens=(answer.usage or {}).get("prompt_tokens"))

    def _headers(self, headers: dict[str, str]) -> dict[str, str]:
        """`headers` with the engine's key (`;api_key_env=VAR`: read from the environment, never written down)."""
        if self.spec.api_key_env is None:
            return headers
        key = os.environ.get(self.spec.api_key_env)
        if not key:
            raise UserError(f"engine {self.spec.label}: api_key_env={self.spec.api_key_env}, but that environment "
                            "variable is not set")
        return headers | {"Authorization": f"Bearer {key}"}

    def _counted(self, request, *args) -> Output:
        """One request with the engine's counters read before and after it (alone, at concurrency 1)."""
        if not self.per_request_counters or self.counters_source is None:
            return request(*args)
        before = self.counters()
        output = request(*args)
        after = self.counters()
        if after is not None:
            output.server = after if before is None or self.counters_source == "sglang" else after.minus(before)
        return output

    def runner(self) -> Runner:
        """This engine as a benchmark row (a peer: its loop is not ours to see)."""
        if self.spec.api == "chat":
            return Runner(self.spec.label, self.spec.lossless, True, lambda ids, config: self._no_ids(),
                          chat=lambda messages, config, tools: self._counted(self.chat, messages, config, tools))
        return Runner(self.spec.label, self.spec.lossless, True,
                      lambda ids, config: self._counted(self.complete, ids, config))

    def _no_ids(self) -> Output:
        raise AssertionError("an api=chat engine is called with the conversation")


def _message(error: urllib.error.HTTPError) -> str:
    try:
        return ":" + event_stream.error_text(json.loads(error.read()))
    except (ValueError, OSError):
        return ""


def build_engines(options: list[str], taken: set[str], probe_ids: list[int]) -> dict[str, OpenAIEngine]:
    """The --engine options as engines, each checked; labels must not repeat or shadow a method."""
    specs = [parse_engine(option) for option in options]
    labels = [spec.label for spec in specs]
    clash = sorted({label for label in labels if label in taken or labels.count(label) > 1})
    if clash:
        raise UserError(f"--engine labels must be unique and differ from method names: {', '.join(clash)}")
    return {spec.label: OpenAIEngine(spec, probe_ids) for spec in specs}


# --- several client streams at once -------------------------------------------------------------


@dataclass
class LevelRun:
    """Every task on one engine with `concurrency` streams at once, in one repeat."""

    engine: str
    concurrency: int
    repeat: int
    seconds: float  # wall time of the whole level
    records: list = field(default_factory=list)
    server: ServerStats | None = None  # counters around the level, or the requests' own figures summed

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.records if r.ok)

    def to_json(self) -> dict:
        return {"engine": self.engine, "concurrency": self.concurrency, "repeat": self.repeat, "seconds": self.seconds,
                "new_tokens": self.new_tokens, "server": None if self.server is None else self.server.to_json()}


def run_levels(models, engines: dict[str, OpenAIEngine], runners: dict[str, Runner], tasks, config: GenerationConfig,
               levels: list[int], repeats: int, on_record=lambda record: None) -> list[LevelRun]:
    """For each level above 1: every engine in turn (the order changing per repeat: `harness.method_order`)
    runs every task with `level` client streams at once; throughput is all new tokens over the level's wall
    time."""
    from specdecode.bench.harness import method_order, run_task, task_config

    names = list(engines)
    runs = []
    for level in [n for n in levels if n > 1]:
        for repeat in range(repeats):
            for name in method_order(names, repeat):
                engine = engines[name]
                engine.per_request_counters = False
                before = engine.counters()
                start = time.perf_counter()
                configs = [task_config(config, repeat, index) for index in range(len(tasks))]
                pool = ThreadPoolExecutor(level)
                futures = [pool.submit(run_task, models, runners[name], task, each, repeat)
                           for task, each in zip(tasks, configs)]
                try:
                    records = [future.result() for future in futures]
                except KeyboardInterrupt:  # the runs that ended are kept; those under way are not waited for
                    for future in futures:
                        if future.done() and not future.cancelled() and future.exception() is None:
                            future.result().concurrency = level
                            on_record(future.result())
                    raise
                finally:
                    pool.shutdown(wait=False, cancel_futures=True)
                seconds = time.perf_counter() - start
                after = engine.counters()
                engine.per_request_counters = True
                server = None
                if after is not None:
                    server = after if before is None or engine.counters_source == "sglang" else after.minus(before)
                else:
                    for record in records:
                        if record.ok and record.server is not None:
                            server = record.server if server is None else server + record.server
                for record in records:
                    record.concurrency = level
                    on_record(record)
                runs.append(LevelRun(name, level, repeat, seconds, records, server))
    return runs


def _as_sent(call: dict) -> dict:
    """A tool call with its arguments as JSON text, as OpenAI's API takes them."""
    function = call["function"]
    if isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": json.dumps(function.get("arguments", {}))}}
