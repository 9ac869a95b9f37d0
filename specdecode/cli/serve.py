"""`specdecode serve`: the OpenAI-compatible server and the demo page (`specdecode.serve`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from specdecode.cli.options import (
    Backend, BackendOption, ChunkPolicy, DatastoreOption, DeviceOption, DraftDType, DraftDTypeOption, DrafterOption,
    DType, DTypeOption, HeadOption, MemoryScope, MethodName, TargetOption, backend_device, console)
from specdecode.errors import UserError
from specdecode.models.registry import DEFAULT_DRAFTER, DEFAULT_TARGET

T = TypeVar("T")


# The options of who may call the server, what it offers and what it keeps, named here to keep `serve` short.
ApiKeyOption = Annotated[list[str] | None, typer.Option(
    envvar="SPECDECODE_API_KEY", show_envvar=True,
    help="A key clients must send as `Authorization: Bearer KEY`: one word of at least 16 characters "
         "(`openssl rand -hex 24`). One key per --api-key, repeated for several tenants; in the variable, "
         "keys separated by spaces. Required beyond loopback.")]
MetricsKeyOption = Annotated[str | None, typer.Option(
    envvar="SPECDECODE_METRICS_KEY", show_envvar=True,
    help="The key /metrics answers to (its counters are every tenant's). Without it, /metrics answers to the API "
         "key where there is one, and to no key where there are several.")]
AllowedHostOption = Annotated[list[str] | None, typer.Option(
    help="A name clients may use in the Host header, beside the loopback names and the bound address "
         "(repeatable; '*': any). Guards against DNS rebinding.")]
AllowedOriginOption = Annotated[list[str] | None, typer.Option(
    help="A web page's origin (scheme://host[:port], e.g. http://localhost:3000) whose scripts may call the "
         "API, with CORS (repeatable). Requests but GET, HEAD and OPTIONS from another site's page are "
         "refused (403), and so is any whose body is not sent as application/json (415).")]
MethodsOption = Annotated[str | None, typer.Option(
    help="Comma-separated methods clients may pick (tree forms included), all prepared at start-up "
         "(default: every method; --method is prepared at start-up, another on its first request, in "
         "the background, answering 503 until ready).")]

MemoryBudgetOption = Annotated[float | None, typer.Option(
    min=0.0, help="What one API key's owners' memories may hold together, in GiB, its least recently used forgotten "
                  "first (default: a quarter of this machine's memory, shared out among the keys).")]
PrefixCacheOption = Annotated[float, typer.Option(
    min=0.0, help="GiB of ended requests' keys and values the batch keeps for later prompts that begin as they do (a "
                  "conversation's next turn), shared out among the API keys; 0: none.")]
ChunkSecondsOption = Annotated[float | None, typer.Option(
    min=0.01, show_default=False,
    help="Seconds of prompt feeding one step of the batch carries at most (default: one): a longer prompt is fed in "
         "chunks of this beside the requests decoding (smaller: steadier streams while prompts arrive; larger: "
         "prompts fed in fewer forwards).")]
ChunkPolicyOption = Annotated[ChunkPolicy, typer.Option(
    help="When a long prompt's chunk goes into a step of the batch: turns (once the steps since the last chunk took as "
         "long as it did: the requests decoding keep half of the time at their own pace) or every (every step while "
         "the prompt is fed, the requests decoding riding in it: smaller stalls, best with a small --chunk-seconds).")]


def serve(
    method: Annotated[MethodName, typer.Option(help="The method of requests that name none.")] = MethodName("auto"),
    host: Annotated[str, typer.Option(
        help="Address to listen on (127.0.0.1: this machine only; anything else needs --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    api_key: ApiKeyOption = None,
    metrics_key: MetricsKeyOption = None,
    allowed_host: AllowedHostOption = None,
    allowed_origin: AllowedOriginOption = None,
    methods: MethodsOption = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="The most tokens a request may generate.")] = 4096,
    default_max_tokens: Annotated[int, typer.Option(
        min=1, help="Tokens a chat request whose max_tokens is left out or null generates at most (OpenAI's API: "
                    "the rest of the context); a completion's is OpenAI's 16.")] = 512,
    request_timeout: Annotated[float, typer.Option(
        min=0.001, help="Seconds from a request's arrival after which its generation ends where it is.")] = 300.0,
    max_queue: Annotated[int, typer.Option(
        min=1, help="Requests that may wait for the model; beyond, 429 with Retry-After.")] = 64,
    max_prompt_tokens: Annotated[int | None, typer.Option(
        min=1, help="The longest prompt a request may send, in tokens (400 beyond, before any work on it; "
                    "default: the model's context).")] = None,
    max_body_mib: Annotated[float, typer.Option(
        min=0.001, help="The largest request body, in MiB (413 beyond).")] = 4.0,
    read_timeout: Annotated[float, typer.Option(
        min=0.001, help="Seconds a client has to send a request's headers, and again its body.")] = 15.0,
    memory_scope: Annotated[MemoryScope, typer.Option(
        help="Who shares the memory of earlier requests (suffix decoding's text, eagle3-online's learning): "
             "tenant (one API key and `user` field; a request with neither shares nothing), request (nobody), "
             "server (everybody: one trusted user only).")] = MemoryScope("tenant"),
    memory_owners: Annotated[int, typer.Option(
        min=1, help="Memory owners kept for each API key, its least recently used forgotten first.")] = 64,
    memory_budget_gib: MemoryBudgetOption = None,
    prefix_cache_gib: PrefixCacheOption = 1.0,
    chunk_seconds: ChunkSecondsOption = None,
    chunk_policy: ChunkPolicyOption = ChunkPolicy("turns"),
    docs: Annotated[bool, typer.Option("--docs", help="Serve /docs and /openapi.json (behind the key).")] = False,
    model_name: Annotated[str | None, typer.Option(
        help="The model id clients send (default: the target's name).")] = None,
    max_batch: Annotated[int, typer.Option(
        min=1, max=64, help="Requests decoded together in one batch (methods that draft without a model).")] = 8,
    no_drafter: Annotated[bool, typer.Option(
        "--no-drafter", help="Load no draft model (saves its memory; the draft-model methods are then off).")] = False,
    dtype: DTypeOption = DType("auto"),
    draft_dtype: DraftDTypeOption = DraftDType("auto"),
    backend: BackendOption = Backend("torch"),
    device: DeviceOption = "auto",
    datastore: DatastoreOption = None,
    head: HeadOption = None,
    target: TargetOption = DEFAULT_TARGET,
    drafter: DrafterOption = DEFAULT_DRAFTER,
) -> None:
    """An OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming) and the demo page at /."""
    import uvicorn

    from specdecode.api import load_models
    from specdecode.serve.app import Limits, Server, create_app
    from specdecode.serve.guard import uvicorn_options

    default, offered = _methods(method.value, methods, datastore, no_drafter, head, backend.value)
    _port_free(host, port)
    guard, keys = _guard(host, allowed_host, api_key, allowed_origin, docs, max_body_mib, read_timeout, metrics_key)
    name = model_name or Path(target.rstrip("/")).name.removesuffix(".gguf")

    def build() -> Server:  # (off the main thread, where the event loop runs: `on_a_passing_thread`)
        models = load_models(target, None if no_drafter else drafter, dtype=dtype.value, draft_dtype=draft_dtype.value,
                             backend=backend.value, device=backend_device(backend, device))
        return Server(models, name, default, datastore=str(datastore) if datastore else None,
                      head=str(head) if head else None, max_batch=max_batch,
                      limits=Limits(max_tokens=max_tokens, default_max_tokens=default_max_tokens,
                                    request_seconds=request_timeout, max_queue=max_queue,
                                    max_prompt_tokens=max_prompt_tokens),
                      methods=offered, memory_scope=memory_scope.value, memory_owners=memory_owners,
                      memory_budget=_memory_budget(memory_budget_gib, len(keys)),
                      prefix_cache=_prefix_cache(prefix_cache_gib, memory_scope.value, len(keys)),
                      chunk_seconds=chunk_seconds, chunk_policy=chunk_policy.value)

    server = on_a_passing_thread(build)
    console.print(f"serving [bold]{name}[/] ({method.value} by default) on http://{host}:{port}/ ("
                  f"{'API key required' if keys else 'no API key: this machine only'}); Ctrl-C stops")
    uvicorn.run(create_app(server, guard), host=host, port=port, **uvicorn_options(guard))


def on_a_passing_thread(build: Callable[[], T]) -> T:
    """`build()` on a thread of its own that ends with it: where the server loads its models and builds what it
    serves, before its worker thread decodes. Loaded on the main thread, the worker's forwards were slower than the
    same forwards on the main thread, each of their hundreds of OpenMP parallel regions dearer (measured:
    docs/results/serving.md); loaded on a thread that has ended, they are not. The likely cause: the OpenMP threads
    the main thread started stay beside the worker's, and libgomp, managing more threads than there are cores, lets
    a thread waiting between two regions spin only briefly before it sleeps, so each region pays a wake-up."""
    built: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            built.append(build())
        except BaseException as error:  # (raised again on the caller's thread)
            failed.append(error)

    thread = threading.Thread(target=run, name="specdecode-load", daemon=True)  # (Ctrl-C need not wait for it)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return built[0]


def _methods(method: str, methods: str | None, datastore: Path | None, no_drafter: bool, head: Path | None = None,
             backend: str = "torch"):
    """(the default method, the others offered or None: all), resolved before the models load (and their cost curves
    are measured): the default with the datastore it retrieves from and the head it drafts with, the others with them
    where they take them (a head: the methods of its kind); each refused where `backend` cannot run it."""
    from specdecode.methods import choose

    default = choose(method, datastore=datastore, head=head)
    if no_drafter and default.method.needs_draft_model:
        raise UserError(f"method {method!r} needs the draft model; drop --no-drafter or pick another --method")
    offered = [choose(m.strip(), datastore=datastore, head=head, only_if_taken=True)
               for m in methods.split(",") if m.strip()] if methods else None
    for choice in [default, *(offered or ())]:
        choice.check_backend(backend)
    if offered is not None and default.name not in [choice.name for choice in offered]:
        raise UserError(f"the default method {default.name!r} (--method) is not among --methods: add it there, or "
                        "name one of them with --method")
    return default, offered


def _port_free(host: str, port: int) -> None:
    """A port another server holds is the user's to change, said before the models load (uvicorn would say it after)."""
    import socket

    try:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET):
            pass
    except OSError as error:
        raise UserError(f"cannot serve on {host}:{port}: {error.strerror or error} (another server there? --port "
                        "picks another)") from None


