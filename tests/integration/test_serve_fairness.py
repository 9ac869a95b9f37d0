"""A server shared by tenants who do not trust one another: one long prompt must not hold the others up, nor
a tenant's new memory owner, and a tenant pushes out only its own owners.

The worker's scheduling runs on a fake model that waits before every forward until the test lets it go
on, so every count here is of forwards, never of seconds: a request comes in while a chunk of another's
prompt is under way and is served before that prompt's next chunks; a client that leaves, or a deadline
that passes, while a chunk is under way stops the prompt there. The rest runs a real server on the tiny
model: the prompt-length limit (400 before any work), an owner's engine built beside the worker (the
others served meanwhile, a second new owner of the same key told to retry), the owners kept per key."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import LetterTokenizer
from fakes import TARGET, VOCAB, FakeLM
from specdecode.api import Models, load_models
from specdecode.drafters.composite import CompositeDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from specdecode.methods import METHODS, MethodChoice, choose
from specdecode.serve.app import Limits, Server, ServerThread, create_app
from specdecode.serve.guard import Guard, key_identity
from specdecode.serve.limits import prompt_byte_limit
from specdecode.serve.worker import Job, Step, Worker
from test_serve import openai_error, post

CHUNK = 4
BATCHED, ALONE = choose("ar"), choose("draft")  # plain decoding joins the batch; the draft model's runs alone
AUTO = choose("auto")  # the default method joins the batch too

pytestmark = pytest.mark.usefixtures("one_thread")


class HeldLM(FakeLM):
    """A FakeLM whose every forward waits until the test lets it go on (`go`), and says so as it begins."""

    def __init__(self):
        super().__init__(TARGET, max_context=1024)
        self.fed: list[int] = []  # the tokens of each forward, begun
        self.begun, self.gate = threading.Semaphore(0), threading.Semaphore(0)

    def forward(self, token_ids, **options):
        self.fed.append(token_ids.numel())
        self.begun.release()
        assert self.gate.acquire(timeout=60), "the test never let the forward go on"
        return super().forward(token_ids, **options)

    def next_forward(self) -> int:
        """Wait until the next forward begins (it waits for `go`); the tokens it feeds."""
        assert self.begun.acquire(timeout=60), "no forward began"
        return self.fed[-1]

    def go(self, forwards: int = 1) -> None:
        self.gate.release(forwards)


class Direct:
    """An event loop's `call_soon_threadsafe` that calls at once: the worker's events land in a queue.Queue."""

    def call_soon_threadsafe(self, callback, *args):
        callback(*args)


class Factory:
    """Plain decoding for every method, but `auto`: its copies (prompt lookup, the suffix cache) as the batch runs
    them on a target without a head."""

    def engine(self, choice, memory):
        engine = SpeculativeEngine(self.target, LetterTokenizer())
        engine.prefill_chunk = CHUNK
        return engine

    def drafter(self, choice, memory):
        if choice.name != "auto":
            return None
        curve = self.target.cost_curve()
        return CompositeDrafter([PromptLookupDrafter(), SuffixDrafter(curve, tree=True)], curve).for_sequence()


def own_cache(target: HeldLM) -> HeldLM:
    """The held model over a cache of its own (what the batch runs on), its forwards held and counted with the
    target's."""
    sibling = copy.copy(target)
    sibling.cache = []
    return sibling


@contextlib.contextmanager
def worker():
    target, factory = HeldLM(), Factory()
    factory.target = target
    # the turns timed in forwards begun, not seconds: each step is one forward, whatever the machine's load
    running = Worker(target, LetterTokenizer(), factory, batch_target=own_cache(target), clock=lambda: len(target.fed))
    running.batch.prefill_chunk = CHUNK
    try:
        yield running, target
    finally:
        target.go(10_000)
        running.stop()


def submit(running: Worker, choice, length: int, new_tokens: int, seed: int = 0, tenant: str | None = None) -> Job:
    prompt = [(seed + 7 * i) % VOCAB for i in range(length)]  # (a seed's shorter prompts begin its longer ones)
    job = Job(choice, prompt, GenerationConfig(max_new_tokens=new_tokens), Direct(), queue.Queue(), tenant=tenant)
    assert running.enter()
    running.submit(job)
    return job


