"""What a request gets back: the body of its finished generations, the server-sent events of streamed ones
(OpenAI's chunks, each with our `specdecode.tokens`: every new token's id, text and origin), a choice for each prompt's
`n` choices (`Choices`: sampled ones a generation each, greedy ones one generation's copies), tool calls read out of
the answer and log-probabilities in both (`Answer`), and what a failure becomes for the client (`api_error`). The
generations' events are read here too (`next_items`, `whole`), a client that leaves cancelling them all."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from specdecode.engine import GenerationResult
from specdecode.errors import UserError
from specdecode.serve import logprobs, protocol
from specdecode.serve.guard import ClientGone
from specdecode.serve.logprobs import TokenTexts
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.protocol import APIError, SamplingRequest
from specdecode.serve.tools import CallReader, ToolUse
from specdecode.serve.worker import Busy, Job, Step
from specdecode.types import TokenLogprob

NOT_READY_RETRY_SECONDS = 10
# items a stream may hold for a client that has not read them: past it the client has stopped reading, and its
# generations end where they are, as at their deadline (else an unread stream's answers filled memory to the end)
BACKLOG = 1024


@dataclass
class Answer:
    """How a request's answer is written beyond its text: the endpoint and model name, the tools whose calls are
    read out of the text (`serve.tools`), the log-probabilities asked for (`texts`: each token's text) and a
    completion's echoed prompt."""

    chat: bool
    model_name: str
    texts: TokenTexts | None = None  # None: no log-probabilities asked for
    tools: ToolUse | None = None
    echo: str | None = None  # the prompt's text before the answer (a completion's `echo`)
    prompt_ids: list[int] = field(default_factory=list)

    def finish_reason(self, result: GenerationResult, called: bool) -> str:
        """OpenAI's: "length" for an answer `max_tokens` cut short, calls read before the cut or not (the last may
        be missing), else "tool_calls" once a call was read."""
        reason = protocol.finish_reason(result)
        return "tool_calls" if called and reason != "length" else reason

    def completion_logprobs(self, result: GenerationResult, entries: list[TokenLogprob], offset: int) -> dict | None:
        if self.texts is None:
            return None
        prompt: list[TokenLogprob | None] = []
        if self.echo is not None and result.prompt_logprobs is not None:
            prompt = [None, *result.prompt_logprobs]
        tokens = self.prompt_ids[: len(prompt)] + result.token_ids[: len(entries)]
        return logprobs.completion_entries([*prompt, *entries], tokens, logprobs.Offsets(self.texts, offset))


@dataclass
class Choices:
    """A request's choices: choice i is written by `answers[i]` (its prompt's) from generation `runs[i]` (a prompt's
    greedy choices read one generation, its sampled ones one each)."""

    answers: list[Answer]
    runs: list[int]

    def usage(self, results: list[GenerationResult]) -> dict:
        """OpenAI's `usage`, from each generation's result: every prompt once, every choice's tokens."""
        firsts: dict[int, int] = {}  # each prompt's (its answer's) first generation
        for answer, run in zip(self.answers, self.runs):
            firsts.setdefault(id(answer), run)
        return protocol.usage([results[run] for run in self.runs], [results[run] for run in firsts.values()])


def response(outcomes: list[tuple[GenerationResult, list[TokenLogprob]]], plan: Choices) -> dict:
    """The body of a finished request, from each generation's result and its tokens' log-probabilities (when asked
    for): its choices (`plan`), `usage` (greedy copies each counted), `speculative` (the generations')."""
    answer = plan.answers[0]
    return {
        "id": protocol.new_id("chatcmpl" if answer.chat else "cmpl"),
        "object": "chat.completion" if answer.chat else "text_completion",
        "created": protocol.now(),
        "model": answer.model_name,
        "choices": [_choice(index, *outcomes[run], plan.answers[index]) for index, run in enumerate(plan.runs)],
        "usage": plan.usage([result for result, _ in outcomes]),
        "speculative": protocol.speculative([result for result, _ in outcomes]),
    }


def _choice(index: int, result: GenerationResult, entries: list[TokenLogprob], answer: Answer) -> dict:
    calls: list[dict] = []
    choice: dict = {"index": index}
    if answer.chat:
        content: str | None = result.text
        if answer.tools is not None:
            content, calls = CallReader(answer.tools).read(result.text)
        choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        choice["logprobs"] = None if answer.texts is None else logprobs.chat_entries(entries, answer.texts)
    else:
        choice["text"] = (answer.echo or "") + result.text
        choice["logprobs"] = answer.completion_logprobs(result, entries, 0)
    choice["finish_reason"] = answer.finish_reason(result, bool(calls))
    return choice


class Chunks:
    """The choices of a streamed answer's chunks: text (content, or a completion's text), tool calls read out of it
    as they close (`serve.tools.CallReader`), each step's log-probabilities; one writer per choice (`index`)."""

    def __init__(self, answer: Answer, index: int = 0):
        self.answer, self.index = answer, index
        self.reader = CallReader(answer.tools) if answer.tools is not None else None
        # where a completion's text stands (its log-probabilities' offsets)
        self.offsets = None if answer.texts is None else logprobs.Offsets(answer.texts, len(answer.echo or ""))

    def first(self) -> list[list[dict]]:
        if self.answer.chat:
            return [self._choice({"role": "assistant", "content": ""})]
        return [self._choice({}, text=self.answer.echo)] if self.answer.echo else []

    def step(self, step: Step) -> list[list[dict]]:
        event, answer = step.event, self.answer
        scores = event.logprobs or []
        if not answer.chat:
            entries = None if self.offsets is None else logprobs.completion_entries(
                scores, event.token_ids, self.offsets)
            return [self._choice({}, text=event.text, scores=entries)]
        entries = None if answer.texts is None else logprobs.chat_entries(scores, answer.texts)
        if self.reader is None:
            return [self._choice({"content": event.text}, scores=entries)]
        content, calls = self.reader.feed(event.text)
        return [self._choice({"content": content} if content else {}, scores=entries), *self._calls(calls)]

    def last(self, result: GenerationResult) -> list[list[dict]]:
        out = []
        if self.reader is not None:
            content, calls = self.reader.finish()
            out = ([self._choice({"content": content})] if content else []) + self._calls(calls)
        called = self.reader is not None and bool(self.reader.calls)
        return out + [self._choice({}, finish=self.answer.finish_reason(result, called))]

    def _calls(self, calls: list[dict]) -> list[list[dict]]:
        assert self.reader is not None
        first = len(self.reader.calls) - len(calls)
        return [self._choice({"tool_calls": [{"index": first + i, **call}]}) for i, call in enumerate(calls)]

    def _choice(self, delta: dict, text: str | None = None, scores: dict | None = None,
                finish: str | None = None) -> list[dict]:
        if not self.answer.chat:
            return [{"index": self.index, "text": text or "", "finish_reason": finish, "logprobs": scores}]
        return [{"index": self.index, "delta": delta, "finish_reason": finish, "logprobs": scores}]


class Reply:
    """How a request's generations are written: here the chat and completion endpoints' bodies (`response`) and
    server-sent events (`chunks`); /v1/responses' are `serve.response_objects`'."""

    def whole(self, outcomes: list[tuple[GenerationResult, list[TokenLogprob]]], plan: Choices) -> dict:
        return response(outcomes, plan)

    def stream(self, jobs: list[Job], firsts: list, body: SamplingRequest, plan: Choices, metrics: ServerMetrics
               ) -> AsyncIterator[str]:
        return chunks(jobs, firsts, body, plan, metrics)


DEFAULT = Reply()  # the chat and completion endpoints' way


async def chunks(jobs: list[Job], firsts: list, body: SamplingRequest, plan: Choices, metrics: ServerMetrics
                 ) -> AsyncIterator[str]:
    """A streamed request's server-sent events: its chunks (`chunk_bodies`), then `[DONE]`."""
    async with contextlib.aclosing(chunk_bodies(jobs, firsts, body, plan, metrics)) as bodies:
        async for each in bodies:
            yield "data: [DONE]\n\n" if each is None else f"data: {json.dumps(each)}\n\n"


async def chunk_bodies(jobs: list[Job], firsts: list, body: SamplingRequest, plan: Choices, metrics: ServerMetrics
                       ) -> AsyncGenerator[dict | None, None]:
    """A streamed request's chunks from each generation's first item on (`firsts`: each generation's, or None where
    none was read yet), then None (the end; a failure's error body ends it instead): each generation's items go to
    the choices that read it (`plan`); a client that leaves mid-stream cancels the jobs."""
    answer = plan.answers[0]
    ident, created = protocol.new_id("chatcmpl" if answer.chat else "cmpl"), protocol.now()
    writers = [Chunks(each, index) for index, each in enumerate(plan.answers)]
    served = [[index for index, read in enumerate(plan.runs) if read == run] for run in range(len(jobs))]

    def chunk(choices: list[dict], **extra) -> dict:
        return {"id": ident, "object": "chat.completion.chunk" if answer.chat else "text_completion",
                "created": created, "model": answer.model_name, "choices": choices, **extra}

    merged: asyncio.Queue = asyncio.Queue()  # (generation, item) as they come
    for run, first in enumerate(firsts):
        if first is not None:  # (None: none read yet)
            merged.put_nowait((run, first))
    pumps = [asyncio.create_task(_pump(job, run, merged)) for run, job in enumerate(jobs) if not _last(firsts[run])]
    results: dict[int, GenerationResult] = {}
    finished = failed = False
    metrics.running.inc()
    try:
        for writer in writers:
            for choices in writer.first():
                yield chunk(choices)
        while len(results) < len(jobs):
            run, item = await merged.get()
            if isinstance(item, BaseException):
                failed = True
                yield api_error(item).body()
                break
            extra = {"speculative": protocol.speculative([item])} if isinstance(item, GenerationResult) else {
                "specdecode": step_payload(item)}  # (the same for every choice the generation serves)
            for index in served[run]:
                if isinstance(item, GenerationResult):
                    *before, final = writers[index].last(item)
                    for choices in before:
                        yield chunk(choices)
                    yield chunk(final, **extra)
                else:
                    main, *calls = writers[index].step(item)
                    yield chunk(main, **extra)
                    for choices in calls:
                        yield chunk(choices)
            if isinstance(item, GenerationResult):
                results[run] = item
        else:
            if body.include_usage():
                yield chunk([], usage=plan.usage([results[run] for run in range(len(jobs))]))
            finished = True
            yield None
    finally:
        metrics.running.dec()
        for pump in pumps:
            pump.cancel()
        if not finished:  # the client went away mid-stream, or a generation failed: stop them all, free their caches
            for job in jobs:
                job.cancelled.set()
            if not failed:  # (counted: clients that left, not failures)
                metrics.cancelled.inc()


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _last(item) -> bool:
    return isinstance(item, (GenerationResult, BaseException))


async def _pump(job: Job, run: int, merged: asyncio.Queue) -> None:
    """A generation's items after its first, into the queue the stream reads, up to its last."""
    while True:
        item = await job.events.get()
        merged.put_nowait((run, item))
        if merged.qsize() > BACKLOG:
            job.deadline = -math.inf  # (read by the worker before its next step)
        if _last(item):
            return


async def next_items(jobs: list[Job], watcher: asyncio.Task, metrics: ServerMetrics) -> list:
    """Each job's next event, or ClientGone once the client has disconnected (the jobs cancelled)."""
    getters = [asyncio.ensure_future(job.events.get()) for job in jobs]
    every = asyncio.gather(*getters)
    await asyncio.wait({every, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if every.done():
        return every.result()
    every.cancel()
    every.add_done_callback(_retrieved)  # (a cancelled gather left unread is logged as an error)
    for job in jobs:
        job.cancelled.set()
    metrics.cancelled.inc()
    raise ClientGone


async def whole(jobs: list[Job], items: list, watcher: asyncio.Task, metrics: ServerMetrics
                ) -> list[tuple[GenerationResult, list]]:
    """Each job's generation and its tokens' log-probabilities (step by step; an expired job's result has none),
    from its first item on (`items`: each job's, or None where none was read yet)."""
    entries: list[list] = [[] for _ in jobs]
    while True:
        for run, item in enumerate(items):
            if isinstance(item, BaseException):
                raise api_error(item)
            if item is not None and not isinstance(item, GenerationResult):
                entries[run] += item.event.logprobs or []
        due = [run for run, item in enumerate(items) if not isinstance(item, GenerationResult)]
        if not due:
            return list(zip(items, entries))
        for run, item in zip(due, await next_items([jobs[run] for run in due], watcher, metrics)):
            items[run] = item


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
        return APIError(400, str(error), param=getattr(error, "param", None))
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
