"""The cost curve that corrects itself from the forwards the engine times (`LiveCurve`), per band of cache lengths,
on a prior measured once per model and machine (`models.costs`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdecode.models import costs
from specdecode.models.costs import CostCurve, lower_median

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM  # whose cost_curve() imports this module


class LiveCurve:
    """A cost curve that corrects itself from the forwards the engine times (`observe`).

    It starts from a measured curve (the prior, measured once per machine and cached) and keeps, for each
    measured size, the lower median of the latest forwards of that size (a forward of n tokens counts for
    the smallest measured size of at least n), the prior's figure counting as one of them until WINDOW
    timings have pushed it out; no size is estimated cheaper than a narrower one. So a size's first timing, if
    faster than the prior, is believed at once (a forward cannot be faster than the machine allows; later, with
    several timings kept, a figure moves once half of them say so), while a slower figure needs two timings out
    of three: one stall (a page fault, another process taking the core) must not price a size
    for good, and a size the gate then stops verifying would keep that price, also in the cache. A curve
    measured in a busy moment is thus corrected within a few steps, and a quiet curve follows the machine
    when it gets busy. Sizes the gate has stopped
    verifying would never be timed again, so the engine asks `probe` for one size just beyond the widest
    that paid recently, once every `PROBE_EVERY` forwards, and verifies that much: lossless, and a few
    percent of the time at worst.

    A size never timed between two timed ones is priced on the line between them, not by the prior, one
    narrower than every timed size never above the narrowest timed one, and one wider than every timed size by
    the prior's shape at the widest timed size's scale (the prior's seconds are one moment's: a busy one priced
    every width the gate had not yet verified out of reach, and nothing ever timed them). The gate fills a
    forward up to the widest size of a price, so where the prior says sizes 4 to 8 cost alike (a busy moment, or
    a curve flattened by the rule above and stored), it verifies 8 and never 4 or 6, whose stale figures then
    held every wider size up (and, stored, the next process's prior): a trap no timing ever left.

    A forward's attention reads the whole cache, so the same width costs more over a longer one (a batch of
    eight sequences holds thousands of tokens): the estimates are kept per band of cache lengths
    (`context_band`: under 1,024 tokens, then doubling), each starting from the band below as it stood.
    The engine says the cache length its next forwards run over (`at`), which the readers of the curve then
    price, and each timing goes to its own forward's band. Mixed, the forwards of a crowded batch priced
    every width for the lone requests after it, and through the cache for later processes too (only the
    first band is stored, the one the prior was measured in).

    Reads like a CostCurve: `curve(n)`, `sizes`, `relative`, `seconds`."""

    WINDOW = 7  # latest forwards per size whose median is the estimate
    PROBE_EVERY = 24  # forwards between probes of a size that has not been timed for as long

    def __init__(self, prior: CostCurve, on_change=None):
        self.sizes = prior.sizes
        seconds = prior.seconds or 1.0
        figures = [r * seconds for r in prior.relative]
        self._bands = {0: _Band([[f] for f in figures], [0] * len(self.sizes), [False] * len(self.sizes), figures)}
        self._band = 0  # where the next forwards run (`at`)
        self._forwards = 0
        self._on_change = on_change  # called with the first band's curve now and then (to cache it)
        self._prefill = prior.prefill  # (not corrected: the engine times no prefill)

    def _index(self, n: int) -> int | None:
        return next((i for i, size in enumerate(self.sizes) if size >= n), None)

    def _get(self, band: int) -> _Band:
        """A band's estimates; a band met for the first time starts from the nearest band below it, as it stands."""
        if band not in self._bands:
            below = self._bands[max(b for b in self._bands if b < band)]
            self._bands[band] = _Band([list(times) for times in below.times], [0] * len(self.sizes),
                                      list(below.timed), below.prior)
        return self._bands[band]

    def at(self, context: int) -> None:
        """The next forwards run over a cache of `context` tokens: the curve prices their band from now on."""
        self._band = context_band(context)
        self._get(self._band)

    def observe(self, n: int, seconds: float, context: int | None = None) -> None:
        """A forward over n new tokens took `seconds`, over a cache of `context` tokens (None: the band set last)."""
        self._forwards += 1
        band = self._get(self._band if context is None else context_band(context))
        band.forwards += 1
        i = self._index(n)
        if i is None or not seconds > 0:
            return
        band.times[i] = [seconds, *band.times[i][: self.WINDOW - 1]]
        band.last_seen[i] = band.forwards
        band.timed[i] = True
        band.snapshot = None
        if self._on_change is not None and self._forwards % 256 == 0:
            self._on_change(self._curve(self._bands[0]))

    def _curve(self, band: _Band) -> CostCurve:
        if band.snapshot is None:
            # never less than a narrower forward: a wide size timed in a quiet moment (or the prior's figure)
            # must not make every narrower forward look cheap once the narrow ones are timed busy
            estimates = list(itertools.accumulate(_between_timed(self.sizes, band), max))
            band.snapshot = CostCurve(self.sizes, tuple(e / estimates[0] for e in estimates), estimates[0],
                                      self._prefill)
        return band.snapshot

    def current(self) -> CostCurve:
        """The curve as it stands, in the band the next forwards run in."""
        return self._curve(self._bands[self._band])

    def probe(self, widest: int) -> int | None:
        """A forward size worth timing again, or None: the next measured size beyond `widest` (the widest
        forward that paid lately) when it has not been timed in this band for PROBE_EVERY of its forwards."""
        band = self._bands[self._band]
        i = self._index(widest + 1)
        if i is None or band.forwards - band.last_seen[i] < self.PROBE_EVERY:
            return None
        band.last_seen[i] = band.forwards  # one probe per period, whether or not the draft fills it
        return self.sizes[i]

    def __call__(self, n: int) -> float:
        return self.current()(n)

    @property
    def relative(self) -> tuple[float, ...]:
        return self.current().relative

    @property
    def seconds(self) -> float:
        return self.current().seconds

    @property
    def prefill(self) -> float:
        return self._prefill