def _memory_budget(gib: float | None, keys: int) -> int:
    """Bytes each API key's owners may hold: --memory-budget-gib, else the machine's default shared among the keys."""
    from specdecode.serve.engines import default_memory_budget

    return default_memory_budget() // max(1, keys) if gib is None else int(gib * 2**30)


def _prefix_cache(gib: float, scope: str, keys: int) -> int:
    """Bytes of copied contexts each prefix group keeps: --prefix-cache-gib, shared out among the keys where each key
    is a group of its own (the tenant scope)."""
    return int(gib * 2**30) // (max(1, keys) if scope == "tenant" else 1)


def _guard(host: str, allowed_host, api_key, allowed_origin, docs: bool, max_body_mib: float, read_timeout: float,
           metrics_key: str | None = None):
    """(the server's guard, its keys): one key per --api-key, as given (a key with a space is refused; the
    environment variable is split on spaces by click), the hosts and origins allowed, the body's limits."""
    from specdecode.serve.guard import Guard

    keys = tuple(api_key or ())
    return Guard.for_address(host, tuple(allowed_host or ()), api_keys=keys,
                             allowed_origins=tuple(allowed_origin or ()), docs=docs,
                             max_body_bytes=int(max_body_mib * 2**20), read_seconds=read_timeout,
                             metrics_key=metrics_key), keys
