"""The thread that owns the models: requests wait in a bounded queue and are decoded step by step, together.

Requests whose method can join a batch (`Method.batchable`: plain decoding, the copies, retrieval, the suffix
cache, Jacobi's guesses, Medusa's heads, `auto`) are decoded as one batch (`engine.batch.BatchEngine`): one
target forward per step for all of them, newcomers joining at the next step, up to `max_batch` at once. The
batch runs on the target's weights over a KV cache of its own (`own_cache`). A request whose drafter runs a
model (the draft model, EAGLE's heads with their caches, layer skipping, lookahead's window...) runs alone, on
the target's own cache, one such request at a time, taking turns with the batch by time: a step of it (or a
chunk of its prompt), then the batch's steps until they have had as long (`Turns`), so that neither holds the
other up for a whole answer. On a backend whose cache holds one sequence (llama.cpp) every request runs alone,
in arrival order, each to its end.

A long prompt is fed in chunks, each a step of its job (`costs.prefill_chunk`): in the batch it takes turns
with the other sequences' steps (`engine.pacing.PrefillShare`), so a request that comes in while another's
long prompt is being fed waits for the chunk under way, not for the prompt; a job that runs alone feeds
its chunks one a turn (`Stream.items`). A job that runs alone gets its engine before it is submitted
(`Job.engine`), built beside the worker where it must be built (a new memory owner's: `serve.engines`).

Each step's event goes to the request's asyncio queue. Between two steps, and between two chunks of a
prompt, the worker looks at every job:

- *cancelled* (its client went away): it leaves before the next step, and its cache entries are freed;
- *expired* (past its deadline): it ends where it is, its answer what it has generated so far with the
  finish reason `length`, as if it had reached max_tokens; a job that expires before it starts gets
  `Busy` (the server answers 503).

So a generation stops within one step, or one chunk of its prompt, of either. At most `max_queue` requests
wait for the model: a request takes its place with `enter()` before the server prepares it (tokenizing,
templating, building its engine) and keeps it until the worker starts it or drops it; `enter()` is refused
beyond that (the server answers 429).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdecode.drafters.base import Drafter
from specdecode.engine import GenerationConfig, GenerationResult, SpeculativeEngine, StepEvent, Stream
from specdecode.engine.batch import BatchEngine
from specdecode.engine.prompts import Prefilled
from specdecode.errors import ConstraintError, UserError
from specdecode.methods import MethodChoice
from specdecode.models.base import CausalLM
from specdecode.models.hf import HFCausalLM
from specdecode.types import StepStats

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_QUEUE = 64

log = logging.getLogger("specdecode.serve")


class Busy(Exception):
    """A job that waited past its deadline before the model was free for it."""


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
    texts = [tokenizer.decode(output[window:k], skip_special_tokens=True).rstrip("\ufffd")
             for k in range(start, len(output) + 1)]
    pieces = [texts[i + 1][len(texts[i]):] if texts[i + 1].startswith(texts[i]) else "" for i in range(n)]
    if "".join(pieces) != event.text:
        pieces = [""] * (n - 1) + [event.text]
    return pieces


class Factory(Protocol):
    """What the worker builds a job's engine or drafter with, from its resolved method (`serve.engines.Engines`)."""

    def engine(self, choice: MethodChoice, memory: Hashable | None) -> SpeculativeEngine:
        """The engine a job runs alone with; `memory`: whose cross-request memory it may read (None: its own)."""

    def drafter(self, choice: MethodChoice, memory: Hashable | None) -> Drafter | None:
        """A new drafter for one sequence of a batch (None: plain decoding); `memory`: whose cross-request memory
        it may read and add to (None: its own, forgotten after)."""


@dataclass
class Job:
    choice: MethodChoice  # its method, resolved once where the request came in
    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # Step..., then a GenerationResult or an Exception
    memory: Hashable | None = None  # whose cross-request memory its drafter may read (None: its own only)
    tenant: Hashable = None  # whose prompts' prefixes it may share in the batch (`Server.prefix_group`)
    share: bool = True  # False: its prompt takes no prefix and leaves none (a request's `cache_prompt`)
    engine: SpeculativeEngine | None = None  # built beside the worker for a job that runs alone (None: the factory's)
    deadline: float = math.inf  # time.perf_counter() past which it ends where it is
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when the worker took it up
    output: list[int] = field(default_factory=list)  # what it generated so far ...
    text: str = ""
    steps: list[StepStats] = field(default_factory=list)
    expired: bool = False  # ended at its deadline
    param: str | None = None  # the request field its constraint comes from, named in a ConstraintError's 400

    def past_deadline(self) -> bool:
        return time.perf_counter() > self.deadline

    @property
    def forgets(self) -> bool:
        """Whether its engine must forget earlier jobs before it runs: a remembering method's engine for jobs
        with no memory owner is shared by all of them (`serve.engines`). The worker calls `forget`, not whoever
        hands the engine out: another job may be running on it then."""
        return self.memory is None and self.choice.method.remembers

    def so_far(self) -> GenerationResult:
        """What it generated up to now, as a result that reached its length."""
        return GenerationResult(prompt_ids=self.prompt_ids, token_ids=self.output, text=self.text, steps=self.steps,
                                seconds=time.perf_counter() - (self.started or self.submitted),
                                finish_reason="length", method=self.choice.name)


