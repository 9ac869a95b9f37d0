"""Who uses a model's KV cache. Engines made from one `Models` share its target and the target's one cache: two
sequences decoding on it at once (two threads, two streams stepped in turn, an engine beside a batch) wrote into each
other's context, and so did the first measurement of the model's cost curve, which an engine's drafter asks for as it
is built. So the cache has one holder at a time: a sequence's engine, or a batch from its first sequence to its last,
takes it without waiting (`Holder.take`: refused in words while another holds it), and a measurement runs beside a
holder on a sibling (`measuring`). A model's `sibling()` has a cache, and so a holder, of its own."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

from specdecode.errors import UserError


class Hold:
    def __init__(self):
        self.lock = threading.Lock()
        self.thread: int | None = None  # the thread that took it


_HOLDS: weakref.WeakKeyDictionary[object, Hold] = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()


def _hold(model: object) -> Hold:
    with _GUARD:
        return _HOLDS.setdefault(model, Hold())


class Holder:
    """One holder of `model`'s cache (an engine, a batch): `take` it (a UserError saying `refusal` while another holds
    it), `let_go` of it; let go of too when the holder is collected. Either, done twice, is done once."""

    def __init__(self, model: object, refusal: str):
        self.model, self.refusal = model, refusal
        self._release: weakref.finalize | None = None

    def take(self) -> None:
        """The cache, held until `let_go` (or this holder is collected); a UserError saying `refusal` while another
        holds it."""
        if self._release is not None:
            return
        hold = _hold(self.model)
        if not hold.lock.acquire(blocking=False):
            raise UserError(self.refusal)
        hold.thread = threading.get_ident()

        def release() -> None:
            hold.thread = None
            hold.lock.release()

        self._release = weakref.finalize(self, release)

    @contextlib.contextmanager
    def taken(self, kept: Callable[[], object]) -> Iterator[None]:
        """`take`, then what follows: where it fails and the holder `kept` nothing in the cache, let go again."""
        self.take()
        try:
            yield
        except BaseException:
            if not kept():
                self.let_go()
            raise

    def let_go(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


@contextlib.contextmanager
def measuring(model) -> Iterator:
    """The model to measure `model`'s cost on, which a measurement empties: `model` itself where this thread holds it
    with its cache empty (an engine's generation about to begin) or nobody holds it (held for the measurement); a
    sibling over a cache of its own (`SPARE_CACHE`: one that grows, costing nothing up front) where a sequence holds
    it, in another thread or paused in this one; never a wait (a stream paused on another thread would wait for
    the waiting one). A model without such a sibling is then a UserError."""
    hold = _hold(model)
    if hold.thread == threading.get_ident() and not model.cache_length:
        yield model
    elif hold.lock.acquire(blocking=False):
        hold.thread = threading.get_ident()
        try:
            yield model
        finally:
            hold.thread = None
            hold.lock.release()
    elif getattr(model, "SPARE_CACHE", False):
        yield model.sibling()
    else:
        raise UserError("this model's cost curve is measured once, on first use, over its cache, which a sequence "
                        "holds now (another thread's, or a paused stream): build the engine before it or after it")
