"""The server's stream of a request with several generations (`serve.replies.chunks`: a request's sampled choices, a
batch of prompts): each generation's chunks go out as they come, the first before a later generation has begun (the
batch may hold it back until an earlier one ends), each under its choice's index, and `[DONE]` once all have ended."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

from specdecode.engine import GenerationResult
from specdecode.engine.sequence import StepEvent
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.protocol import CompletionRequest
from specdecode.serve.replies import Answer, Choices, chunks
from specdecode.serve.worker import Step
from specdecode.types import StepStats


def step(text: str) -> Step:
    stats = StepStats(drafted=0, accepted=0, new_tokens=1, draft_seconds=0.0, verify_seconds=0.0, forward_tokens=1)
    return Step(StepEvent(token_ids=[7], origins=["target"], text=text, stats=stats), [text])


def result(text: str) -> GenerationResult:
    return GenerationResult(prompt_ids=[1, 2], token_ids=[7], text=text, steps=[], seconds=1.0,
                            finish_reason="length", method="pld")


def test_a_generation_streams_before_a_later_one_begins():
    async def run() -> list[dict]:
        jobs = [SimpleNamespace(events=asyncio.Queue(), cancelled=threading.Event()) for _ in range(2)]
        body = CompletionRequest(model="m", prompt="x", n=2, temperature=1.0, stream=True,
                                 stream_options={"include_usage": True})
        answer = Answer(False, "m")
        stream = chunks(jobs, [step("a"), None], body, Choices([answer, answer], [0, 1]), ServerMetrics())
        first = await asyncio.wait_for(stream.__anext__(), 5)  # the second generation has not begun
        assert not jobs[1].cancelled.is_set()
        jobs[0].events.put_nowait(result("a"))
        for item in (step("b"), result("b")):
            jobs[1].events.put_nowait(item)
        rest = [line async for line in stream]
        assert rest[-1] == "data: [DONE]\n\n"
        return [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]

    sent = asyncio.run(run())
    assert [(c["index"], c["text"]) for chunk in sent for c in chunk["choices"] if c["text"]] == [(0, "a"), (1, "b")]
    assert [c["index"] for chunk in sent for c in chunk["choices"] if c["finish_reason"]] == [0, 1]
    assert sent[-1]["usage"]["completion_tokens"] == 2 and sent[-1]["usage"]["prompt_tokens"] == 2