def result(job: Job) -> GenerationResult:
    """The job's result, once its events are in (a Step before it for every step)."""
    while True:
        item = job.events.get(timeout=60)
        if not isinstance(item, Step):
            assert isinstance(item, GenerationResult), item
            return item


def served_alone(length: int, new_tokens: int, seed: int = 0) -> list[int]:
    prompt = [(seed + 7 * i) % VOCAB for i in range(length)]
    return SpeculativeEngine(FakeLM(TARGET, max_context=1024)).generate(
        prompt, GenerationConfig(max_new_tokens=new_tokens)).token_ids


# --- One long prompt among other requests -------------------------------------------------------------------


def test_a_request_is_served_between_the_chunks_of_another_prompt():
    """A 2-token request that comes in while a 400-token prompt's first chunk is under way is answered
    within a few forwards (each of the prompt's chunks takes turns with it), not after the 100 chunks."""
    with worker() as (running, target):
        long = submit(running, BATCHED, 400, 2, seed=1)
        assert target.next_forward() == CHUNK  # the long prompt's first chunk, held
        short = submit(running, BATCHED, 3, 2, seed=2)
        forwards = 1
        while short.events.empty() or not isinstance(short.events.queue[-1], GenerationResult):
            target.go()
            target.next_forward()
            forwards += 1
        assert forwards <= 4  # its prompt's step, its second token's, and a chunk of the other's between at most
        assert result(short).token_ids == served_alone(3, 2, seed=2)
        assert long.events.empty()  # still being fed its prompt
        target.go(10_000)
        assert result(long).token_ids == served_alone(400, 2, seed=1)
        assert max(target.fed) <= CHUNK + 1


def under_way(running: Worker, target: HeldLM, choice) -> Job:
    """A 60-token answer to a 5-token prompt, its fifth forward under way (held)."""
    long = submit(running, choice, 5, 60, seed=1)
    for _ in range(4):
        target.next_forward()
        target.go()
    target.next_forward()
    return long


def forwards_until_answered(target: HeldLM, job: Job) -> int:
    """Let the forwards go on one at a time until the job has its answer; how many went."""
    forwards = 0
    while job.events.empty() or not isinstance(job.events.queue[-1], GenerationResult):
        target.go()
        target.next_forward()
        forwards += 1
    return forwards


@pytest.mark.parametrize("choice", [BATCHED, AUTO], ids=["ar", "auto"])
def test_a_short_request_is_served_while_another_streams_a_long_answer(choice):
    """A 2-token request that comes in while another of the same method streams a 60-token answer joins the
    batch at the next step: answered within a few forwards, each the step of both, not after the other's answer."""
    with worker() as (running, target):
        long = under_way(running, target, choice)
        short = submit(running, choice, 3, 2, seed=2)
        # the step under way, then its prompt's with the other's, then its second token's
        assert forwards_until_answered(target, short) <= 3
        assert result(short).token_ids == served_alone(3, 2, seed=2)
        target.go(10_000)
        assert result(long).token_ids == served_alone(5, 60, seed=1)


@pytest.mark.parametrize("choice", [BATCHED, AUTO], ids=["ar", "auto"])
def test_a_keys_requests_share_a_prompts_prefix_and_no_other_keys_do(choice):
    """While a request of key "a" streams its answer, a later request of "a" whose prompt begins as the first's
    takes that prefix's keys and values from the batch instead of feeding it; one of key "b", the same prompt,
    feeds all of it (a prefix found would show in its time to first token). Every answer is plain decoding's."""
    with worker() as (running, target):
        first = submit(running, choice, 5, 30, seed=1, tenant="a")
        for _ in range(3):
            target.next_forward()
            target.go()
        same, other = submit(running, choice, 8, 4, seed=1, tenant="a"), submit(running, choice, 8, 4, seed=1,
                                                                                 tenant="b")
        target.go(10_000)
        answers = [result(job) for job in (first, same, other)]
        assert [a.token_ids for a in answers] == [served_alone(5, 30, seed=1), *[served_alone(8, 4, seed=1)] * 2]
        assert [a.cached_tokens for a in answers] == [0, 5, 0]


