"""The thread that owns the models: requests wait in a queue and are decoded step by step, together.

Requests whose method drafts without a model (plain decoding, prompt lookup, retrieval) are decoded as
one batch (`engine.batch.BatchEngine`): one target forward per step for all of them, newcomers joining
at the next step, up to `max_batch` at once. A request whose drafter runs a model (the draft model, layer
skipping, lookahead's window...) has the target to itself: it waits for the batch to drain, runs alone,
and no new request joins the batch while it waits (so it is not starved). On a backend whose cache holds
one sequence (llama.cpp) every request runs alone, in arrival order.

Each step's event goes to the request's asyncio queue. A request that is cancelled (its client went
away) leaves before the next step, and its cache entries are freed.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdecode.drafters.base import Drafter
from specdecode.engine import GenerationConfig, GenerationResult, SpeculativeEngine, StepEvent
from specdecode.engine.batch import BatchEngine
from specdecode.methods import resolve
from specdecode.models.base import CausalLM

DEFAULT_MAX_BATCH = 8


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
    method: str
    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # Step..., then a GenerationResult or an Exception
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when the worker took it up
    output: list[int] = field(default_factory=list)


class Worker:
    """Runs jobs on a daemon thread. `engine_for(method)`: the method's engine, for a request that runs
    alone; `drafter_for(method)`: a new drafter for one sequence of a batch (None: plain decoding), asked
    only for methods whose `Method.batchable`; `on_finish(job, result)` sees every result."""

    def __init__(
        self,
        target: CausalLM,
        tokenizer,
        engine_for: Callable[[str], SpeculativeEngine],
        drafter_for: Callable[[str], Drafter | None],
        on_finish: Callable[[Job, GenerationResult], None] = lambda job, result: None,
        max_batch: int = DEFAULT_MAX_BATCH,
        on_batch_step: Callable[[int, int], None] = lambda size, drafted: None,
    ):
        self.tokenizer = tokenizer
        self.engine_for, self.drafter_for, self._on_finish = engine_for, drafter_for, on_finish
        self._on_batch_step = on_batch_step  # (sequences, draft tokens verified) after every batched forward
        self.max_batch = max_batch
        self.batch = BatchEngine(target, tokenizer) if target.several_sequences and max_batch > 1 else None
        self._incoming: queue.Queue[Job | None] = queue.Queue()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: dict[int, Job] = {}  # batch member id -> job
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdecode-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._incoming.put(job)

    def stop(self) -> None:
        self._incoming.put(None)
        self._thread.join(timeout=30)

    # -- on the worker thread ---------------------------------------------------------------------

    def _send(self, job: Job, item: Step | GenerationResult | BaseException) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, item)

    def _emit(self, job: Job, event: StepEvent) -> None:
        job.output += event.token_ids
        rejected = self.tokenizer.decode(event.rejected_ids, skip_special_tokens=True) if event.rejected_ids else ""
        self._send(job, Step(event, token_pieces(self.tokenizer, job.output, event), rejected))

    def _finish(self, job: Job, result: GenerationResult) -> None:
        self._on_finish(job, result)
        self._send(job, result)

    def _take_incoming(self, block: bool) -> None:
        try:
            while True:
                job = self._incoming.get(block=block)
                block = False
                if job is None:
                    self._stopping = True
                    return
                self._waiting.append(job)
        except queue.Empty:
            pass

    def _run(self) -> None:
        while not self._stopping:
            self._take_incoming(block=not self._active and not self._waiting)
            self._admit()
            for ident, job in list(self._active.items()):
                if job.cancelled.is_set():
                    self.batch.remove(ident)
                    del self._active[ident]
            if self._active:
                self._step_batch()

    def _admit(self) -> None:
        """Move waiting jobs into the batch in arrival order; run a job that must run alone once the
        batch is empty (nothing joins the batch while such a job waits)."""
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled.is_set():
                self._waiting.popleft()
                continue
            try:
                if self.batch is None or not resolve(job.method)[0].batchable:
                    if self._active:
                        return  # wait for the batch to drain
                    self._waiting.popleft()
                    job.started = time.perf_counter()
                    self._run_alone(job)
                    continue
                if len(self._active) >= self.max_batch:
                    return
                job.started = time.perf_counter()
                drafter = self.drafter_for(job.method)
                self._active[self.batch.add(job.prompt_ids, job.config, drafter, job.method)] = job
                self._waiting.popleft()
            except Exception as error:  # reaches the request as its error (UserError: 400, others: 500)
                self._waiting.popleft()
                self._send(job, error)

    def _step_batch(self) -> None:
        try:
            outcomes = self.batch.step()
        except Exception as error:  # every member's request fails with it; the batch starts afresh
            for ident, job in self._active.items():
                self.batch.remove(ident)
                self._send(job, error)
            self._active.clear()
            return
        self._on_batch_step(len(self._active), sum(e.stats.drafted for _, e, _ in outcomes))
        for ident, event, result in outcomes:
            job = self._active.get(ident)
            if job is None:
                continue
            if event.token_ids or event.text:
                self._emit(job, event)
            if result is not None:
                del self._active[ident]
                self._finish(job, result)

    def _run_alone(self, job: Job) -> None:
        engine = None
        try:
            engine = self.engine_for(job.method)
            stream = engine.stream(job.prompt_ids, job.config)
            for event in stream:
                if job.cancelled.is_set():
                    stream.close()
                    engine.target.reset()  # frees the cancelled sequence's cache
                    return
                self._emit(job, event)
        except Exception as error:
            self._send(job, error)
            if engine is not None:
                engine.target.reset()
            return
        assert stream.result is not None
        self._finish(job, stream.result)
