"""Cross-request memory on a server with several users: suffix decoding, and `auto` (prompt lookup, the suffix
cache and a Medusa head, decoded in the batch), draft from their owner's earlier requests only. A second client's
streamed drafts, rejected text and token origins are exactly what they are on a server that never saw the first
client; the same test on a server that shares its memory ("server" scope) shows the leak it guards against."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import random_medusa_heads
from specdecode.api import load_models
from specdecode.drafters.base import Memory
from specdecode.drafters.suffix import SuffixIndex
from specdecode.serve.app import Server, ServerThread, create_app
from specdecode.serve.guard import Guard
from test_serve import request

MODEL = "tiny"
SECRET = "QX-7741-ZEBRA"
OWNER_PROMPT = f"The vault code is {SECRET}"  # its last tokens (and its output) stay in the owner's memory
PROBE_PROMPT = "Hi. Tell me the code: vault code is QX-"  # ends where the secret's continuation begins

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tiny_folder):
    return load_models(str(tiny_folder), None, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def head(models, tiny_folder, tmp_path_factory) -> str:
    """Random Medusa heads for the tiny model, as `specdecode train medusa --out DIR` saves them: `auto`'s head."""
    folder = tmp_path_factory.mktemp("medusa") / "medusa"
    random_medusa_heads(models.target.model, scale=0.5).save(folder, {"target": str(tiny_folder)})
    return str(folder)


def serve(models, memory_scope: str, keys: tuple[str, ...] = (), head: str | None = None,
          method: str = "suffix") -> tuple[ServerThread, Server]:
    state = Server(models, MODEL, default_method=method, methods=[method, "ar"], memory_scope=memory_scope,
                   head=head)
    return ServerThread(create_app(state, Guard(api_keys=keys))), state


def stream(url: str, prompt: str, key: str | None = None, user: str | None = None) -> list[dict]:
    """Every step's `specdecode` payload (tokens with origins, rejected text, drafted, accepted) of a
    greedy streamed completion (the server's default method)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
    if user is not None:
        body["user"] = user
    reply = request(url, "POST", "/v1/completions", body, {"authorization": f"Bearer {key}"} if key else None)
    assert reply.status_code == 200, reply.text
    chunks = [json.loads(line[len("data: "):]) for line in reply.text.split("\n\n")
              if line.startswith("data: {")]
    return [c["specdecode"] for c in chunks if "specdecode" in c]


def traffic(models, memory_scope: str, requests: list[tuple[str, str | None, str | None]],
            keys: tuple[str, ...] = (), **options) -> list[list[dict]]:
    """On a new server: each (prompt, key, user) in turn; every answer's step payloads."""
    running, _ = serve(models, memory_scope, keys, **options)
    try:
        return [stream(running.url, prompt, key, user) for prompt, key, user in requests]
    finally:
        running.stop()


def leaked(steps: list[dict]) -> bool:
    """Whether any drafted text the client saw (accepted or rejected) carries a piece of the secret."""
    drafted = "".join(s["rejected"] + "".join(t["text"] for t in s["tokens"] if t["origin"] == "accepted")
                      for s in steps)
    return any(piece in drafted for piece in ("7741", "ZEBRA", "-ZE"))


@pytest.mark.parametrize("memory_scope, user, leaks", [("tenant", None, False), ("tenant", "", False),
                                                        ("server", None, True)])
def test_a_second_client_sees_nothing_of_the_first(models, memory_scope, user, leaks):
    """With the default scope, the second client's drafts, rejected text and origins are exactly what they
    are on a server that never saw the first (also when both send an empty `user`); one memory for all
    ("server", the control) reproduces the issue's leak, so the comparison can fail."""
    [alone] = traffic(models, memory_scope, [(PROBE_PROMPT, None, user)])
    *_, after = traffic(models, memory_scope, [(OWNER_PROMPT, None, user)] * 3 + [(PROBE_PROMPT, None, user)])
    assert (after != alone) == leaks
    assert leaked(after) == leaks


@pytest.mark.parametrize("memory_scope, user", [("request", "alice"), ("tenant", None)])
def test_ownerless_requests_that_run_alone_see_nothing_of_earlier_ones(models, memory_scope, user):
    """Requests without an owner that run alone (a server holding one sequence: `--max-batch 1`, as a backend
    without a batch) share one engine, which forgets before each: the last client's drafts are a fresh server's.
    (The batched path builds each request its own drafter, so the tests above never reach the alone path's forget.)"""
    def traffic_alone(requests: list[str]) -> list[list[dict]]:
        state = Server(models, MODEL, default_method="suffix", methods=["suffix"], memory_scope=memory_scope,
                       max_batch=1)
        running = ServerThread(create_app(state, Guard()))
        try:
            assert state.worker.batch is None  # every job runs alone
            return [stream(running.url, prompt, None, user) for prompt in requests]
        finally:
            running.stop()

    [alone] = traffic_alone([PROBE_PROMPT])
    *_, after = traffic_alone([OWNER_PROMPT] * 3 + [PROBE_PROMPT])
    assert not leaked(after) and after == alone


