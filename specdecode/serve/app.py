"""`specdecode serve`: an OpenAI-compatible HTTP server over the speculative engine.

Endpoints: `/v1/models`, `/v1/completions` and `/v1/chat/completions` (with `stream: true` as server-sent
events in OpenAI's chunk format), `/v1/methods` (ours: what `method` may name, and whether each is ready),
`/metrics` (Prometheus), `/health`, and the demonstration page at `/`.

Beside OpenAI's fields, a request may name its `method` (default: the server's) and `top_k`; a response
carries `speculative` next to `usage` (target forwards, drafted and accepted tokens, mean accepted tokens,
acceptance rate), and every streamed chunk carries `specdecode.tokens`: each new token's id, text and
origin (accepted draft, target's correction, bonus), which the page colours.

Several users at once (see also `serve.guard` for keys, hosts and the HTTP limits):

- *Memory*: a method that drafts from earlier requests' text (`Method.remembers`: suffix decoding) gets
  one drafter per *owner*: with `memory_scope="tenant"` (the default) an owner is an API key's tenant
  and the request's OpenAI `user` field; a request with neither (no keys, no `user` or an empty one) has
  a drafter of its own that forgets it afterwards. "request" never shares; "server" shares one memory among all (one
  trusted user). So a request's drafts, rejected text and token origins carry only its owner's text.
- *Cost*: `Limits` caps a request's tokens, its time (past its deadline a generation ends where it is,
  as at max_tokens) and the requests waiting (429 beyond); a client that disconnects, streaming or not,
  stops its generation within one step.
- *Preparation*: what a method costs once (the target's and draft's cost curves, a layer search, a
  retrieval datastore) is paid at start-up for the methods a server is given (`methods`; without them,
  for the default method), or else on a method's first request, in the background at the lowest
  priority: the request is served if that takes under PREPARE_GRACE, and the method answers 503 until
  ready otherwise. Never inside a request, never on the worker: no other request waits for it.
- *The event loop*: tokenizing and templating run on a thread pool; a prompt whose bytes already exceed
  what the context could hold is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Hashable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specdecode.api import Models
from specdecode.drafters.base import Drafter
from specdecode.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.methods import resolve, variant_names
from specdecode.serve import protocol
from specdecode.serve.guard import ClientGone, Guard, GuardMiddleware, check_exposure, uvicorn_options
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.protocol import APIError, ChatRequest, CompletionRequest, SamplingRequest
from specdecode.serve.worker import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, Busy, Job, Step, Worker
from specdecode.types import SamplingParams

log = logging.getLogger("specdecode.serve")

MEMORY_SCOPES = ("tenant", "request", "server")
TOKENIZER_THREADS = 2
NOT_READY_RETRY_SECONDS = 10
PREPARE_GRACE = 1.0  # seconds a request waits for its method's preparation before a 503
GREEDY_BELOW = 1e-5  # a smaller temperature decodes greedily
NORMALISED_SHRINK = 3  # a Unicode normaliser (NFC) turns at most three characters into one of a third their bytes


@dataclass(frozen=True)
class Limits:
    """What one request may cost."""

    max_tokens: int = 4096  # the most a request may ask to generate
    default_max_tokens: int = 512  # a chat request that names none (completions: OpenAI's 16)
    request_seconds: float = 300.0  # from arrival; then the generation ends where it is
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting for the model; beyond: 429

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_tokens <= self.max_tokens:
            raise UserError(f"the default max_tokens ({self.default_max_tokens}) must lie in 1 .. the maximum "
                            f"({self.max_tokens})")
        if not self.request_seconds > 0 or self.max_queue < 1:
            raise UserError("the request timeout must be positive and the queue hold at least one request")


def prompt_byte_limit(tokenizer, context: int) -> int | None:
    """Above this many UTF-8 bytes a prompt cannot fit in `context` tokens, whatever it says: no token
    stands for more bytes than its own text in the vocabulary (a byte-level symbol, a SentencePiece `▁`
    or `<0x..>` is never shorter than what it stands for), times NORMALISED_SHRINK when the tokenizer
    normalises the text first. None when the vocabulary cannot be read."""
    try:
        longest = max(len(token.encode("utf-8", "replace")) for token in tokenizer.get_vocab())
    except Exception:
        return None
    normaliser = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    return context * longest * (NORMALISED_SHRINK if normaliser is not None else 1)


class Server:
    """The models, the engines (one per method, or per method and owner for those that remember), the
    worker, the methods' preparation and the metrics."""

    def __init__(self, models: Models, model_name: str, default_method: str = "pld", datastore: str | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, limits: Limits = Limits(), methods: Sequence[str] | None = None,
                 prepare: Sequence[str] | None = None, memory_scope: str = "tenant", memory_owners: int = 64):
        """`methods`: those clients may name (default: every one the models can run); `prepare`: those
        prepared before the server takes requests (default: all of `methods` when given, else the default
        method), each other one being prepared in the background on its first request."""
        runnable = [name for name in variant_names()
                    if models.draft is not None or not resolve(name)[0].needs_draft_model]
        for name in [default_method, *(methods or ())]:
            resolve(name)  # a UserError for an unknown name
            if name not in runnable:
                raise UserError(f"method {name!r} needs the draft model, which this server has not loaded")
        self.offered = tuple(dict.fromkeys(methods)) if methods else tuple(runnable)
        if prepare is None:
            prepare = self.offered if methods else ()
        first = list(dict.fromkeys([default_method, *prepare]))
        if not set(first) <= set(self.offered):
            raise UserError("the default method and those to prepare must be among the methods offered")
        if memory_scope not in MEMORY_SCOPES or memory_owners < 1:
            raise UserError(f"the memory scope is one of {', '.join(MEMORY_SCOPES)}, with at least one owner")
        self.models, self.model_name, self.default_method = models, model_name, default_method
        self.datastore, self.limits = datastore, limits
        self.memory_scope, self.memory_owners = memory_scope, memory_owners
        self.engines: dict[str, SpeculativeEngine] = {}  # methods that remember nothing: one each
        self._owned: OrderedDict[tuple[str, Hashable], SpeculativeEngine] = OrderedDict()  # least recent first
        self.ready: set[str] = set()
        self.unavailable: dict[str, str] = {}  # method -> why it cannot run here
        self._preparing: dict[str, Future] = {}  # method -> its preparation in the background
        self._lock = threading.Lock()
        self.metrics = ServerMetrics()
        self._recent_seconds = 1.0  # a moving average of request latency, for Retry-After
        self.prompt_bytes = prompt_byte_limit(models.tokenizer, models.target.max_context)
        # Requests are tokenized on these threads, one text each. The tokenizer's own thread pool (Rust's
        # rayon, at full priority) is turned off: a datastore's tokenization on it would take the cores
        # from decoding (a concurrent stream stalled 5 s in 0.4 s steps with it, not at all without).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="specdecode-tokenize")
        self.worker = Worker(models.target, models.tokenizer, self.engine, self.drafter, on_finish=self._finished,
                             max_batch=max_batch, on_batch_step=self.metrics.batch_step, max_queue=limits.max_queue)
        self.metrics.waiting.set_function(lambda: self.worker.queued)
        # What the methods share, measured once per machine while the models are idle: the cost curves.
        models.target.cost_curve()
        if models.draft is not None and any(resolve(m)[0].needs_draft_model for m in self.offered):
            models.draft.cost_curve()
        for method in first:
            self._prepare(method)
        if failed := [m for m in first if m in self.unavailable]:  # asked for by name: say so now
            self.close()
            raise UserError("; ".join(f"method {m!r} cannot run here: {self.unavailable[m]}" for m in failed))

    # -- methods ------------------------------------------------------------------------------------

    def methods(self) -> list[str]:
        """The methods clients may name."""
        return list(self.offered)

    def status(self, method: str) -> str:
        """ready; unavailable (`unavailable` says why); preparing; or cold (prepared on its first request)."""
        if method in self.ready or method in self.unavailable:
            return "ready" if method in self.ready else "unavailable"
        return "preparing" if method in self._preparing else "cold"

    def _prepare(self, method: str) -> None:
        """Pay what a method costs once (a layer search, a datastore...): build its engine. Methods that
        batch or remember get a drafter per sequence or owner later; building one now fills the caches."""
        spec = resolve(method)[0]
        try:
            engine = self.models.engine(method, datastore=self.datastore)
            if not spec.remembers and not (spec.batchable and self.worker.batch is not None):
                self.engines[method] = engine
        except UserError as error:
            self.unavailable[method] = str(error)
            return
        except Exception:
            log.exception("preparing method %s failed", method)
            self.unavailable[method] = "it could not be prepared (the server's log says why)"
            return
        self.ready.add(method)

    def prepare_in_background(self, method: str) -> Future:
        """Start preparing a method on a thread of its own at the lowest priority (once); its future."""
        with self._lock:
            if method not in self._preparing:
                future = self._preparing[method] = Future()

                def prepare() -> None:
                    _yield_the_cpu()
                    self._prepare(method)
                    future.set_result(method)

                threading.Thread(target=prepare, name=f"specdecode-prepare-{method}", daemon=True).start()
            return self._preparing[method]

    def wait_until_prepared(self, timeout: float | None = None) -> None:
        """Block until every preparation under way has ended (tests, benchmarks)."""
        futures.wait(list(self._preparing.values()), timeout)

    # -- the worker's factories (on the worker thread) ------------------------------------------------

    def engine(self, job: Job) -> SpeculativeEngine:
        if resolve(job.method)[0].remembers:
            return self._owned_engine(job)
        if job.method not in self.engines:  # a prepared method has one already
            self.engines[job.method] = self.models.engine(job.method, datastore=self.datastore)
        return self.engines[job.method]

    def _owned_engine(self, job: Job) -> SpeculativeEngine:
        """The engine holding the memory of the job's owner; for a job with none, a new one that forgets
        it afterwards. At most `memory_owners` are kept, the least recently used dropped first."""
        if job.memory is None:
            return self.models.engine(job.method, datastore=self.datastore)
        key = (job.method, job.memory)
        engine = self._owned.pop(key, None) or self.models.engine(job.method, datastore=self.datastore)
        self._owned[key] = engine
        while len(self._owned) > self.memory_owners:
            self._owned.popitem(last=False)
        return engine

    def drafter(self, job: Job) -> Drafter | None:  # one per batched sequence: it remembers nothing after
        return self.models.drafter(job.method, datastore=self.datastore)

    def memory_owner(self, tenant: str | None, user: str | None) -> Hashable | None:
        """Whose cross-request memory a request may read and add to (None: its own only)."""
        user = user or None  # an empty name is none (a client library's default must not make a crowd)
        if self.memory_scope == "server":
            return "server"
        if self.memory_scope == "request" or (tenant is None and user is None):
            return None
        return (tenant, user)

    def _finished(self, job: Job, result: GenerationResult) -> None:
        seconds = time.perf_counter() - job.submitted
        self.metrics.finished(result, seconds)
        if job.expired:
            self.metrics.expired.inc()
        self._recent_seconds = 0.9 * self._recent_seconds + 0.1 * seconds

    def close(self) -> None:
        self.worker.stop()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    # -- a request's way through -------------------------------------------------------------------

    async def _method(self, body: SamplingRequest) -> str:
        """The method a request names, once it is ready: a cold one is prepared in the background, and
        the request waits for it PREPARE_GRACE seconds at most (enough for most), then gets 503."""
        if body.model != self.model_name:
            raise APIError(404, f"The model `{protocol.quoted(body.model)}` does not exist; this server has "
                                f"`{self.model_name}`.", param="model", code="model_not_found")
        method = body.method or self.default_method
        if method not in self.offered:
            raise APIError(400, f"Unknown method `{protocol.quoted(method)}`; this server offers: "
                                f"{', '.join(self.offered)}.", param="method", code="unknown_method")
        if method not in self.ready and method not in self.unavailable:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.prepare_in_background(method))),
                                       PREPARE_GRACE)
        if method in self.unavailable:
            raise APIError(400, f"The method `{method}` cannot run on this server: {self.unavailable[method]}",
                           param="method", code="method_unavailable")
        if method not in self.ready:
            raise APIError(503, f"The method `{method}` is being prepared (first use on this machine: a search "
                                f"or an index to build); retry later.", type="server_error", code="method_not_ready",
                           headers={"Retry-After": str(NOT_READY_RETRY_SECONDS)})
        return method

    def _answer_limit(self, body: SamplingRequest) -> int | None:
        limit = body.answer_limit() if isinstance(body, ChatRequest) else body.max_tokens
        context = self.models.target.max_context
        if limit is not None and limit >= context:  # with any prompt at all
            raise APIError(400, f"This model's maximum context length is {context} tokens; the request asks for "
                                f"{limit} to generate.", param="max_tokens", code="context_length_exceeded")
        if limit is not None and limit > self.limits.max_tokens:
            raise APIError(400, f"max_tokens is at most {self.limits.max_tokens} on this server; the request "
                                f"asks for {limit}.", param="max_tokens")
        return limit

    def _check_bytes(self, texts: list[str], param: str) -> None:
        size = sum(len(text.encode("utf-8")) for text in texts)
        if self.prompt_bytes is not None and size > self.prompt_bytes:
            raise APIError(400, f"This model's maximum context length is {self.models.target.max_context} tokens; "
                                f"the prompt's {size} bytes cannot fit in it.", param=param,
                           code="context_length_exceeded")

    def _config(self, body: SamplingRequest, prompt_ids: list[int], limit: int | None, param: str) -> GenerationConfig:
        context = self.models.target.max_context
        room = context - len(prompt_ids)
        if room <= 0 or (limit is not None and limit > room):
            asked = f" + {limit} to generate" if limit is not None else ""
            raise APIError(400, f"This model's maximum context length is {context} tokens; the request has "
                                f"{len(prompt_ids)} prompt tokens{asked}.", param=param,
                           code="context_length_exceeded")
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature < GREEDY_BELOW:  # as vLLM: below it, logits / temperature leave float32's range
            temperature = 0.0
        sampling = SamplingParams(temperature=temperature, top_k=body.top_k or 0,
                                  top_p=1.0 if body.top_p is None else body.top_p)
        try:
            return GenerationConfig(max_new_tokens=limit or min(self.limits.default_max_tokens, room),
                                    sampling=sampling, stop=tuple(body.stop or ()), seed=body.seed)
        except UserError as error:
            raise APIError(400, str(error)) from None

    def _encode_completion(self, prompt: str | list[int]) -> list[int]:  # on the tokenizing pool
        if isinstance(prompt, str):
            return self.models.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        vocab = self.models.target.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"Token ids must lie in [0, {vocab}).", param="prompt")
        return prompt

    def _encode_chat(self, messages: list[dict]) -> list[int]:  # on the tokenizing pool
        from jinja2 import TemplateError

        try:
            return self.models.encode_chat(messages)
        except UserError as error:
            raise APIError(400, str(error), param="messages") from None
        except TemplateError as error:  # the template refuses the conversation (e.g. roles out of order)
            raise APIError(400, f"The chat template cannot render these messages: {error}", param="messages") from None

    async def complete(self, request: Request, chat: bool) -> Response:
        """One request to /v1/completions or /v1/chat/completions, from its body to its response."""
        arrival = time.perf_counter()
        body = protocol.parse(await request.body(), ChatRequest if chat else CompletionRequest)
        method = await self._method(body)
        limit = self._answer_limit(body)
        param = "messages" if chat else "prompt"
        if chat:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            self._check_bytes([m["content"] for m in messages], param)
            encode = lambda: self._encode_chat(messages)  # noqa: E731
        else:
            if isinstance(body.prompt, str):
                self._check_bytes([body.prompt], param)
            encode = lambda: self._encode_completion(body.prompt)  # noqa: E731
        if not self.worker.enter():
            retry = max(1, min(60, math.ceil(self._recent_seconds)))
            raise APIError(429, f"The server is busy: {self.limits.max_queue} requests are waiting; retry in "
                                f"{retry} s.", type="server_error", code="queue_full", headers={"Retry-After": str(retry)})
        loop = asyncio.get_running_loop()
        try:
            prompt_ids = await loop.run_in_executor(self._tokenizing, encode)
            config = self._config(body, prompt_ids, limit, param)
        except BaseException:
            self.worker.leave()
            raise
        memory = self.memory_owner(request.state.tenant, body.user)
        job = Job(method, prompt_ids, config, loop, asyncio.Queue(), memory=memory,
                  deadline=arrival + self.limits.request_seconds)
        self.worker.submit(job)
        watcher = asyncio.create_task(_disconnected(request))
        finished = False
        try:
            first = await self._next(job, watcher)  # errors before the first token keep their status
            if isinstance(first, BaseException):
                raise _api_error(first)
            self.metrics.queue_seconds.observe((job.started or time.perf_counter()) - job.submitted)
            self.metrics.first_token.labels(method).observe(time.perf_counter() - job.submitted)
            if body.stream:
                watcher.cancel()  # the streaming response watches the connection from here
                finished = True
                return StreamingResponse(self._chunks(job, first, body, chat), media_type="text/event-stream")
            self.metrics.running.inc()
            try:
                item = first
                while not isinstance(item, GenerationResult):
                    if isinstance(item, BaseException):
                        raise _api_error(item)
                    item = await self._next(job, watcher)
            finally:
                self.metrics.running.dec()
            finished = True
            return JSONResponse(self._response(item, chat))
        finally:
            watcher.cancel()
            if not finished:  # the client left, or the request failed: stop the generation
                job.cancelled.set()

    async def _next(self, job: Job, watcher: asyncio.Task):
        """The job's next event, or ClientGone once the client has disconnected (its job cancelled)."""
        getter = asyncio.ensure_future(job.events.get())
        await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        job.cancelled.set()
        self.metrics.cancelled.inc()
        raise ClientGone

    def _response(self, result: GenerationResult, chat: bool) -> dict:
        choice = {"index": 0, "finish_reason": protocol.finish_reason(result), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return {
            "id": protocol.new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": protocol.now(),
            "model": self.model_name,
            "choices": [choice],
            "usage": protocol.usage(result),
            "speculative": protocol.speculative(result),
        }

    async def _chunks(self, job: Job, first, body: SamplingRequest, chat: bool) -> AsyncIterator[str]:
        ident, created = protocol.new_id("chatcmpl" if chat else "cmpl"), protocol.now()

        def chunk(choices: list[dict], **extra) -> str:
            body_ = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": self.model_name, "choices": choices, **extra}
            return f"data: {json.dumps(body_)}\n\n"

        def choice(text: str | None, finish: str | None = None, role: bool = False) -> list[dict]:
            if not chat:
                return [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            return [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]

        finished = False
        self.metrics.running.inc()
        try:
            if chat:
                yield chunk(choice(None, role=True))
            item = first
            while True:
                if isinstance(item, BaseException):
                    yield f"data: {json.dumps(_api_error(item).body())}\n\n"
                    break
                if isinstance(item, GenerationResult):
                    yield chunk(choice(None, protocol.finish_reason(item)), speculative=protocol.speculative(item))
                    if body.include_usage():
                        yield chunk([], usage=protocol.usage(item))
                    break
                yield chunk(choice(item.event.text), specdecode=_step_payload(item))
                item = await job.events.get()
            finished = True
            yield "data: [DONE]\n\n"
        finally:
            self.metrics.running.dec()
            if not finished:  # the client went away mid-stream: stop the generation, free its cache
                job.cancelled.set()
                self.metrics.cancelled.inc()


def _yield_the_cpu() -> None:
    """Give this thread, and the threads it starts (torch's for a layer search), the lowest priority
    (Linux: nice 19): a preparation takes only the CPU that decoding leaves."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body was read already: nothing else arrives)."""
    with contextlib.suppress(Exception):  # a connection that fails is one that left
        while (await request.receive())["type"] != "http.disconnect":
            pass


def _step_payload(step: Step) -> dict:
    event = step.event
    return {
        "tokens": [{"id": t, "text": p, "origin": o} for t, p, o in zip(event.token_ids, step.pieces, event.origins)],
        "rejected": step.rejected_text,  # what the draft said where the target disagreed (chains)
        "drafted": event.stats.drafted,
        "accepted": event.stats.accepted,
    }


def _api_error(error: BaseException) -> APIError:
    """What the client is told of a request's failure: its own mistakes in full, the server's in general."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, UserError):
        return APIError(400, str(error))
    if isinstance(error, Busy):
        return APIError(503, f"{str(error).capitalize()}; retry later.", type="server_error", code="busy",
                        headers={"Retry-After": str(NOT_READY_RETRY_SECONDS)})
    return APIError(500, "The server had an error while processing your request (its log says what).",
                    type="server_error")


class ServerThread:
    """The app served by uvicorn on a daemon thread (tests, benchmarks); `url`, then `stop()`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        check_exposure(host, app.state.guard)
        if port == 0:  # a free port
            with socket.socket() as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **uvicorn_options(app.state.guard)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.05)
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


ENDPOINTS = frozenset({"/", "/health", "/metrics", "/docs", "/openapi.json", "/v1/models", "/v1/methods",
                       "/v1/completions", "/v1/chat/completions"})


def create_app(server: Server, guard: Guard = Guard()) -> FastAPI:
    """The ASGI app; `guard`: keys, allowed hosts, body limit and read timeout (`Guard.for_address`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.close()

    app = FastAPI(title="specdecode", description="OpenAI-compatible speculative decoding server", lifespan=lifespan,
                  docs_url="/docs" if guard.docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if guard.docs else None)
    app.state.server, app.state.guard = server, guard
    app.add_middleware(GuardMiddleware, guard=guard, endpoints=ENDPOINTS,
                       on_response=lambda endpoint, status: server.metrics.requests.labels(endpoint, str(status)).inc())

    @app.exception_handler(APIError)
    async def _api(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException):
        path = protocol.quoted(request.url.path)
        message = {404: f"Invalid URL ({request.method} {path}).",
                   405: f"Method {request.method} is not allowed on {path}."}.get(error.status_code, str(error.detail))
        return JSONResponse(APIError(error.status_code, message).body(), status_code=error.status_code,
                            headers=error.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception):  # counted as 500 by the middleware
        return JSONResponse(_api_error(error).body(), status_code=500)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("specdecode.serve").joinpath("static/index.html").read_text(encoding="utf-8")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": server.model_name, "object": "model", "created": 0, "owned_by": "specdecode"}]}

    @app.get("/v1/methods")
    async def methods():
        data = []
        for name in server.methods():
            entry = {"id": name, "summary": resolve(name)[0].summary, "lossless": resolve(name)[0].lossless,
                     "status": server.status(name)}
            if name in server.unavailable:
                entry["reason"] = server.unavailable[name]
            data.append(entry)
        return {"object": "list", "default": server.default_method, "data": data}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await server.complete(request, chat=True)

    return app
