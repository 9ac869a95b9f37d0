"""The server's state and a request's way through it: which method (resolved once at start-up,
`serve.offer`), what it may cost (`Limits`), tokenizing off the event loop, the job on the worker, and the
answer, whole or streamed (`serve.replies`).

Several users at once (see also `serve.guard` for keys, hosts and the HTTP limits):

- *Memory*: a method that drafts from earlier requests' text (`Method.remembers`: suffix decoding) gets
  one drafter per *owner*: with `memory_scope="tenant"` (the default) an owner is an API key's tenant
  and the request's OpenAI `user` field; a request with neither (no keys, no `user` or an empty one) has
  a drafter that has forgotten every earlier request (one engine for all such requests, reset before each).
  "request" never shares; "server" shares one memory among all (one trusted user). So a request's drafts,
  rejected text and token origins carry only its owner's text. The owners are kept per tenant
  (`memory_owners`, `memory_budget` each): a tenant pushes out only its own.
- *Cost*: `Limits` caps a request's tokens, its prompt's (400 beyond, before any work), its time (past its
  deadline a generation ends where it is, as at max_tokens) and the requests waiting (429 beyond); a client
  that disconnects, streaming or not, stops its generation within one step, or one chunk of its prompt.
- *Preparation*: the methods a server is given (`methods`; without them, the default method) are
  prepared at start-up, any other on its first request, in the background (`serve.offer`): the request is
  served if that takes under PREPARE_GRACE, and the method answers 503 until ready otherwise. A new owner's
  engine (eagle3-online's head) is built beside the worker too, the request waiting for it (503 while
  its tenant's builder is busy with another owner's).
- *The event loop*: tokenizing and templating run on a thread pool; a prompt whose bytes already exceed
  what the context could hold is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdecode.api import Models
from specdecode.constraints import Constraint, grammar
from specdecode.constraints.matcher import Matcher
from specdecode.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.methods import MethodChoice
from specdecode.models.costs import CHUNK_SECONDS
from specdecode.serve import protocol, replies, tools
from specdecode.serve.chat import ChatRequest
from specdecode.serve.engines import Engines, Owner
from specdecode.serve.guard import ClientGone
from specdecode.serve.limits import Limits, check_ids, check_prompt_bytes, choice_configs, prompt_byte_limit
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.offer import Offer, Preparation
from specdecode.serve.logprobs import TokenTexts
from specdecode.serve.protocol import APIError, CompletionRequest, SamplingRequest
from specdecode.serve.replies import NOT_READY_RETRY_SECONDS, api_error
from specdecode.serve.worker import DEFAULT_MAX_BATCH, Job, Worker

MEMORY_SCOPES = ("tenant", "request", "server")
TOKENIZER_THREADS = 2
PREPARE_GRACE = 1.0  # seconds a request waits for its method's preparation before a 503

log = logging.getLogger("specdecode.serve")

DEFAULT_PREFIX_CACHE = 1 << 30  # bytes of ended requests' contexts the batch keeps copied (`BatchEngine.saved`)


class Server:
    """The models, the methods offered and their preparation, the engines (`serve.engines`), the worker and
    the metrics."""

    def __init__(self, models: Models, model_name: str, default_method: str | MethodChoice = "auto",
                 datastore: str | None = None, head: str | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                 limits: Limits = Limits(),
                 methods: Sequence[str | MethodChoice] | None = None, prepare: Sequence[str] | None = None,
                 memory_scope: str = "tenant", memory_owners: int = 64, memory_budget: int | None = None,
                 prefix_cache: int = DEFAULT_PREFIX_CACHE, chunk_seconds: float | None = None,
                 chunk_policy: str = "turns"):
        """`methods`: those clients may name (default: every one the models can run), by name or resolved
        already (`methods.choose`); `datastore`: the retrieval datastore of those that take one; `head`: the
        trained head's folder of the methods of its kind (default: the shipped ones); `prepare`:
        those prepared before the server takes requests (default: all of `methods` when given, else the
        default method), each other one being prepared in the background on its first request;
        `memory_owners`, `memory_budget` (bytes; None: a quarter of the machine's memory): what one tenant's
        memory owners may be and hold together (`serve.engines`); `prefix_cache` (bytes): what the batch keeps of
        each tenant's ended requests' contexts copied out of its cache, for later requests' prompts that begin as
        they do (`engine.slots.SavedContexts`; none under the request scope, where no request shares a prefix);
        `chunk_seconds`, `chunk_policy`: what one batch step's prompt tokens take at most (None: the engine's default),
        and when a long prompt's chunk goes into a step (`engine.pacing.PrefillShare`)."""
        self.offer = Offer.resolve(models, default_method, methods, datastore, head)
        self.offered = tuple(self.offer.names())
        if prepare is None:
            prepare = self.offered if methods else ()
        first = list(dict.fromkeys([self.offer.default.name, *prepare]))
        if not set(first) <= set(self.offered):
            raise UserError("the default method and those to prepare must be among the methods offered")
        if memory_scope not in MEMORY_SCOPES or memory_owners < 1:
            raise UserError(f"the memory scope is one of {', '.join(MEMORY_SCOPES)}, with at least one owner")
        self.models, self.model_name, self.default_method = models, model_name, self.offer.default.name
        self.limits, self.memory_scope = limits, memory_scope
        self.metrics = ServerMetrics()
        self.token_texts = TokenTexts(models.tokenizer)  # each token's own text, for log-probabilities
        self._recent_seconds = 1.0  # a moving average of request latency, for Retry-After
        self.prompt_tokens = limits.prompt_tokens(models.target.max_context)
        self.prompt_bytes = prompt_byte_limit(models.tokenizer, self.prompt_tokens)
        # Requests are tokenized on these threads, one text each. The tokenizer's own thread pool (Rust's
        # rayon, at full priority) is turned off: a datastore's tokenization on it would take the cores
        # from decoding (a concurrent stream stalled with it, not without: docs/results/serving.md).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="specdecode-tokenize")
        self.engines = Engines(models, memory_owners, memory_budget)
        self.worker = Worker(models.target, models.tokenizer, self.engines, on_finish=self._finished,
                             max_batch=max_batch, on_batch_step=self.metrics.batch_step, max_queue=limits.max_queue,
                             batch_options={"keep_bytes": 0 if memory_scope == "request" else prefix_cache,
                                            "chunk_seconds": CHUNK_SECONDS if chunk_seconds is None else chunk_seconds,
                                            "chunk_policy": chunk_policy})
        self.preparation = Preparation(self.engines, batching=self.worker.batch is not None)
        self.metrics.waiting.set_function(lambda: self.worker.queued)
        batch = self.worker.batch
        self.metrics.prefix_cache.set_function(lambda: batch.saved.nbytes if batch is not None else 0)
        # What the methods share, measured once per machine while the models are idle: the cost curves.
        models.target.cost_curve()
        if models.draft is not None and any(c.method.loads_draft_model for c in self.offer.choices):
            models.draft.cost_curve()
        for choice in [self.offer.get(name) for name in first]:
            if choice is not None:  # (every one is: checked above)
                self.preparation.prepare(choice)
        unavailable = self.preparation.unavailable
        if failed := [m for m in first if m in unavailable]:  # asked for by name: say so now
            self.close()
            raise UserError("; ".join(f"method {m!r} cannot run here: {unavailable[m]}" for m in failed))

    # -- methods ------------------------------------------------------------------------------------

    def methods(self) -> list[str]:
        """The methods clients may name."""
        return list(self.offered)

    def status(self, method: str) -> str:
        """ready; unavailable (`unavailable` says why); preparing; or cold (prepared on its first request)."""
        return self.preparation.status(method)

    @property
    def unavailable(self) -> dict[str, str]:
        """Method -> why it cannot run here."""
        return self.preparation.unavailable

    def wait_until_prepared(self, timeout: float | None = None) -> None:
        """Block until every preparation under way has ended (tests, benchmarks)."""
        self.preparation.wait(timeout)

    def memory_owner(self, tenant: str | None, user: str | None) -> Owner | None:
        """Whose cross-request memory a request may read and add to (None: its own only)."""
        user = user or None  # an empty name is none (a client library's default must not make a crowd)
        if self.memory_scope == "server":
            return Owner(None, "server")
        if self.memory_scope == "request" or (tenant is None and user is None):
            return None
        return Owner(tenant, user)

    def prefix_group(self, tenant: str | None) -> Hashable:
        """Whose requests may share their prompts' prefixes in the batch (`engine.batch`; a prefix found shows in
        the time to the first token): a key's, as its memory is kept; everybody's under `--memory-scope server`,
        nobody's under `request`."""
        return {"server": None, "request": object()}.get(self.memory_scope, tenant)

    def _finished(self, job: Job, result: GenerationResult) -> None:
        seconds = time.perf_counter() - job.submitted
        self.metrics.finished(result, seconds)
        if job.expired:
            self.metrics.expired.inc()
        self._recent_seconds = 0.9 * self._recent_seconds + 0.1 * seconds

    def close(self) -> None:
        self.worker.stop()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    # -- a request's way through -------------------------------------------------------------------

    async def _method(self, body: SamplingRequest) -> MethodChoice:
        """The method a request names, once it is ready: a cold one is prepared in the background, and
        the request waits for it PREPARE_GRACE seconds at most (enough for most), then gets 503."""
        if body.model != self.model_name:
            raise APIError(404, f"The model `{protocol.quoted(body.model)}` does not exist; this server has "
                                f"`{self.model_name}`.", param="model", code="model_not_found")
        name = body.method or self.default_method
        choice = self.offer.get(name)
        if choice is None:
            raise APIError(400, f"Unknown method `{protocol.quoted(name)}`; this server offers: "
                                f"{', '.join(self.offered)}.", param="method", code="unknown_method")
        ready, unavailable = self.preparation.ready, self.preparation.unavailable
        if name not in ready and name not in unavailable:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.preparation.in_background(choice))),
                                       PREPARE_GRACE)
        if name in unavailable:
            raise APIError(400, f"The method `{name}` cannot run on this server: {unavailable[name]}",
                           param="method", code="method_unavailable")
        if name not in ready:
            raise APIError(503, f"The method `{name}` is being prepared (first use on this machine: a search "
                                f"or an index to build); retry later.", type="server_error", code="method_not_ready",
                           headers={"Retry-After": str(NOT_READY_RETRY_SECONDS)})
        return choice

    def _answer_limit(self, body: SamplingRequest) -> int | None:
        return self.limits.answer_limit(body, self.models.target.max_context)

    def _check_bytes(self, texts: list[str], param: str) -> None:
        check_prompt_bytes(texts, self.prompt_bytes, self.models.target.max_context, param, self.prompt_tokens)

    def _encode_completion(self, prompt: str | list[int], special: bool = True) -> list[int]:  # on the tokenizing pool
        if isinstance(prompt, str):
            return self.models.tokenizer(prompt, add_special_tokens=special)["input_ids"]
        return prompt  # (its ids checked by `prepare`)

    def _encode_chat(self, messages: list[dict], offered: list[dict] | None, **template) -> list[int]:  # on the pool
        from jinja2 import TemplateError

        try:
            return self.models.encode_chat(messages, offered, **template)
        except UserError as error:
            raise APIError(400, str(error), param="messages") from None
        except TemplateError as error:  # the template refuses the conversation (e.g. roles out of order)
            raise APIError(400, f"The chat template cannot render these messages: {error}", param="messages") from None

    def _constraint(self, body: SamplingRequest, use: tools.ToolUse | None) -> Constraint | None:  # on the pool
        """What a request's answers must be: its response format, or its tools' calls (under `auto`, beside the
        format: `ToolUse.constraint`); compiled here, not on the event loop (a large schema takes a while, and
        one longer than grammar.CACHED_SOURCE is compiled with every request), and checked (`_grammar_vocabulary`)."""
        asked = body.constraint()
        constraint = (use.constraint(self.models.tokenizer, asked) if use is not None else None) or asked
        if constraint is not None:
            self._grammar_vocabulary(constraint, body.constraint_field())
        return constraint

    def _grammar_vocabulary(self, constraint: Constraint, param: str) -> None:  # on the tokenizing pool
        """The grammar engine's view of the tokenizer (`constraints.grammar.engine_tokenizer`), built here on a
        constrained request's way in: built once, it takes seconds on a large vocabulary, which on the worker
        (where a sequence's matcher is made) would hold every other request up. A matcher made here refuses a
        constraint whose language is empty with a 400 naming `param`, before the request joins the queue."""
        target = self.models.target
        try:
            grammar.engine_tokenizer(self.models.tokenizer, target.vocab_size, target.eos_token_ids)
            Matcher(constraint, self.models.tokenizer, target.vocab_size, target.eos_token_ids)
        except UserError as error:
            raise APIError(400, f"Invalid `{param}`: {error}", param=param) from None

    def prepare(self, body: SamplingRequest) -> list[tuple[functools.partial, replies.Answer]]:
        """How each of a request's prompts is encoded (on the tokenizing pool) and how its answers are written: a
        chat's messages and tools through the template, each of a completion's texts or ids (echoed if asked)."""
        texts = self.token_texts if body.top_logprobs_asked() is not None else None
        if isinstance(body, ChatRequest):
            use = tools.tool_use(body, getattr(self.models.tokenizer, "chat_template", None))
            messages = body.template_messages()
            offered = list(use.tools) if use is not None else None
            self._check_bytes([m["content"] for m in messages] + [json.dumps(offered or "")], "messages")
            return [(functools.partial(self._encode_chat, messages, offered),
                     replies.Answer(True, self.model_name, texts, tools=use))]
        assert isinstance(body, CompletionRequest)
        if body.echo and body.stream and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not streamed; leave `stream` out.", param="echo")
        prepared = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                self._check_bytes([prompt], "prompt")
            else:
                check_ids(prompt, self.models.target.vocab_size)  # (before the echo decodes them)
            echo = None
            if body.echo:
                echo = prompt if isinstance(prompt, str) else str(self.models.tokenizer.decode(prompt))
            prepared.append((functools.partial(self._encode_completion, prompt),
                             replies.Answer(False, self.model_name, texts, echo=echo)))
        return prepared

    async def complete(self, request: Request, chat: bool) -> Response:
        """One request to /v1/completions or /v1/chat/completions, from its body to its response."""
        arrival = time.perf_counter()
        body = protocol.parse(await request.body(), ChatRequest if chat else CompletionRequest)
        return await self.answer(request, body, arrival)

    async def answer(self, request: Request, body: SamplingRequest, arrival: float,
                     reply: replies.Reply = replies.DEFAULT) -> Response:
        """A parsed request (that arrived at `arrival`), from its method to its response, as `reply` writes it: the
        chat and completion endpoints' bodies and chunks, or /v1/responses' (`serve.responses`)."""
        choice = await self._method(body)
        limit = self._answer_limit(body)
        prepared = self.prepare(body)
        places = self._enter(0)
        memory = self.memory_owner(request.state.tenant, body.user)
        try:
            configs, engine = await self._configs(body, choice, limit, prepared, memory, request)
            needed = sum(map(len, configs))
            if needed > self.limits.max_queue:  # a 429 would ask for retries that can never be served
                raise APIError(400, f"This request runs {needed} generations (its prompts times its sampled choices); "
                                    f"this server queues at most {self.limits.max_queue}.", param="n",
                               code="too_many_generations")
            while places < needed:  # a place in the queue for each generation
                places = self._enter(places)
        except BaseException:
            for _ in range(places):
                self.worker.leave()
            raise
        loop, plan, field = asyncio.get_running_loop(), replies.Choices([], []), body.constraint_field()
        jobs: list[Job] = []
        for (_, answer), each in zip(prepared, configs):  # a prompt's choices: its generations, or one's copies
            plan.answers += [answer] * body.choices()
            plan.runs += [len(jobs) + i % len(each) for i in range(body.choices())]
            jobs += [Job(choice, answer.prompt_ids, config, loop, asyncio.Queue(), memory=memory, engine=engine,
                         deadline=arrival + self.limits.request_seconds, tenant=self.prefix_group(request.state.tenant),
                         share=body.cache_prompt is not False, param=field) for config in each]
        for job in jobs:
            self.worker.submit(job)
        watcher = asyncio.create_task(replies.disconnected(request))
        finished = False
        try:
            # the first generation's first item (errors before it keep their status); the others' are read as they
            # come, so that a stream begins at once however many generations wait for the batch
            items: list = await replies.next_items(jobs[:1], watcher, self.metrics) + [None] * (len(jobs) - 1)
            if isinstance(items[0], BaseException):
                raise api_error(items[0])
            self.metrics.queue_seconds.observe((jobs[0].started or time.perf_counter()) - jobs[0].submitted)
            self.metrics.first_token.labels(choice.name).observe(time.perf_counter() - jobs[0].submitted)
            if body.stream:
                watcher.cancel()  # the streaming response watches the connection from here
                finished = True
                return StreamingResponse(reply.stream(jobs, items, body, plan, self.metrics),
                                         media_type="text/event-stream")
            self.metrics.running.inc()
            try:
                outcomes = await replies.whole(jobs, items, watcher, self.metrics)
            finally:
                self.metrics.running.dec()
            finished = True
            return JSONResponse(reply.whole(outcomes, plan))
        finally:
            watcher.cancel()
            if not finished:  # the client left, or the request failed: stop the generations
                for job in jobs:
                    job.cancelled.set()

    async def _configs(self, body: SamplingRequest, choice: MethodChoice, limit: int | None, prepared: list,
                       memory: Owner | None, request: Request
                       ) -> tuple[list[list[GenerationConfig]], SpeculativeEngine | None]:
        """Each prompt's generations (`choice_configs`), its tokens in its answer, once it fits; and the engine of a
        method that runs alone (None: the batch's)."""
        param = "messages" if isinstance(body, ChatRequest) else "prompt"
        context = self.models.target.max_context
        for (_, answer), prompt_ids in zip(prepared, await self.tokenizing(*(encode for encode, _ in prepared))):
            answer.prompt_ids = prompt_ids
            self.limits.check_prompt(prompt_ids, context, param)
        [constraint] = await self.tokenizing(functools.partial(self._constraint, body, prepared[0][1].tools))
        configs = [choice_configs(self.limits.config(body, answer.prompt_ids, limit, context, param, constraint),
                                  body.choices()) for _, answer in prepared]
        config = configs[0][0]
        engine = await self._engine(choice, memory, request) if self.worker.runs_alone(choice, config) else None
        return configs, engine

    async def tokenizing(self, *calls: Callable[[], Any]) -> list[Any]:
        """Each call's result, run on the tokenizing pool (a tokenizer, a template or a grammar holds the loop up)."""
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(*(loop.run_in_executor(self._tokenizing, call) for call in calls)))

    def _enter(self, places: int) -> int:
        """One more place in the worker's queue for this request's generations; a 429 when it is full (the places
        taken are the caller's to give back)."""
        if self.worker.enter():
            return places + 1
        retry = max(1, min(60, math.ceil(self._recent_seconds)))
        raise APIError(429, f"The server is busy: {self.limits.max_queue} requests are waiting; retry in "
                            f"{retry} s.", type="server_error", code="queue_full", headers={"Retry-After": str(retry)})

    async def _engine(self, choice: MethodChoice, memory: Owner | None, request: Request) -> SpeculativeEngine:
        """The engine a job that runs alone will run with, built beside the worker if need be (`Engines.building`):
        the request waits for it while the others are served; 503 while its tenant's builder is busy with
        another owner's engine; ClientGone if the client leaves meanwhile (the build goes on, for its owner)."""
        future = self.engines.building(choice, memory, request.state.tenant)
        if future is None:
            raise APIError(503, f"Another memory owner's engine for `{choice.name}` is being built for this key; "
                                "retry later.", type="server_error", code="owner_not_ready",
                           headers={"Retry-After": str(NOT_READY_RETRY_SECONDS)})
        if not future.done():
            built = asyncio.wrap_future(future)
            watcher = asyncio.create_task(replies.disconnected(request))
            try:
                await asyncio.wait({built, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watcher.cancel()
            if not built.done():
                self.metrics.cancelled.inc()
                raise ClientGone
        try:
            return future.result()
        except UserError as error:
            raise api_error(error) from None
        except Exception as error:  # the server's fault: its log says what happened
            log.error("building the engine of method %s failed", choice.name, exc_info=error)
            raise api_error(error) from None
