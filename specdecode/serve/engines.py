"""The factory the worker builds a job's engine or drafter with (`worker.Factory`), from the job's method as
it was resolved once (`methods.MethodChoice`), and the engines it keeps:

- a method that remembers nothing: one engine, built at its preparation (`prepare`) or its first job, then
  reused;
- a method that drafts from earlier requests' text (`Method.remembers`: suffix decoding): one engine per
  memory owner (`Job.memory`), at most `memory_owners` of them, the least recently used dropped first; a
  job with no owner gets a new one that forgets it afterwards;
- one sequence of a batch: a new drafter of its own, which remembers nothing after.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from specdecode.api import Models
from specdecode.drafters.base import Drafter
from specdecode.engine import SpeculativeEngine
from specdecode.methods import MethodChoice


class Engines:
    """Engines and drafters for resolved methods, over one set of loaded models."""

    def __init__(self, models: Models, memory_owners: int = 64):
        self.models, self.memory_owners = models, memory_owners
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
        while len(self.owned) > self.memory_owners:
            self.owned.popitem(last=False)
        return engine

    def drafter(self, choice: MethodChoice) -> Drafter | None:
        """A new drafter for one batched sequence (None: plain decoding)."""
        return self.models.drafter_for(choice)
