"""Where a batch's sequences keep their keys and values: each a list of slots of the target's one KV cache
(`engine.batch`), a sequence's first slots perhaps another's, where their prompts begin alike."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import NamedTuple

import torch


class Slots:
    """A sequence's cache slots, in order, in a growing tensor: a step adds a few, and every step's mask reads them
    all (`attention_inputs`), which a Python list would turn into a tensor anew each time."""

    def __init__(self, slots: torch.Tensor | None = None):  # (a tensor given becomes its own)
        self._data = torch.empty(64, dtype=torch.long, device="cpu") if slots is None else slots
        self._length = 0 if slots is None else len(slots)

    def __len__(self) -> int:
        return self._length

    def extend(self, slots: list[int] | range) -> None:
        end = self._length + len(slots)
        if end > len(self._data):  # (doubled: the slots are copied now and then, not at every step)
            grown = torch.empty(max(end, 2 * len(self._data)) - self._length, dtype=torch.long, device="cpu")
            self._data = torch.cat([self._data[: self._length], grown])
        self._data[self._length : end] = torch.as_tensor(slots, dtype=torch.long, device="cpu")
        self._length = end

    @property
    def tensor(self) -> torch.Tensor:  # [len] the slots (a view: read it before the next `extend`)
        return self._data[: self._length]


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many tokens two lists share from their start, `limit` at most. Galloping, in slices compared at C speed: the
    work grows with the tokens shared, not with the lists (a waiting prompt is matched again at every step)."""
    end, low, step = min(len(a), len(b), limit), 0, 1
    while low < end:
        high = min(low + step, end)
        if a[low:high] == b[low:high]:
            low, step = high, 2 * step
        elif step == 1:
            break
        else:  # the first difference lies in [low, high): close in on it from low again
            step = 1
    return low


class Held(NamedTuple):
    """A sequence's context as its slots hold it: `context[:len(slots)]` (tenant: who may take a prefix of it)."""

    tenant: Hashable
    context: list[int]
    slots: torch.Tensor


def longest_prefix(tokens: list[int], limit: int, tenant: Hashable, held: Iterable[Held]
                   ) -> tuple[int, torch.Tensor | None]:
    """The longest prefix of `tokens`, `limit` at most, that one of `held` of `tenant` holds: its length and that
    one's slots (None: no token in common)."""
    best, where = 0, None
    for h in held:
        if h.tenant == tenant and len(h.slots) > best:
            if (n := common_prefix(tokens, h.context, min(limit, len(h.slots)))) > best:
                best, where = n, h.slots
    return best, where