def own_cache(target: CausalLM) -> CausalLM | None:
    """The target's weights over a KV cache of their own, sharing its cost curve: what the batch runs on, so that a
    job that runs alone, on the target's cache, takes turns with it. None where the backend holds one sequence."""
    if not isinstance(target, HFCausalLM):
        return None
    view = target.sibling()  # on the target's own path (a static target's: static too)
    view._live_curve = target.cost_curve()  # one curve per model, corrected by both (`CausalLM.cost_curve`)
    return view


class Turns:
    """The batch and the job that runs alone beside it take turns by time (`clock`: the worker's, a test's may count
    forwards): whichever has had less since both were there goes next, a step (or a chunk of a prompt) at a time."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock, self.seconds = clock, {True: 0.0, False: 0.0}  # alone -> seconds since both were there

    def alone_next(self) -> bool:
        return self.seconds[True] <= self.seconds[False]


@dataclass
class Alone:
    """The job that runs alone, under way: its engine and the items of its stream (`Stream.items`)."""

    job: Job
    engine: SpeculativeEngine
    stream: Stream
    items: Iterator[StepEvent | Prefilled]


class Worker:
    """Runs jobs on a daemon thread. `factory` builds the engine of a job that runs alone (for its method and memory)
    and a new drafter for one sequence of a batch, asked only for methods whose `Method.batchable`; `on_finish(job,
    result)` sees every result. `batch_target`: what the batch runs on (default: `own_cache(target)`; None there: every
    job runs alone); `batch_options`: `BatchEngine`'s keyword arguments (`keep_bytes`, `chunk_seconds`)."""

    def __init__(
        self,
        target: CausalLM,
        tokenizer,
        factory: Factory,
        on_finish: Callable[[Job, GenerationResult], None] = lambda job, result: None,
        max_batch: int = DEFAULT_MAX_BATCH,
        on_batch_step: Callable[[int, int], None] = lambda size, drafted: None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        batch_target: CausalLM | None = None,
        batch_options: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,  # what the turns are timed by (`Turns`)
    ):
        self.tokenizer = tokenizer
        self.factory, self._on_finish = factory, on_finish
        self._on_batch_step = on_batch_step  # (sequences, draft tokens verified) after every batched forward
        self.max_batch, self.max_queue = max_batch, max_queue
        batch_target = batch_target or (own_cache(target) if target.several_sequences and max_batch > 1 else None)
        # (its cache its own: ended requests' contexts stay for later prompts' prefixes, `keep_ended`, `keep_bytes`)
        self.batch = (BatchEngine(batch_target, tokenizer, keep_ended=max_batch, **(batch_options or {}))
                      if batch_target is not None else None)
        self._incoming: queue.Queue[Job | None] = queue.Queue()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: dict[int, Job] = {}  # batch member id -> job
        self._alone: Alone | None = None  # the job that runs alone, under way
        self._turns = Turns(clock)
        self._queued = 0  # places taken in the queue (`enter`)
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdecode-worker", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Requests waiting for the model (being prepared, or submitted and not started)."""
        return self._queued

    def enter(self) -> bool:
        """Take a place in the queue for a request about to be prepared; False when it is full."""
        with self._lock:
            if self._queued >= self.max_queue:
                return False
            self._queued += 1
            return True

    def leave(self) -> None:
        """Give a place back: the request will not be submitted after all (or has left the queue)."""
        with self._lock:
            self._queued -= 1

    def _batched(self) -> BatchEngine:
        """The batch engine, which every job in `_active` is in (a worker without one runs each job alone)."""
        if self.batch is None:
            raise RuntimeError("this worker has no batch engine: its jobs run alone")
        return self.batch

    def runs_alone(self, choice: MethodChoice, config: GenerationConfig | None = None) -> bool:
        """Whether a job of this method has the target to itself (its engine: `Job.engine`), or joins the batch
        (not one that asks for its prompt's log-probabilities, `config.echo`: the batch does not score prompts)."""
        return self.batch is None or not choice.method.batchable or (config is not None and config.echo)

    def submit(self, job: Job) -> None:
        """Queue a job that holds a place (`enter`); the worker gives the place back as it takes the job."""
        self._incoming.put(job)

    def stop(self) -> None:
        self._incoming.put(None)
        self._thread.join(timeout=30)

    # -- on the worker thread ---------------------------------------------------------------------

    def _send(self, job: Job, item: Step | GenerationResult | BaseException) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, item)

    def _emit(self, job: Job, event: StepEvent) -> None:
        job.output += event.token_ids
        job.text += event.text
        if event.stats.forward_tokens:  # a step (a held-back text's last event ran no forward)
            job.steps.append(event.stats)
        rejected = self.tokenizer.decode(event.rejected_ids, skip_special_tokens=True) if event.rejected_ids else ""
        self._send(job, Step(event, token_pieces(self.tokenizer, job.output, event), rejected))

    def _finish(self, job: Job, result: GenerationResult) -> None:
        self._on_finish(job, result)
        self._send(job, result)

    def _expire(self, job: Job) -> None:
        job.expired = True
        self._finish(job, job.so_far())

    def _fail(self, job: Job, error: BaseException) -> None:
        if not isinstance(error, (Busy, UserError)):  # the server's fault: its log says what happened
            log.error("request failed (method %s)", job.choice.name, exc_info=error)
        if isinstance(error, ConstraintError) and error.param is None:
            error = ConstraintError(str(error), job.param)
        self._send(job, error)

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
            self._take_incoming(block=not self._active and not self._waiting and self._alone is None)
            self._admit()
            for ident, job in list(self._active.items()):
                if job.cancelled.is_set() or job.past_deadline():
                    self._batched().remove(ident)
                    del self._active[ident]
                    if not job.cancelled.is_set():
                        self._expire(job)
            if self._alone is None or not self._active:
                self._turns = Turns(self._turns.clock)  # one of them alone: nothing owed
            if self._alone is not None and (not self._active or self._turns.alone_next()):
                self._timed(True, self._step_alone)
            elif self._active:
                self._timed(False, self._step_batch)

    def _timed(self, alone: bool, step: Callable[[], None]) -> None:
        start = self._turns.clock()
        step()
        self._turns.seconds[alone] += self._turns.clock() - start

    def _admit(self) -> None:
        """Start waiting jobs in arrival order: into the batch while it has room; a job that runs alone once the
        one under way (if any) has ended. A job waits only for its own kind."""
        for job in list(self._waiting):
            if job.cancelled.is_set():
                self._dequeue(job)
                continue
            if job.past_deadline():
                self._dequeue(job)
                waited = time.perf_counter() - job.submitted
                self._fail(job, Busy(f"the server is busy: the request waited {waited:.0f} s for the model"))
                continue
            alone = self.runs_alone(job.choice, job.config)
            taken = self._alone is not None if alone else len(self._active) >= self.max_batch
            if taken:
                continue  # waits for its kind
            self._dequeue(job)
            job.started = time.perf_counter()
            try:
                if alone:
                    self._start_alone(job)
                    continue
                drafter = self.factory.drafter(job.choice, job.memory)
                self._active[self._batched().add(job.prompt_ids, job.config, drafter, job.choice.name,
                                                 verifier=job.choice.method.verifier, tenant=job.tenant,
                                                 share=job.share)] = job
            except Exception as error:  # reaches the request as its error (UserError: 400, others: 500)
                self._fail(job, error)

    def _dequeue(self, job: Job) -> None:
        self._waiting.remove(job)
        self.leave()

    def _step_batch(self) -> None:
        try:
            outcomes = self._batched().step()
        except Exception as error:  # every member's request fails with it; the batch starts afresh
            for ident, member in self._active.items():
                self._batched().remove(ident)
                self._fail(member, error)
            self._active.clear()
            return
        for ident, failure in self._batched().failures:  # a request's own fault (its grammar): it alone fails
            self._fail(self._active.pop(ident), failure)
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

    def _start_alone(self, job: Job) -> None:
        engine = job.engine or self.factory.engine(job.choice, job.memory)
        if job.forgets:
            engine.forget()
        stream = engine.stream(job.prompt_ids, job.config)
        self._alone = Alone(job, engine, stream, stream.items())

    def _step_alone(self) -> None:
        """The next item of the job that runs alone (a step's event, or a chunk of its prompt fed); its end."""
        alone = self._alone
        assert alone is not None
        job = alone.job
        try:
            if job.cancelled.is_set():
                self._stop_alone()
                return
            item = next(alone.items, None)
            if item is None:  # its stream ended
                self._alone = None
                assert alone.stream.result is not None
                self._finish(job, alone.stream.result)
                return
            if isinstance(item, StepEvent):
                self._emit(job, item)
            if job.past_deadline():
                self._stop_alone()
                self._expire(job)
        except Exception as error:
            self._stop_alone()
            self._fail(job, error)

    def _stop_alone(self) -> None:
        """End the job that runs alone where it is, freeing the target's cache."""
        alone, self._alone = self._alone, None
        if alone is not None:
            alone.stream.close()
            alone.engine.target.reset()
