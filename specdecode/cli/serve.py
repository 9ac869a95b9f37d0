"""`specdecode serve`: the OpenAI-compatible server and the demo page (`specdecode.serve`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specdecode.cli.options import (
    Backend, BackendOption, DatastoreOption, DraftDType, DraftDTypeOption, DrafterOption, DType, DTypeOption,
    MemoryScope, MethodName, TargetOption, console)
from specdecode.errors import UserError
from specdecode.models.registry import DEFAULT_DRAFTER, DEFAULT_TARGET


def serve(
    method: Annotated[MethodName, typer.Option(help="The method of requests that name none.")] = MethodName("pld"),
    host: Annotated[str, typer.Option(
        help="Address to listen on (127.0.0.1: this machine only; anything else needs --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    api_key: Annotated[list[str] | None, typer.Option(
        envvar="SPECDECODE_API_KEY", show_envvar=True,
        help="A key clients must send as `Authorization: Bearer KEY` (repeat for several tenants; in the "
             "variable, separate keys by spaces). Required beyond loopback.")] = None,
    allowed_host: Annotated[list[str] | None, typer.Option(
        help="A name clients may use in the Host header, beside the loopback names and the bound address "
             "(repeatable; '*': any). Guards against DNS rebinding.")] = None,
    methods: Annotated[str | None, typer.Option(
        help="Comma-separated methods clients may pick (tree forms included), all prepared at start-up "
             "(default: every method; --method is prepared at start-up, another on its first request, in "
             "the background, answering 503 until ready).")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="The most tokens a request may generate.")] = 4096,
    default_max_tokens: Annotated[int, typer.Option(
        min=1, help="Tokens a chat request that names no max_tokens generates at most.")] = 512,
    request_timeout: Annotated[float, typer.Option(
        min=0.001, help="Seconds from a request's arrival after which its generation ends where it is.")] = 300.0,
    max_queue: Annotated[int, typer.Option(
        min=1, help="Requests that may wait for the model; beyond, 429 with Retry-After.")] = 64,
    max_prompt_tokens: Annotated[int | None, typer.Option(
        min=1, help="The longest prompt in tokens (400 beyond, before any work; default: the context).")] = None,
    max_body_mib: Annotated[float, typer.Option(min=0.001, help="The largest request body, in MiB (413 beyond).")] = 4.0,
    read_timeout: Annotated[float, typer.Option(
        min=0.001, help="Seconds a client has to send a request's headers, and again its body.")] = 15.0,
    memory_scope: Annotated[MemoryScope, typer.Option(
        help="Who shares the memory of earlier requests (suffix decoding's text, eagle3-online's learning): "
             "tenant (one API key and `user` field; a request with neither shares nothing), request (nobody), "
             "server (everybody: one trusted user only).")] = MemoryScope("tenant"),
    memory_owners: Annotated[int, typer.Option(
        min=1, help="Memory owners kept for each API key, its least recently used forgotten first.")] = 64,
    memory_budget_gib: Annotated[float | None, typer.Option(
        min=0.0, help="What one API key's owners' memories may hold together, in GiB, its least recently used "
                      "forgotten first (default: a quarter of this machine's memory, shared out among the keys).")] = None,
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
    datastore: DatastoreOption = None,
    target: TargetOption = DEFAULT_TARGET,
    drafter: DrafterOption = DEFAULT_DRAFTER,
) -> None:
    """An OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming) and the demo page at /."""
    import uvicorn

    from specdecode.api import load_models
    from specdecode.methods import choose
    from specdecode.serve.app import Limits, Server, create_app
    from specdecode.serve.guard import Guard, uvicorn_options

    # every method resolved before the models load: the default one with the datastore it retrieves from,
    # the others offered with it where they take one
    default = choose(method.value, datastore=datastore)
    if no_drafter and default.method.needs_draft_model:
        raise UserError(f"method {method.value!r} needs the draft model; drop --no-drafter or pick another --method")
    offered = [choose(m.strip(), datastore=datastore, only_if_taken=True)
               for m in methods.split(",") if m.strip()] if methods else None
    keys = tuple(word for key in api_key or () for word in key.split())
    guard = Guard.for_address(host, tuple(allowed_host or ()), api_keys=keys, docs=docs,
                              max_body_bytes=int(max_body_mib * 2**20), read_seconds=read_timeout)
    limits = Limits(max_tokens=max_tokens, default_max_tokens=default_max_tokens, request_seconds=request_timeout,
                    max_queue=max_queue, max_prompt_tokens=max_prompt_tokens)
    models = load_models(target, None if no_drafter else drafter, dtype=dtype.value, draft_dtype=draft_dtype.value,
                         backend=backend.value)
    name = model_name or Path(target.rstrip("/")).name.removesuffix(".gguf")
    server = Server(models, name, default, datastore=str(datastore) if datastore else None, max_batch=max_batch,
                    limits=limits, methods=offered, memory_scope=memory_scope.value, memory_owners=memory_owners,
                    memory_budget=_memory_budget(memory_budget_gib, len(keys)))
    console.print(f"serving [bold]{name}[/] ({method.value} by default) on http://{host}:{port}/ "
                  f"({'API key required' if keys else 'no API key: this machine only'}); Ctrl-C stops")
    uvicorn.run(create_app(server, guard), host=host, port=port, **uvicorn_options(guard))


def _memory_budget(gib: float | None, keys: int) -> int:
    """Bytes one API key's memory owners may hold together: `gib`, or a quarter of the machine's memory shared
    out among the keys."""
    from specdecode.serve.engines import default_memory_budget

    return default_memory_budget() // max(1, keys) if gib is None else int(gib * 2**30)
