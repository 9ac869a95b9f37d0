"""`specdecode serve`: an OpenAI-compatible HTTP server over the speculative engine.

Endpoints: `/v1/models`, `/v1/completions` and `/v1/chat/completions` (with `stream: true` as server-sent
events in OpenAI's chunk format), `/v1/responses` (OpenAI's Responses API, stateless, on the chat path: `responses`),
`/v1/methods` (ours: what `method` may name, and whether each is ready), `/metrics` (Prometheus), `/health`,
`/tokenize` and `/detokenize` (as vLLM's: a prompt's token ids by the server's tokenizer and chat template, and
back), and the demonstration page at `/`.

Beside OpenAI's fields, a request may name its `method` (default: the server's) and `top_k`; a response
carries `speculative` next to `usage` (target forwards, drafted and accepted tokens, mean accepted tokens,
acceptance rate), and every streamed chunk carries `specdecode.tokens`: each new token's id, text and
origin (accepted draft, target's correction, bonus), which the page colours.

The server in modules, from the HTTP edge in:

- `app` (this one): the ASGI app's routes and error handlers (`create_app`), and `ServerThread`
- `guard`: API keys, allowed hosts and origins, the body limit and read timeout
- `protocol`: the OpenAI request bodies and the fields of a response
- `server`: the server's state and a request's way through it (`Server`); several users at once
- `limits`: what one request may cost (`Limits`), and the checks of a request against it and the context
- `replies`: a finished or streamed generation as the client gets it, and a failure as an OpenAI error
- `responses`: a /v1/responses request as the chat request that runs it; `response_objects`: its answer as a
  Response object or Responses' streamed events
- `offer`: the methods offered, each resolved once at start-up, and their preparation
- `engines`: the engines and drafters the worker builds from a job's resolved method
- `worker`: the thread that owns the models: the queue, batching, deadlines and cancellation
- `metrics`: the Prometheus metrics
- `tokens`: `/tokenize` and `/detokenize`
"""

from __future__ import annotations

import contextlib
import threading
import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from specdecode.serve import protocol, responses, tokens
from specdecode.serve.guard import Guard, GuardMiddleware, check_exposure, uvicorn_options
from specdecode.serve.protocol import APIError
from specdecode.serve.replies import api_error
from specdecode.serve.limits import Limits  # re-exported: callers import it here
from specdecode.serve.server import Server

__all__ = ["ENDPOINTS", "Limits", "Server", "ServerThread", "create_app"]


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
                       "/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"})


def create_app(server: Server, guard: Guard = Guard()) -> FastAPI:
    """The ASGI app; `guard`: keys, allowed hosts and origins, body limit and read timeout (`Guard.for_address`)."""

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
    if guard.allowed_origins:
        # CORS for the pages the operator allows, outside the guard: a browser's preflight carries no key,
        # and a page must be able to read the guard's refusals too
        app.add_middleware(CORSMiddleware, allow_origins=list(guard.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"], max_age=600)

    _error_handlers(app)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("specdecode.serve").joinpath("static/index.html").read_text(encoding="utf-8")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model(server, server.model_name)]}

    @app.get("/v1/models/{name:path}")  # (`client.models.retrieve`; a name may hold a slash)
    async def one_model(name: str):
        return _model(server, name)

    @app.get("/v1/methods")
    async def methods():
        data = []
        for choice in server.offer.choices:
            name = choice.name
            entry = {"id": name, "summary": choice.method.summary, "lossless": choice.method.lossless,
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

    _responses_routes(app, server)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body, asked = tokens.tokenize_request(await request.body(), server.model_name)
        _model(server, body.model)
        return await tokens.tokenize(server, body, asked)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = protocol.parse(await request.body(), tokens.DetokenizeRequest, {"model": server.model_name})
        _model(server, body.model)
        return await tokens.detokenize(server, body)

    return app


def _responses_routes(app: FastAPI, server: Server) -> None:
    """/v1/responses (`serve.responses`), and a 404 for a stored response's routes: none is stored."""

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await responses.create(server, request)

    @app.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def stored_response(rest: str):  # (retrieve, cancel, delete, input_items: a stored response's)
        raise APIError(404, "This server stores no responses (a Response says `store: false`): there is none to "
                            "retrieve, cancel or delete.", code="not_found")


def _error_handlers(app: FastAPI) -> None:
    """Every failure as OpenAI's error body: a client's mistake, an unknown path or method, the server's fault."""

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
        return JSONResponse(api_error(error).body(), status_code=500)


def _model(server: Server, name: str) -> dict:
    """OpenAI's model object of the model `name`, or a 404 unless it is the server's."""
    if name != server.model_name:
        raise APIError(404, f"The model `{protocol.quoted(name)}` does not exist; this server has "
                            f"`{server.model_name}`.", param="model", code="model_not_found")
    return {"id": server.model_name, "object": "model", "created": 0, "owned_by": "specdecode"}