def test_a_keys_next_request_takes_a_prefix_its_last_one_left():
    """The batch emptied by the end of key "a"'s request keeps its context: "a"'s next request, whose prompt begins
    as that one's, takes the prefix; "b"'s, the same prompt, takes nothing. Every answer is plain decoding's."""
    with worker() as (running, target):
        target.go(10_000)
        answers = [result(submit(running, BATCHED, length, 4, seed=1, tenant=key))
                   for length, key in [(5, "a"), (8, "a"), (8, "b")]]
        assert [a.token_ids for a in answers] == [served_alone(5, 4, seed=1), *[served_alone(8, 4, seed=1)] * 2]
        assert [a.cached_tokens for a in answers] == [0, 5, 0]


@pytest.mark.parametrize("first, second", [(ALONE, BATCHED), (BATCHED, ALONE), (ALONE, AUTO)],
                         ids=["batched-beside-alone", "alone-beside-batched", "auto-beside-alone"])
def test_a_job_that_runs_alone_takes_turns_with_the_batch(first, second):
    """A request whose method cannot join the batch and a batched one, either first: the later one is served
    within a few forwards of its arrival, by turns with the other's steps (each on a cache of its own), not
    after the other's 60-token answer; both answers are plain decoding's."""
    with worker() as (running, target):
        long = under_way(running, target, first)
        short = submit(running, second, 3, 2, seed=2)
        # the step under way, then its two steps by turns with the other's (about one each)
        assert forwards_until_answered(target, short) <= 8
        assert long.events.qsize() < 60  # the long answer is still under way
        assert result(short).token_ids == served_alone(3, 2, seed=2)
        target.go(10_000)
        assert result(long).token_ids == served_alone(5, 60, seed=1)


@pytest.mark.parametrize("choice", [BATCHED, ALONE], ids=["batched", "alone"])
@pytest.mark.parametrize("ending", ["cancelled", "expired"])
def test_a_client_leaving_or_a_deadline_stops_a_prompt_between_two_chunks(choice, ending):
    with worker() as (running, target):
        long = submit(running, choice, 400, 8, seed=3)
        for _ in range(2):
            target.next_forward()
            target.go()
        target.next_forward()  # the third chunk is under way when the client leaves or the deadline passes
        if ending == "cancelled":
            long.cancelled.set()
        else:
            long.deadline = -math.inf
        target.go()
        if ending == "expired":  # answered with what it has: nothing yet
            answer = result(long)
            assert answer.token_ids == [] and answer.finish_reason == "length" and long.expired
        # the next request's forward comes next, into an empty cache (FakeLM checks its chain): the long
        # prompt was dropped after its third chunk
        after = submit(running, choice, 3, 1, seed=4)
        assert target.next_forward() == 3
        target.go()
        assert result(after).token_ids == served_alone(3, 1, seed=4)
        assert target.fed == [CHUNK] * 3 + [3] and long.events.qsize() == 0


# --- A real server on the tiny model ------------------------------------------------------------------------

MODEL = "tiny"
KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"


@pytest.fixture(scope="module")
def models(tiny_folder):
    return load_models(str(tiny_folder), str(tiny_folder), dtype="float32", progress=False)


@contextlib.contextmanager
def serving(models: Models, limits: Limits = Limits(), **options):
    options.setdefault("methods", ["pld", "ar", "draft", "suffix", "auto"])
    state = Server(models, MODEL, default_method="pld", limits=limits, **options)
    running = ServerThread(create_app(state, Guard(api_keys=(KEY_A, KEY_B))))
    try:
        yield running, state
    finally:
        running.stop()


def ask(url: str, key: str, prompt, method: str = "pld", user: str | None = None, chat: bool = False):
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "method": method}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if user is not None:
        body["user"] = user
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return post(url, path, body, headers={"authorization": f"Bearer {key}"})


