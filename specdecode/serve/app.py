"""`specdecode serve`: an OpenAI-compatible HTTP server over the speculative engine.

Endpoints: `/v1/models`, `/v1/completions` and `/v1/chat/completions` (with `stream: true` as server-sent
events in OpenAI's chunk format), `/v1/methods` (ours: what `method` may name), `/metrics` (Prometheus),
`/health`, and the demonstration page at `/`.

Beside OpenAI's fields, a request may name its `method` (default: the server's) and `top_k`; a response
carries `speculative` next to `usage` (target forwards, drafted and accepted tokens, mean accepted tokens,
acceptance rate), and every streamed chunk carries `specdecode.tokens`: each new token's id, text and
origin (accepted draft, target's correction, bonus), which the page colours.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from specdecode.api import Models
from specdecode.drafters.base import Drafter
from specdecode.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.methods import resolve, variant_names
from specdecode.serve import protocol
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.protocol import APIError, ChatRequest, CompletionRequest, SamplingRequest
from specdecode.serve.worker import DEFAULT_MAX_BATCH, Job, Step, Worker
from specdecode.types import SamplingParams


class Server:
    """The models, one engine per method (built on first use), the worker and the metrics."""

    def __init__(self, models: Models, model_name: str, default_method: str = "pld", datastore: str | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH):
        resolve(default_method)  # a UserError for an unknown name
        self.models, self.model_name, self.default_method = models, model_name, default_method
        self.datastore = datastore
        self.engines: dict[str, SpeculativeEngine] = {}
        self.metrics = ServerMetrics()
        self.worker = Worker(models.target, models.tokenizer, self.engine, self.drafter, on_finish=self._finished,
                             max_batch=max_batch, on_batch_step=self.metrics.batch_step)

    def methods(self) -> list[str]:
        """The methods this server can run, tree forms included (those needing a draft model only if one is
        loaded)."""
        return [name for name in variant_names() if self.models.draft is not None or not resolve(name)[0].needs_draft_model]

    def engine(self, method: str) -> SpeculativeEngine:  # on the worker thread
        if method not in self.engines:
            self.engines[method] = self.models.engine(method, datastore=self.datastore)
        return self.engines[method]

    def drafter(self, method: str) -> Drafter | None:  # on the worker thread: one per batched sequence
        return self.models.drafter(method, datastore=self.datastore)

    def _finished(self, job: Job, result: GenerationResult) -> None:
        self.metrics.finished(result, time.perf_counter() - job.submitted)

    # -- a request's way through -------------------------------------------------------------------

    def check(self, body: SamplingRequest, prompt_ids: list[int]) -> tuple[str, GenerationConfig]:
        if body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server has `{self.model_name}`.",
                           param="model", code="model_not_found")
        method = body.method or self.default_method
        if method not in self.methods():
            raise APIError(400, f"Unknown method `{method}`; this server offers: {', '.join(self.methods())}.",
                           param="method", code="unknown_method")
        context = self.models.target.max_context
        room = context - len(prompt_ids)
        if room <= 0 or (body.max_tokens is not None and body.max_tokens > room):
            asked = f" + {body.max_tokens} to generate" if body.max_tokens is not None else ""
            raise APIError(400, f"This model's maximum context length is {context} tokens; the request has "
                                f"{len(prompt_ids)} prompt tokens{asked}.", param="messages", code="context_length_exceeded")
        try:
            config = GenerationConfig(
                max_new_tokens=body.max_tokens or room,
                sampling=SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p),
                stop=tuple(body.stop or ()), seed=body.seed)
        except UserError as error:
            raise APIError(400, str(error)) from None
        return method, config

    async def run(self, body: SamplingRequest, prompt_ids: list[int], chat: bool) -> Response:
        method, config = self.check(body, prompt_ids)
        job = Job(method, prompt_ids, config, asyncio.get_running_loop(), asyncio.Queue())
        self.metrics.waiting.inc()
        self.worker.submit(job)
        try:
            first = await job.events.get()  # errors before the first token keep their 4xx status
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        finally:
            self.metrics.waiting.dec()
        if isinstance(first, BaseException):
            raise _api_error(first)
        self.metrics.queue_seconds.observe((job.started or time.perf_counter()) - job.submitted)
        self.metrics.first_token.labels(method).observe(time.perf_counter() - job.submitted)
        if body.stream:
            return StreamingResponse(self._chunks(job, first, body, chat), media_type="text/event-stream")
        self.metrics.running.inc()
        try:
            item = first
            while not isinstance(item, GenerationResult):
                if isinstance(item, BaseException):
                    raise _api_error(item)
                item = await job.events.get()
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        finally:
            self.metrics.running.dec()
        return JSONResponse(self._response(item, chat))

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


def _step_payload(step: Step) -> dict:
    event = step.event
    return {
        "tokens": [{"id": t, "text": p, "origin": o} for t, p, o in zip(event.token_ids, step.pieces, event.origins)],
        "rejected": step.rejected_text,  # what the draft said where the target disagreed (chains)
        "drafted": event.stats.drafted,
        "accepted": event.stats.accepted,
    }


def _api_error(error: BaseException) -> APIError:
    if isinstance(error, APIError):
        return error
    if isinstance(error, UserError):
        return APIError(400, str(error))
    return APIError(500, f"internal error: {type(error).__name__}: {error}", type="server_error")


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    return (f"Invalid value for `{param}`: {message}" if param else message), param


class ServerThread:
    """The app served by uvicorn on a daemon thread (tests, benchmarks); `url`, then `stop()`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import socket
        import threading

        import uvicorn

        if port == 0:  # a free port
            with socket.socket() as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
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


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.worker.stop()

    app = FastAPI(title="specdecode", description="OpenAI-compatible speculative decoding server", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api(request: Request, error: APIError):
        server.metrics.requests.labels(request.url.path, str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        message, param = _validation_message(error)
        server.metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

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
        return {"object": "list", "default": server.default_method, "data": [
            {"id": name, "summary": resolve(name)[0].summary, "lossless": resolve(name)[0].lossless}
            for name in server.methods()]}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "The prompt is empty.", param="prompt")
            ids = server.models.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = list(prompt)
            if any(not 0 <= t < server.models.target.vocab_size for t in ids):
                raise APIError(400, f"Token ids must lie in [0, {server.models.target.vocab_size}).", param="prompt")
        response = await server.run(body, ids, chat=False)
        server.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = server.models.encode_chat(messages)
        except UserError as error:
            raise APIError(400, str(error), param="messages") from None
        except Exception as error:  # the chat template rejects the conversation (e.g. roles out of order)
            raise APIError(400, f"The chat template cannot render these messages: {error}", param="messages") from None
        response = await server.run(body, ids, chat=True)
        server.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    return app
