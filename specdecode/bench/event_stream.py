"""One streamed answer of an OpenAI-compatible engine, read as server-sent events and checked: an answer the bench
counts must have ended (a `finish_reason`; a stream that breaks off, or that the engine's own limit cut short, is a
failure, not a fast answer), its token count must be the engine's (`usage`) and agree with the ids streamed and
with `max_tokens`, and a stream that stalls ends at the request's deadline. Every way it fails is a UserError
saying which (the harness records it as the run's failure)."""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field

from specdecode.errors import UserError


@dataclass
class Answer:
    pieces: list[str] = field(default_factory=list)
    ids: list[int] | None = field(default_factory=list)  # None once a chunk with text comes without its ids
    usage: dict | None = None
    finish: str | None = None  # the last choice's finish_reason
    final: dict = field(default_factory=dict)  # the engine's own figures (`speculative`, `timings`)
    first: float | None = None  # seconds to the first token


def read(response, label: str, url: str, start: float, deadline: float) -> Answer:
    """The events of `response` (an urllib response) up to `[DONE]` or the stream's end."""
    kind = response.headers.get_content_type()
    if kind != "text/event-stream":
        raise UserError(f"engine {label}: {url} answered {kind}, not a stream of events (does it take `stream: true`?)")
    answer = Answer()
    try:
        for line in response:
            if time.perf_counter() > deadline:
                raise UserError(f"engine {label}: no whole answer within {deadline - start:.0f} s (the request's "
                                "limit: an engine's ;timeout= field)")
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            _take(answer, json.loads(data), label, start)
    except (http.client.HTTPException, ConnectionError) as error:
        raise UserError(f"engine {label}: the connection to {url} broke mid-answer ({type(error).__name__})") from None
    except ValueError as error:
        if isinstance(error, UserError):
            raise
        raise UserError(f"engine {label}: {url} streamed something other than JSON events") from None
    return answer


def _take(answer: Answer, chunk, label: str, start: float) -> None:
    if not isinstance(chunk, dict):
        raise UserError(f"engine {label} streamed an event that is not a JSON object: {json.dumps(chunk)[:80]}")
    if chunk.get("error"):
        raise UserError(f"engine {label} failed mid-answer:{error_text(chunk)}")
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        piece_ids = chunk_ids(chunk, choice)
        if piece or piece_ids:
            answer.first = answer.first if answer.first is not None else time.perf_counter() - start
            answer.pieces.append(piece or "")
            answer.ids = None if answer.ids is None or piece_ids is None else answer.ids + piece_ids
        answer.finish = choice.get("finish_reason") or answer.finish
    answer.usage = chunk.get("usage") or answer.usage
    answer.final.update({key: chunk[key] for key in ("speculative", "timings") if chunk.get(key)})


def counted(answer: Answer, label: str, max_tokens: int) -> int:
    """The answer's tokens, by the engine's count, once the answer is shown whole and that count plausible."""
    arrived = f"{len(answer.ids) if answer.ids is not None else len(answer.pieces)} tokens arrived"
    if answer.finish is None:
        raise UserError(f"engine {label}: the stream ended before the answer did ({arrived}, no finish_reason): the "
                        "connection dropped, or the engine stopped")
    if answer.finish == "abort":  # (vLLM's and SGLang's, for a request they gave up)
        raise UserError(f"engine {label} aborted the answer ({arrived})")
    usage = answer.usage
    if not usage or not isinstance(usage.get("completion_tokens"), int):
        raise UserError(f"engine {label}: the stream carries no token counts (`usage` with "
                        "stream_options.include_usage): tokens per second cannot be measured from it")
    tokens = usage["completion_tokens"]
    if tokens > max_tokens:
        raise UserError(f"engine {label} counts {tokens} tokens in an answer of at most max_tokens {max_tokens}")
    if answer.ids is not None and answer.ids and len(answer.ids) != tokens:
        raise UserError(f"engine {label} counts {tokens} tokens in `usage` but streamed {len(answer.ids)} token ids")
    if answer.finish == "length" and tokens < max_tokens:
        raise UserError(f"engine {label} cut the answer at {tokens} of {max_tokens} tokens (finish_reason length: a "
                        "limit of the engine's, such as its time per request or its context)")
    return tokens


def chunk_ids(chunk: dict, choice: dict) -> list[int] | None:
    """The token ids a streamed chunk carries: ours in `specdecode.tokens`, vLLM's in the choice's
    `token_ids` (with `return_token_ids`); None when it carries none."""
    ours = chunk.get("specdecode")
    if isinstance(ours, dict) and isinstance(ours.get("tokens"), list):
        return [t["id"] for t in ours["tokens"]]
    if isinstance(choice.get("token_ids"), list):
        return list(choice["token_ids"])
    return None


def error_text(body: dict) -> str:
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    return f" {str(message)[:300]}" if message else ""