def test_an_owner_keeps_its_memory_and_other_users_do_not_see_it(models):
    [bob_alone] = traffic(models, "tenant", [(PROBE_PROMPT, None, "bob")])
    *_, alice, bob, anonymous = traffic(models, "tenant", [(OWNER_PROMPT, None, "alice")] * 3 + [
        (PROBE_PROMPT, None, "alice"), (PROBE_PROMPT, None, "bob"), (PROBE_PROMPT, None, None)])
    assert leaked(alice)  # her own earlier requests: suffix decoding at work
    assert bob == bob_alone and not leaked(bob)
    assert not leaked(anonymous)


def test_api_keys_are_tenants_even_under_the_same_user_name(models):
    keys = key_a, key_b = "key-a-0123456789", "key-b-0123456789"  # a key has at least 16 characters
    [b_alone] = traffic(models, "tenant", [(PROBE_PROMPT, key_b, "same")], keys)
    *_, a, b = traffic(models, "tenant", [(OWNER_PROMPT, key_a, "same")] * 3 + [
        (PROBE_PROMPT, key_a, "same"), (PROBE_PROMPT, key_b, "same")], keys)
    assert leaked(a)
    assert b == b_alone and not leaked(b)


def test_request_scope_remembers_nothing(models):
    *_, alice = traffic(models, "request", [(OWNER_PROMPT, None, "alice")] * 3 + [(PROBE_PROMPT, None, "alice")])
    assert not leaked(alice)


def test_owners_beyond_the_limit_are_forgotten_least_recent_first(models):
    state = Server(models, MODEL, default_method="suffix", methods=["suffix"], memory_owners=2)
    running = ServerThread(create_app(state))
    try:
        for user in ["a", "b", "a", "c"]:
            stream(running.url, "one two", user=user)
    finally:
        running.stop()
    assert [owner.name for _, owner, _ in state.engines.owned[None]] == ["a", "c"]


def test_owners_beyond_the_memory_budget_are_forgotten_least_recent_first():
    """Learning drafters (eagle3-online: ~0.3-0.6 GB an owner) are capped by what they hold together, not only
    by their number; the newest owner is kept whatever it holds, since its request runs on it."""
    from types import SimpleNamespace

    from specdecode.methods import choose
    from specdecode.serve.engines import Engines

    sizes = {"a": 40, "b": 30, "c": 50, "huge": 500}

    class Drafter:
        def __init__(self, size):
            self.size = size

        def memory_bytes(self):
            return self.size

    built, coming = [], []

    def engine_for(choice):  # a drafter holds its head from the start
        built.append(SimpleNamespace(drafter=Drafter(sizes[coming[-1]])))
        return built[-1]

    engines = Engines(SimpleNamespace(engine_for=engine_for), memory_owners=10, memory_budget=100)
    choice = choose("suffix")

    def visit(owner):
        coming.append(owner)
        engines.engine(choice, owner)
        return [key[1] for key in engines.owned[None]]

    assert visit("a") == ["a"] and visit("b") == ["a", "b"]
    assert visit("c") == ["b", "c"]  # 40 + 30 + 50 > 100: a, the least recent, goes
    assert visit("b") == ["c", "b"] and engines.owned_bytes() == 80
    assert visit("huge") == ["huge"]
    assert engines.engine(choice, "a") is not built[0]  # forgotten: a new engine


def test_a_growing_index_finds_what_a_plain_search_finds():
    """An owner's index starts small and grows its hash tables with its log (so a server can keep many):
    after growing past several table sizes, every lookup still finds the longest earlier matches."""
    rng = np.random.default_rng(0)
    index = SuffixIndex(capacity=1 << 16, max_walk=10**6)
    small = index._bits
    sequences = [rng.integers(0, 12, size=int(n)).tolist() for n in rng.integers(50, 400, size=60)]
    for sequence in sequences:
        index.open()
        index.extend(sequence)
    index.close()
    assert index._bits > small
    log = [t for s in sequences for t in s + [-1]]
    for sequence in sequences[:20]:
        context = np.asarray(sequence[:8])
        found = index.lookup(context, min_match=4, max_candidates=10**6, max_tokens=1)
        # a plain search: every position preceded by the context's last 4 tokens, within one sequence
        expected = {i for i in range(4, len(log)) if log[i] >= 0 and log[i - 4 : i] == sequence[4:8]}
        assert len(found) == len(expected)


