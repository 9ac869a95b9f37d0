"""The thread that owns the models: requests wait in a queue and are decoded one step at a time.

A model's KV cache holds one sequence (`models.base.CausalLM`), so the worker runs one generation at a
time, in arrival order, and hands each step's event to the request's asyncio queue. A request that is
cancelled (its client went away) stops before its next step, and the target's cache is freed.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdecode.engine import GenerationConfig, GenerationResult, SpeculativeEngine, StepEvent


@dataclass
class Step:
    """A StepEvent and the text of each of its tokens (for colouring; joined they give event.text)."""

    event: StepEvent
    pieces: list[str]
    rejected_text: str = ""


def token_pieces(tokenizer, output: list[int], event: StepEvent) -> list[str]:
    """Split a step's new text among its tokens. `output`: every generated id up to and including the
    step's. Decodes a short window before each token; where a character spans tokens or a stop string
    cut the text, the step's text goes to its last token."""
    n = len(event.token_ids)
    if n == 0:
        return []
    start = len(output) - n
    window = max(0, start - 8)
    texts = [tokenizer.decode(output[window:k], skip_special_tokens=True).rstrip("\ufffd") for k in range(start, len(output) + 1)]
    pieces = [texts[i + 1][len(texts[i]):] if texts[i + 1].startswith(texts[i]) else "" for i in range(n)]
    if "".join(pieces) != event.text:
        pieces = [""] * (n - 1) + [event.text]
    return pieces


@dataclass
class Job:
    make_engine: Callable[[], SpeculativeEngine]  # called on the worker thread (an engine may search or build)
    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # StepEvent..., then a GenerationResult or an Exception
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when the worker took it up


class Worker:
    """Runs jobs one after another on a daemon thread; `on_finish(job, result)` sees every result."""

    def __init__(self, tokenizer, on_finish: Callable[[Job, GenerationResult], None] = lambda job, result: None):
        self.tokenizer = tokenizer
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._on_finish = on_finish
        self._thread = threading.Thread(target=self._run, name="specdecode-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _send(self, job: Job, item: Step | GenerationResult | BaseException) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, item)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                continue
            job.started = time.perf_counter()
            engine = None
            try:
                engine = job.make_engine()
                stream = engine.stream(job.prompt_ids, job.config)
                output: list[int] = []
                for event in stream:
                    if job.cancelled.is_set():
                        break
                    output += event.token_ids
                    rejected = self.tokenizer.decode(event.rejected_ids, skip_special_tokens=True) if event.rejected_ids else ""
                    self._send(job, Step(event, token_pieces(self.tokenizer, output, event), rejected))
            except Exception as error:  # reaches the request as its error (UserError: 400, others: 500)
                self._send(job, error)
                if engine is not None:
                    engine.target.reset()
                continue
            if job.cancelled.is_set():
                stream.close()
                engine.target.reset()  # frees the cancelled sequence's cache
                continue
            assert stream.result is not None
            self._on_finish(job, stream.result)
            self._send(job, stream.result)
