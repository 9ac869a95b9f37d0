"""The factory the worker builds a job's engine or drafter with (`worker.Factory`), from the job's method as
it was resolved once (`methods.MethodChoice`), and the engines it keeps:

- a method that remembers nothing: one engine, built at its preparation (`prepare`) or its first job, then
  reused;
- a method that learns from earlier requests (`Method.remembers`: suffix decoding, eagle3-online): one engine per
  memory owner (`Job.memory`), at most `memory_owners` of them whose drafters hold at most `memory_budget`
  bytes together (`Drafter.memory_bytes`: a head that learns online holds ~0.3-0.6 GB), the least recently
  used dropped first; a job with no owner gets a new one that forgets it afterwards;
- one sequence of a batch: a new drafter of its own, which remembers nothing after.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Hashable

from specdecode.api import Models
from specdecode.drafters.base import Drafter
from specdecode.engine import SpeculativeEngine
from specdecode.methods import MethodChoice


class Engines:
    """Engines and drafters for resolved methods, over one set of loaded models."""

    def __init__(self, models: Models, memory_owners: int = 64, memory_budget: int | None = None):
        """`memory_budget`: bytes; None: a quarter of the machine's memory (`default_memory_budget`)."""
        self.models, self.memory_owners = models, memory_owners
        self.memory_budget = default_memory_budget() if memory_budget is None else memory_budget
        self.shared: dict[str, SpeculativeEngine] = {}  # methods that remember nothing: one each, by name
        self.owned: OrderedDict[tuple[str, Hashable], SpeculativeEngine] = OrderedDict()  # least recent first

    def prepare(self, choice: MethodChoice, keep: bool = True) -> None:
        """Build a method's engine now, paying what it costs once (a layer search, a datastore...); kept
        for its jobs when `keep` (not for a method whose jobs are batched) and it remembers nothing.
        Raises what building it raises."""
        engine = self.models.engine_for(choice)
        if keep and not choice.method.remembers:
            self.shared[choice.name] = engine

    def engine(self, choice: MethodChoice, memory: Hashable | None) -> SpeculativeEngine:
        """The engine a job runs alone with (on the worker thread)."""
        if choice.method.remembers:
            return self._owned(choice, memory)
        if choice.name not in self.shared:  # a prepared method has one already
            self.shared[choice.name] = self.models.engine_for(choice)
        return self.shared[choice.name]

    def _owned(self, choice: MethodChoice, memory: Hashable | None) -> SpeculativeEngine:
        """The engine holding the memory of `memory`'s owner; with none, a new one."""
        if memory is None:
            return self.models.engine_for(choice)
        key = (choice.name, memory)
        engine = self.owned.pop(key, None) or self.models.engine_for(choice)
        self.owned[key] = engine
        held = self.owned_bytes()
        while len(self.owned) > 1 and (len(self.owned) > self.memory_owners or held > self.memory_budget):
            _, dropped = self.owned.popitem(last=False)  # the newest is kept, whatever it holds: its job needs it
            held -= _held(dropped)
        return engine

    def owned_bytes(self) -> int:
        """What the owners' drafters hold together."""
        return sum(_held(engine) for engine in self.owned.values())

    def drafter(self, choice: MethodChoice) -> Drafter | None:
        """A new drafter for one batched sequence (None: plain decoding)."""
        return self.models.drafter_for(choice)


def default_memory_budget() -> int:
    """A quarter of the machine's memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def _held(engine: SpeculativeEngine) -> int:
    return engine.drafter.memory_bytes() if engine.drafter is not None else 0
