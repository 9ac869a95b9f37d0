"""The methods a server offers, each resolved once at start-up (`methods.choose`), and their preparation.

What a method costs once (the target's and draft's cost curves, a layer search, a retrieval datastore) is
paid at start-up for the methods a server is given, or else on a method's first request, in the background
at the lowest priority (`Preparation.in_background`): never inside a request, never on the worker, so no
other request waits for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass

from specdecode.api import Models
from specdecode.errors import UserError
from specdecode.methods import MethodChoice, choose, variant_names
from specdecode.models.hf import HFCausalLM
from specdecode.serve.engines import Engines, yield_the_cpu

log = logging.getLogger("specdecode.serve")


@dataclass(frozen=True)
class Offer:
    """The default method and those clients may name, resolved (`resolve`)."""

    default: MethodChoice
    choices: tuple[MethodChoice, ...]

    @classmethod
    def resolve(cls, models: Models, default: str | MethodChoice, methods: Sequence[str | MethodChoice] | None,
                datastore: str | None = None, head: str | None = None) -> Offer:
        """`methods`: those clients may name (default: every one the models can run), by name or resolved
        already; `datastore` goes to those that retrieve from one, `head` (a trained head's folder) to the
        methods of its kind. A UserError for an unknown name, or a
        method that needs the draft model the server has not loaded."""

        def resolved(method: str | MethodChoice) -> MethodChoice:
            if isinstance(method, MethodChoice):
                return method
            return choose(method, datastore=datastore, head=head, only_if_taken=True)

        default_choice, named = resolved(default), [resolved(m) for m in methods or ()]
        for choice in [default_choice, *named]:
            if choice.method.needs_draft_model and models.draft is None:
                raise UserError(f"method {choice.name!r} needs the draft model, which this server has not loaded")
        if not named:  # (those these models run: the llama.cpp backend runs fewer)
            backend = "torch" if isinstance(models.target, HFCausalLM) else "llamacpp"
            named = [choice for choice in map(resolved, variant_names()) if choice.runs_on(backend)
                     and (models.draft is not None or not choice.method.needs_draft_model)]
        return cls(default_choice, tuple({choice.name: choice for choice in named}.values()))

    def names(self) -> list[str]:
        return [choice.name for choice in self.choices]

    def get(self, name: str) -> MethodChoice | None:
        """The offered method of this name (None: not offered)."""
        return next((choice for choice in self.choices if choice.name == name), None)


class Preparation:
    """Which methods are ready, unavailable (and why) or being prepared; preparing one builds its engine
    (`Engines.prepare`), kept for its jobs unless they are batched (`batching`)."""

    def __init__(self, engines: Engines, batching: bool):
        self.engines, self.batching = engines, batching
        self.ready: set[str] = set()
        self.unavailable: dict[str, str] = {}  # method -> why it cannot run here
        self._preparing: dict[str, Future] = {}  # method -> its preparation in the background
        self._lock = threading.Lock()

    def status(self, name: str) -> str:
        """ready; unavailable (`unavailable` says why); preparing; or cold (prepared on its first request)."""
        if name in self.ready or name in self.unavailable:
            return "ready" if name in self.ready else "unavailable"
        return "preparing" if name in self._preparing else "cold"

    def prepare(self, choice: MethodChoice) -> None:
        """Pay what a method costs once (a layer search, a datastore, a head...): build its engine, or for a
        method whose jobs are batched the prototype each sequence's drafter is made from (`serve.engines`)."""
        try:
            self.engines.prepare(choice, batched=choice.method.batchable and self.batching)
        except UserError as error:
            self.unavailable[choice.name] = str(error)
            return
        except Exception:
            log.exception("preparing method %s failed", choice.name)
            self.unavailable[choice.name] = "it could not be prepared (the server's log says why)"
            return
        self.ready.add(choice.name)

    def in_background(self, choice: MethodChoice) -> Future:
        """Start preparing a method on a thread of its own at the lowest priority (once); its future."""
        with self._lock:
            if choice.name not in self._preparing:
                future = self._preparing[choice.name] = Future()

                def prepare() -> None:
                    yield_the_cpu()
                    self.prepare(choice)
                    future.set_result(choice.name)

                threading.Thread(target=prepare, name=f"specdecode-prepare-{choice.name}", daemon=True).start()
            return self._preparing[choice.name]

    def wait(self, timeout: float | None = None) -> None:
        """Block until every preparation under way has ended."""
        futures.wait(list(self._preparing.values()), timeout)