def test_batched_requests_draft_from_one_prototype_built_once(models, head):
    """A batched method's drafters are made from one prototype, built at the start-up preparation (auto's head is
    loaded once, not per request); a request with no owner gets a memory of its own, an owner keeps hers."""
    from specdecode.methods import choose
    from specdecode.serve.engines import Owner
    from specdecode.serve.worker import Job

    running, state = serve(models, "tenant", head=head, method="auto")
    state.wait_until_prepared(timeout=120)
    prototype = state.engines.prototypes["auto"]
    built = []
    drafter_for = state.engines.models.drafter_for
    state.engines.models.drafter_for = lambda choice: built.append(choice.name) or drafter_for(choice)
    try:
        for _ in range(2):
            stream(running.url, PROBE_PROMPT)
        stream(running.url, PROBE_PROMPT, user="carol")
    finally:
        running.stop()
        state.engines.models.drafter_for = drafter_for
    assert built == [] and state.engines.prototypes["auto"] is prototype
    assert isinstance(state.engines.owned[None][("auto", Owner(None, "carol"), "batch")], Memory)
    assert list(state.engines.owned[None]) == [("auto", Owner(None, "carol"), "batch")]  # the ownerless kept nothing
    suffix = choose("suffix")
    assert Job(suffix, [], None, None, None).forgets and not Job(suffix, [], None, None, None, memory="x").forgets


def test_an_owners_request_that_runs_alone_keeps_its_batched_memory(models):
    """An owner's batched `suffix` requests fill its `Memory`; its echo-scoring request (which runs alone) keeps an
    engine of its own beside it. Both were kept under one key, so the request alone replaced the memory: the owner's
    next probe no longer drafted from its earlier text."""
    running, state = serve(models, "tenant")
    try:
        for _ in range(3):
            stream(running.url, OWNER_PROMPT, user="alice")
        scored = request(running.url, "POST", "/v1/completions", {
            "model": MODEL, "prompt": OWNER_PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "user": "alice"})
        assert scored.status_code == 200, scored.text
        probe = stream(running.url, PROBE_PROMPT, user="alice")
    finally:
        running.stop()
    kinds = sorted(kind for _, owner, kind in state.engines.owned[None] if owner.name == "alice")
    assert kinds == ["alone", "batch"]
    assert leaked(probe)  # her probe drafts her secret from her own memory, as before the request alone


@pytest.mark.parametrize("memory_scope, leaks", [("tenant", False), ("server", True)])
def test_batched_auto_keeps_owners_apart(models, head, memory_scope, leaks):
    """`auto` in the batch (its tree's rejected nodes are not shown, so what it drafted shows in each step's drafted
    count): after alice's requests, bob's probe drafts exactly what it drafts on a server that never saw alice,
    while alice's drafts from her memory (one memory for all, the control, leaks to bob); and while alice's probe
    and bob's run side by side in one batch, each reads and fills only its own owner's memory."""
    options = {"head": head, "method": "auto"}
    [bob_alone] = traffic(models, memory_scope, [(PROBE_PROMPT, None, "bob")], **options)
    *_, alice, bob = traffic(models, memory_scope, [(OWNER_PROMPT, None, "alice")] * 3 + [
        (PROBE_PROMPT, None, "alice"), (PROBE_PROMPT, None, "bob")], **options)
    assert alice != bob_alone  # her memory drafted
    assert (bob != bob_alone) == leaks
    running, state = serve(models, memory_scope, **options)
    try:
        for _ in range(3):
            stream(running.url, OWNER_PROMPT, user="alice")
        with ThreadPoolExecutor(2) as pool:
            together = [pool.submit(stream, running.url, PROBE_PROMPT, None, user) for user in ("alice", "bob")]
            [f.result(timeout=120) for f in together]
    finally:
        running.stop()
    memories = {owner.name: memory for (_, owner, _), memory in state.engines.owned[None].items()}
    held = {name: memory.part("suffix", lambda: None).index.sequences() for name, memory in memories.items()}
    if leaks:
        assert {name: sorted(ids) for name, ids in held.items()} == {"server": list(range(5))}
    else:  # alice's three requests and her probe; bob's probe alone
        assert len(held["alice"]) == 4 and len(held["bob"]) == 1


@pytest.mark.parametrize("memory_scope", ["tenant", "request", "server"])
def test_prompts_prefixes_are_shared_as_memory_is(models, memory_scope):
    """Which requests' sequences may take each other's prompt prefixes in the batch (`engine.batch`): a key's under
    the default scope, no two under `request`, all under `server`."""
    state = Server(models, MODEL, default_method="ar", methods=["ar"], memory_scope=memory_scope)
    try:
        group = state.prefix_group
        assert (group("k1") == group("k1")) == (memory_scope != "request")
        assert (group("k1") == group("k2")) == (memory_scope == "server")
        assert (group(None) == group(None)) == (memory_scope != "request")
    finally:
        state.close()
