"""Who uses a model's KV cache. Engines made from one `Models` share its target and the target's one cache: two
sequences decoding on it at once (two threads, two streams stepped in turn, an engine beside a batch) wrote into each
other's context, and so did the first measurement of the model's cost curve, which an engine's drafter asks for as it
is built. So the cache has one holder at a time: a sequence's engine, or a batch from its first sequence to its last,
takes it without waiting (`take`: refused in words while another holds it), and a measurement waits for it
(`measuring`). A model's `sibling()` has a cache, and so a holder, of its own."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

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


def take(model: object, holder: object, refusal: str) -> weakref.finalize:
    """`model`'s cache, held for `holder` until the returned finalizer is called (once; or `holder` is collected); a
    UserError saying `refusal` while another holds it."""
    hold = _hold(model)
    if not hold.lock.acquire(blocking=False):
        raise UserError(refusal)
    hold.thread = threading.get_ident()

    def release() -> None:
        hold.thread = None
        hold.lock.release()

    return weakref.finalize(holder, release)


class Holder:
    """One holder of `model`'s cache (an engine, a batch): `take` it (a UserError saying `refusal` while another holds
    it), `let_go` of it; let go of too when the holder is collected. Either, done twice, is done once."""

    def __init__(self, model: object, refusal: str):
        self.model, self.refusal = model, refusal
        self._release: weakref.finalize | None = None

    def take(self) -> None:
        if self._release is None:
            self._release = take(self.model, self, self.refusal)

    def let_go(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


@contextlib.contextmanager
def measuring(model) -> Iterator[None]:
    """`model`'s cache for a measurement, which empties it: once its holder lets it go, unless this thread holds it
    with the cache empty (an engine's generation about to begin); a sequence this thread holds part-way (a stream
    paused while another engine is built) is a UserError rather than lost."""
    hold = _hold(model)
    if hold.thread == threading.get_ident():
        if model.cache_length:
            raise UserError("measuring this model's cost curve (once, as an engine is built) would overwrite the "
                            "sequence this thread decodes on it: finish or close that stream first")
        yield
        return
    with hold.lock:
        hold.thread = threading.get_ident()
        try:
            yield
        finally:
            hold.thread = None