def test_a_prompt_beyond_the_limit_is_refused_with_400_before_any_work(models):
    with serving(models, Limits(max_prompt_tokens=8)) as (running, state):
        submitted, encoded = [], []
        submit_job, encode = state.worker.submit, state._encode_completion
        state.worker.submit = lambda job: submitted.append(job) or submit_job(job)
        state._encode_completion = lambda prompt: encoded.append(prompt) or encode(prompt)
        for prompt, param in [(list(range(9)), "prompt"), ("the cat sat on the mat and the dog sat", "prompt")]:
            reply = ask(running.url, KEY_A, prompt)
            assert reply.status_code == 400, reply.text
            error = openai_error(reply)
            assert error["code"] == "prompt_too_long" and error["param"] == param and "at most 8" in error["message"]
        chat = ask(running.url, KEY_A, "the cat sat on the mat", chat=True)  # the template's tokens count too
        assert chat.status_code == 400 and openai_error(chat)["param"] == "messages"
        # bytes no 8 tokens could hold: refused before it is tokenized
        by_bytes = ask(running.url, KEY_A, "x" * (state.prompt_bytes + 1))
        assert by_bytes.status_code == 400 and openai_error(by_bytes)["code"] == "prompt_too_long"
        assert len(encoded) == 2 and not submitted  # the worker saw none of them
        assert ask(running.url, KEY_A, list(range(8))).status_code == 200 and len(submitted) == 1
        assert state.prompt_bytes < prompt_byte_limit(models.tokenizer, models.target.max_context)


def held_builds(models: Models) -> tuple[Models, threading.Event, threading.Event]:
    """Models whose first suffix engine (a new owner's) takes until the test lets it go on."""
    begun, release, builds = threading.Event(), threading.Event(), []
    slow = dataclasses.replace(models)

    def engine_for(choice):
        if choice.name == "suffix":
            builds.append(choice)
            if len(builds) == 2:  # the first is the method's preparation at start-up; the next, the first owner's
                begun.set()
                assert release.wait(120)
        return Models.engine_for(models, choice)

    slow.engine_for = engine_for
    return slow, begun, release


def test_a_new_owners_engine_is_built_beside_the_worker(models):
    """A method that remembers and runs alone (as eagle3-online, whose head each owner trains, always does; here
    suffix decoding taken out of the batch) gets an engine per owner, built beside the worker."""
    slow, begun, release = held_builds(models)
    alone_suffix = MethodChoice(dataclasses.replace(METHODS["suffix"], batchable=False))
    with serving(slow, methods=["pld", "ar", "draft", alone_suffix]) as (running, _), ThreadPoolExecutor(1) as pool:
        try:
            first = pool.submit(ask, running.url, KEY_A, "the cat sat", "suffix", "new-owner")
            assert begun.wait(60)
            # meanwhile the others are served: batched, alone, and another key's new owner (its own builder)
            for method in ["pld", "draft"]:
                assert ask(running.url, KEY_B, "hello there", method).status_code == 200
            assert ask(running.url, KEY_B, "hello there", "suffix", "b-owner").status_code == 200
            # the same key's next new owner waits for its builder: retry later
            busy = ask(running.url, KEY_A, "hello there", "suffix", "another-owner")
            assert busy.status_code == 503 and openai_error(busy)["code"] == "owner_not_ready"
            assert int(busy.headers["retry-after"]) >= 1
            assert not first.done()
        finally:
            release.set()
        reply = first.result(timeout=60)
        assert reply.status_code == 200, reply.text
        assert ask(running.url, KEY_A, "hello there", "suffix", "another-owner").status_code == 200


def test_a_key_pushes_out_only_its_own_owners(models):
    with serving(models, memory_owners=2) as (running, state):
        assert ask(running.url, KEY_B, "the cat", "suffix", "b1").status_code == 200
        kept = state.engines.owned[key_identity(KEY_B)].copy()
        for user in ["a1", "a2", "a3", "a4"]:
            assert ask(running.url, KEY_A, "the cat", "suffix", user).status_code == 200
        owners = {tenant: [owner.name for _, owner, _ in engines] for tenant, engines in state.engines.owned.items()}
        assert owners == {key_identity(KEY_A): ["a3", "a4"], key_identity(KEY_B): ["b1"]}
        assert state.engines.owned[key_identity(KEY_B)] == kept  # the same engine, its memory intact