@dataclass
class _Band:
    """A LiveCurve's estimates for one band of cache lengths."""

    times: list[list[float]]  # per size, the latest forwards' seconds, latest first
    last_seen: list[int]  # per size, the band's forward count when it was last timed or probed
    timed: list[bool]  # per size, whether a forward of it was ever timed (else its times are the prior's)
    prior: list[float]  # per size, the prior's seconds (whose shape prices the sizes wider than every timed one)
    forwards: int = 0
    snapshot: CostCurve | None = None


def _between_timed(sizes: tuple[int, ...], band: _Band) -> list[float]:
    """A band's seconds per size (`LiveCurve`): the lower median of its latest forwards; a size never timed, between
    two timed sizes, on the line between their figures; narrower than every timed size, the prior's, but never more
    than the narrowest timed size's figure; wider than every timed size, the prior's shape at the widest timed size's
    scale (the prior's seconds may be from a busy moment, or another load: only a timing says what they are now)."""
    seconds = [lower_median(times) for times in band.times]
    timed = [i for i, was in enumerate(band.timed) if was]
    for below, above in itertools.pairwise(timed):
        for i in range(below + 1, above):
            share = (sizes[i] - sizes[below]) / (sizes[above] - sizes[below])
            seconds[i] = seconds[below] + share * (seconds[above] - seconds[below])
    for i in range(timed[0] if timed else 0):
        seconds[i] = min(seconds[i], seconds[timed[0]])
    if timed:
        scale = seconds[timed[-1]] / band.prior[timed[-1]]
        for i in range(timed[-1] + 1, len(sizes)):
            seconds[i] = band.prior[i] * scale
    return seconds


FIRST_BAND = 1024  # cache lengths below this are the first band (the prior is measured over 256 tokens)


def context_band(context: int) -> int:
    """The band of a cache of `context` tokens (`LiveCurve`): 0 below FIRST_BAND, then one per doubling."""
    return (max(context, 0) // FIRST_BAND).bit_length()


def live(model: CausalLM) -> LiveCurve:
    """A LiveCurve from the model's cached curve, storing its corrections back."""
    key = model.cost_key
    return LiveCurve(costs.cached(model, key), on_change=lambda curve: costs.store(key, curve))
