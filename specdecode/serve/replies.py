"""What a request gets back: the body of a finished generation, the server-sent events of a streamed one
(OpenAI's chunks, each with our `specdecode.tokens`: every new token's id, text and origin), and what a
failure becomes for the client (`api_error`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import Request

from specdecode.engine import GenerationResult
from specdecode.errors import UserError
from specdecode.serve import protocol
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.protocol import APIError, SamplingRequest
from specdecode.serve.worker import Busy, Job, Step

NOT_READY_RETRY_SECONDS = 10


def response(result: GenerationResult, chat: bool, model_name: str) -> dict:
    """The body of a finished generation."""
    choice = {"index": 0, "finish_reason": protocol.finish_reason(result), "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice["text"] = result.text
    return {
        "id": protocol.new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion" if chat else "text_completion",
        "created": protocol.now(),
        "model": model_name,
        "choices": [choice],
        "usage": protocol.usage(result),
        "speculative": protocol.speculative(result),
    }


async def chunks(job: Job, first, body: SamplingRequest, chat: bool, model_name: str,
                 metrics: ServerMetrics) -> AsyncIterator[str]:
    """A streamed generation's events from its first item on, then `[DONE]`; a client that leaves
    mid-stream cancels the job."""
    ident, created = protocol.new_id("chatcmpl" if chat else "cmpl"), protocol.now()

    def chunk(choices: list[dict], **extra) -> str:
        body_ = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                 "created": created, "model": model_name, "choices": choices, **extra}
        return f"data: {json.dumps(body_)}\n\n"

    def choice(text: str | None, finish: str | None = None, role: bool = False) -> list[dict]:
        if not chat:
            return [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
        delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
        return [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]

    finished = False
    metrics.running.inc()
    try:
        if chat:
            yield chunk(choice(None, role=True))
        item = first
        while True:
            if isinstance(item, BaseException):
                yield f"data: {json.dumps(api_error(item).body())}\n\n"
                break
            if isinstance(item, GenerationResult):
                yield chunk(choice(None, protocol.finish_reason(item)), speculative=protocol.speculative(item))
                if body.include_usage():
                    yield chunk([], usage=protocol.usage(item))
                break
            yield chunk(choice(item.event.text), specdecode=step_payload(item))
            item = await job.events.get()
        finished = True
        yield "data: [DONE]\n\n"
    finally:
        metrics.running.dec()
        if not finished:  # the client went away mid-stream: stop the generation, free its cache
            job.cancelled.set()
            metrics.cancelled.inc()


def step_payload(step: Step) -> dict:
    event = step.event
    return {
        "tokens": [{"id": t, "text": p, "origin": o} for t, p, o in zip(event.token_ids, step.pieces, event.origins)],
        "rejected": step.rejected_text,  # what the draft said where the target disagreed (chains)
        "drafted": event.stats.drafted,
        "accepted": event.stats.accepted,
    }


def api_error(error: BaseException) -> APIError:
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


async def disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body was read already: nothing else arrives)."""
    with contextlib.suppress(Exception):  # a connection that fails is one that left
        while (await request.receive())["type"] != "http.disconnect":
            pass
