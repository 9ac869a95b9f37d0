"""The factory the worker builds a job's engine or drafter with (`worker.Factory`), from the job's method as
it was resolved once (`methods.MethodChoice`), and the engines it keeps:

- a method that remembers nothing: one engine, built at its preparation (`prepare`) or its first job, then
  reused;
- a method that learns from earlier requests (`Method.remembers`: suffix decoding, eagle3-online): one engine per
  memory owner (`Job.memory`, an `Owner`), kept per tenant (an API key): at most `memory_owners` owners of a
  tenant, whose drafters hold at most `memory_budget` bytes together (`Drafter.memory_bytes`: a head that
  learns online holds ~0.3-0.6 GB), the tenant's least recently used dropped first, so that a tenant can
  only push out its own owners; the jobs with no owner share one engine, which forgets everything before
  each of them (`SpeculativeEngine.forget`, called by the worker: `worker.Job.forgets`), so that such a job
  neither reads another's text nor pays for building the method's drafters (loading its heads) again;
- one sequence of a batch: a new drafter of its own (`Drafter.for_sequence`), made from the method's *prototype*
  (built once, at its preparation or its first job: a head loaded, a datastore read, shared by every sequence's
  drafter); for a method that remembers, reading its owner's `Memory` (kept per owner as an engine would be, within
  the same limits) and adding the sequence to it as it ends, or one of its own, forgotten after, where the request
  has no owner. So one owner's sequences run side by side in the batch, and none reads another owner's.

A job that runs alone gets its engine before it is submitted (`building`): built beside the worker, on a
thread of its own at the lowest priority, where it must be built (a new owner's: loading and preparing a
head takes seconds), so that the worker goes on with the other requests meanwhile; one build at a time for
each tenant.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass

from specdecode.api import Models
from specdecode.drafters.base import Drafter, Memory
from specdecode.engine import SpeculativeEngine
from specdecode.methods import MethodChoice

Kept = SpeculativeEngine | Memory  # what is kept per owner: an engine (a job that runs alone) or a batch's memory


@dataclass(frozen=True)
class Owner:
    """Whose cross-request memory a request reads and adds to: a tenant (an API key's identity; None
    without keys, or for the one memory a whole server shares) and a name within it (the `user` field)."""

    tenant: str | None
    name: str | None


class Engines:
    """Engines and drafters for resolved methods, over one set of loaded models."""

    def __init__(self, models: Models, memory_owners: int = 64, memory_budget: int | None = None):
        """`memory_owners` and `memory_budget` (bytes; None: a quarter of the machine's memory,
        `default_memory_budget`): what one tenant's owners may be, and hold together."""
        self.models, self.memory_owners = models, memory_owners
        self.memory_budget = default_memory_budget() if memory_budget is None else memory_budget
        self.shared: dict[str, SpeculativeEngine] = {}  # methods that remember nothing: one each, by name
        self.forgetful: dict[str, SpeculativeEngine] = {}  # methods that remember: the ownerless jobs' one each
        # batched methods: the drafter each sequence's is made from (`Drafter.for_sequence`), by name (None: ar)
        self.prototypes: dict[str, Drafter | None] = {}
        # tenant -> (method, owner) -> engine or memory, least recent first
        self.owned: dict[str | None, OrderedDict[tuple[str, Hashable, str], Kept]] = {}
        self._lock = threading.Lock()  # the worker, the builders and the server's event loop share the above
        self._building: dict[str | None, tuple[tuple[str, Hashable | None], Future]] = {}  # tenant -> its build

    def prepare(self, choice: MethodChoice, batched: bool = False) -> None:
        """Build a method's engine now, paying what it costs once (a layer search, a datastore, a head...), kept
        for its jobs (a method that remembers keeps it as the one its ownerless jobs share); for a method whose
        jobs are `batched`, its prototype drafter. Raises what building it raises."""
        if batched:
            prototype = self.models.drafter_for(choice)
            with self._lock:
                self.prototypes.setdefault(choice.name, prototype)
            return
        engine = self.models.engine_for(choice)
        with self._lock:
            self._keep(choice, None, engine)

    def engine(self, choice: MethodChoice, memory: Hashable | None) -> SpeculativeEngine:
        """The engine a job runs alone with, built here if need be (on the worker thread, for a job
        submitted without one: `building`)."""
        with self._lock:
            engine = self._built(choice, memory)
        if engine is None:
            engine = self.models.engine_for(choice)
            with self._lock:
                self._keep(choice, memory, engine)
        return engine

    def building(self, choice: MethodChoice, memory: Hashable | None, tenant: str | None) -> Future | None:
        """The engine a job of `tenant` will run alone with: a done future where it is built already; else a
        future that a thread of its own completes (lowest priority: `yield_the_cpu`), shared by the jobs of
        the same owner; None while the tenant's builder is busy with another owner's engine (retry later).
        The future's exception is what building raised."""
        with self._lock:
            engine = self._built(choice, memory)
            if engine is not None:
                done: Future = Future()
                done.set_result(engine)
                return done
            key = (choice.name, memory)
            if tenant in self._building:
                under_way, future = self._building[tenant]
                return future if under_way == key else None
            future = Future()
            future.set_running_or_notify_cancel()  # no waiter can cancel it: other jobs of the owner may wait too
            self._building[tenant] = (key, future)

        def build() -> None:
            yield_the_cpu()
            engine = failure = None
            try:
                engine = self.models.engine_for(choice)
            except Exception as error:  # the request's to report (UserError: 400, others: 500)
                failure = error
            with self._lock:
                if engine is not None:
                    self._keep(choice, memory, engine)
                del self._building[tenant]
            if failure is not None:
                future.set_exception(failure)
            else:
                future.set_result(engine)

        threading.Thread(target=build, name=f"specdecode-build-{choice.name}", daemon=True).start()
        return future

    def _built(self, choice: MethodChoice, memory: Hashable | None) -> SpeculativeEngine | None:
        """The engine kept for a job (the owner's now the most recent of its tenant's), or None: to build.
        Under the lock."""
        if not choice.method.remembers:
            return self.shared.get(choice.name)
        if memory is None:
            return self.forgetful.get(choice.name)
        kept = self._owned(choice, memory, "alone")
        return kept if isinstance(kept, SpeculativeEngine) else None

    def _owned(self, choice: MethodChoice, memory: Hashable, kind: str) -> Kept | None:
        """What is kept for an owner's jobs of a method of `kind` ("alone": its engine for jobs that run alone;
        "batch": its `Memory` for batched ones; kept apart, so that one never replaces the other), now the most
        recent of its tenant's. Under the lock."""
        owners = self.owned.get(_tenant(memory))
        key = (choice.name, memory, kind)
        if owners is None or key not in owners:
            return None
        owners.move_to_end(key)
        return owners[key]

    def _keep(self, choice: MethodChoice, memory: Hashable | None, engine: Kept) -> None:
        """Keep a new engine for later jobs: a method's, or an owner's as its tenant's most recent, dropping
        the tenant's least recently used owners beyond its limits (the newest is kept, whatever it holds: its
        job needs it). Under the lock."""
        if memory is None or not choice.method.remembers:
            assert isinstance(engine, SpeculativeEngine)
            (self.forgetful if choice.method.remembers else self.shared).setdefault(choice.name, engine)
            return
        owners = self.owned.setdefault(_tenant(memory), OrderedDict())
        owners[(choice.name, memory, "batch" if isinstance(engine, Memory) else "alone")] = engine
        held = sum(_held(e) for e in owners.values())
        while len(owners) > 1 and (len(owners) > self.memory_owners or held > self.memory_budget):
            _, dropped = owners.popitem(last=False)
            held -= _held(dropped)

    def owned_bytes(self, tenant: str | None = None) -> int:
        """What a tenant's owners' drafters hold together."""
        with self._lock:
            return sum(_held(engine) for engine in self.owned.get(tenant, {}).values())

    def drafter(self, choice: MethodChoice, memory: Hashable | None) -> Drafter | None:
        """A new drafter for one batched sequence (None: plain decoding), made from the method's prototype (built
        here on the worker if its preparation did not); for a method that remembers, with `memory`'s owner's
        `Memory` (None: one of its own)."""
        with self._lock:
            known, prototype = choice.name in self.prototypes, self.prototypes.get(choice.name)
        if not known:
            prototype = self.models.drafter_for(choice)
            with self._lock:
                prototype = self.prototypes.setdefault(choice.name, prototype)
        if prototype is None:
            return None
        return prototype.for_sequence(self.memory(choice, memory) if choice.method.remembers else None)

    def memory(self, choice: MethodChoice, owner: Hashable | None) -> Memory:
        """An owner's memory of a method's batched sequences, kept as its tenant's most recent (a new one where
        `owner` is None: forgotten after)."""
        if owner is None:
            return Memory()
        with self._lock:
            kept = self._owned(choice, owner, "batch")
            if not isinstance(kept, Memory):
                kept = Memory()
                self._keep(choice, owner, kept)
            return kept


def default_memory_budget() -> int:
    """A quarter of the machine's memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def yield_the_cpu() -> None:
    """Give this thread, and the threads it starts (torch's for a layer search), the lowest priority
    (Linux: nice 19): a preparation takes only the CPU that decoding leaves."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _tenant(memory: Hashable | None) -> str | None:
    """The tenant whose owners `memory` is among (an `Owner`'s; None for any other key)."""
    return memory.tenant if isinstance(memory, Owner) else None


def _held(kept: Kept) -> int:
    if isinstance(kept, Memory):
        return kept.memory_bytes()
    return kept.drafter.memory_bytes() if kept.drafter is not None else 0
