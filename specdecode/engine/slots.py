"""Where a batch's sequences keep their keys and values: each a list of slots of the target's one KV cache
(`engine.batch`), a sequence's first slots perhaps another's, where their prompts begin alike; what a forward over
them takes (its inputs and the mask that keeps each sequence to its own slots); and ended sequences' contexts copied
out of the cache for later prompts that begin as they do (`SavedContexts`)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import NamedTuple

import torch

from specdecode.engine.sequence import draft_inputs
from specdecode.models.base import Entries
from specdecode.types import Draft


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


WAIT_SHARE = 0.5  # a prompt waits for an earlier one that will hold this share of what it has left to feed, or more


def doubled(slots: list[Slots]) -> int:
    """The slots held by more than one of `slots`, counted once for each holder beyond the first."""
    held = [s.tensor for s in slots]
    return sum(map(len, held)) - len(torch.unique(torch.cat(held))) if held else 0


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
    """A sequence's context as its slots hold it, `context[:len(slots)]` (tenant: who may take a prefix of it); or
    as a copy of its entries out of the cache holds it (`SavedContexts`)."""

    tenant: Hashable
    context: list[int]
    slots: torch.Tensor | Entries


def longest_prefix(tokens: list[int], limit: int, tenant: Hashable, held: Iterable[Held]) -> tuple[int, Held | None]:
    """The longest prefix of `tokens`, `limit` at most, that one of `held` of `tenant` holds: its length and that
    one, the first of those that hold as much (None: no token in common)."""
    best, where = 0, None
    for h in held:
        if h.tenant == tenant and len(h.slots) > best:
            if (n := common_prefix(tokens, h.context, min(limit, len(h.slots)))) > best:
                best, where = n, h
    return best, where


def waiting(feeding: Iterable[tuple[Hashable, Hashable, list[int], int | None]], share: float = WAIT_SHARE) -> set:
    """Of the sequences that share (`BatchEngine.add`'s `share`) feeding their prompts, in arrival order, each (id,
    tenant, prompt, tokens it holds when all are a prefix it took, None when it fed some itself), those that wait for
    an earlier one of their tenant still feeding whose prompt begins as theirs for at least `share` of what they have
    left to take (all but their last token): the next steps they take that prefix from it (`BatchEngine._borrow`)
    instead of feeding it too (a request's sampled choices, clients sending one document at once)."""
    out, earlier = set(), list[tuple[Hashable, list[int]]]()
    for ident, tenant, prompt, holds in feeding:
        if holds is not None:
            left = len(prompt) - 1 - holds
            gain = max((common_prefix(prompt, other, len(prompt) - 1) for t, other in earlier if t == tenant),
                       default=0) - holds
            if left > 0 and gain >= max(1.0, share * left):
                out.add(ident)
        earlier.append((tenant, prompt))
    return out


class SavedContexts:
    """Ended sequences' contexts whose slots are about to leave the cache (squeezed out, or the cache emptied),
    their entries copied out of it (`CausalLM.entries`), up to `budget` bytes for each tenant, its least recently
    saved or taken dropped first (a tenant pushes out only its own): a conversation's next turn finds its earlier
    turns here however busy the batch was meanwhile, and costs the batch nothing until then (kept in the cache, they
    would widen every step's attention). A context that begins as a newer one of its tenant holds all of is dropped
    for it."""

    def __init__(self, budget: int):
        self.budget = budget
        self.held: list[Held] = []  # (slots: Entries), the most recently saved or taken last
        self._token_bytes = 0  # what a token's entries take, once known (a context over the budget is not copied)

    def save(self, target, held: Held) -> None:
        n, tenant = len(held.slots), held.tenant
        if not self.budget or not n or n * self._token_bytes > self.budget:
            return
        self.held = [h for h in self.held if h.tenant != tenant or len(h.slots) > n
                     or common_prefix(h.context, held.context, len(h.slots)) < len(h.slots)]
        assert isinstance(held.slots, torch.Tensor)  # (slots of the cache, not yet copied)
        self.held.append(Held(tenant, held.context[:n], entries := target.entries(held.slots)))
        self._token_bytes = entries.nbytes // n
        mine = [h for h in self.held if h.tenant == tenant]
        while sum(h.slots.nbytes for h in mine) > self.budget:
            dropped = mine.pop(0)
            self.held = [h for h in self.held if h is not dropped]

    @property
    def nbytes(self) -> int:
        return sum(h.slots.nbytes for h in self.held)

    def taken(self, entries: Entries) -> None:
        """The copy `entries` was taken a prefix of: the last to drop."""
        self.held = [h for h in self.held if h.slots is not entries] + [h for h in self.held if h.slots is entries]


def forward_inputs(slots: list[Slots], pending: list[list[int]], drafts: list[Draft], stepping: list[bool]):
    """Per sequence in the forward (its `slots` so far): the tokens fed (its pending context tokens, then its draft),
    their positions, its span (offset, n, the draft's own mask [n, n]), and the rows of logits it verifies on, if it
    steps."""
    fed: list[torch.Tensor] = []
    positions, spans, rows = [], [], []
    for s, p, draft, steps in zip(slots, pending, drafts, stepping):
        offset, n = sum(len(f) for f in fed), len(p) + len(draft)
        position, local = draft_inputs(draft, len(p), len(s) + len(p))  # [n], [n, n]
        fed.append(torch.cat([torch.tensor(p, dtype=torch.long, device="cpu"), draft.tokens.cpu()]))  # host drafts
        positions.append(position)
        spans.append((offset, n, local))
        if steps:  # from the last context token's on
            rows.append(torch.arange(offset + len(p) - 1, offset + n, device="cpu"))
    return fed, positions, spans, rows


def attention_inputs(slots: list[Slots], spans: list[tuple[int, int, torch.Tensor]], positions: list[torch.Tensor],
                     drafts: list[Draft], cached: int, alone: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The forward's tree mask and positions: for a sequence `alone` in the forward and the cache, what the
    single-sequence engine passes (none for a chain, the tree's own mask and positions for a tree); for several, the
    full mask over the cache (each sequence its own slots) and the fed tokens (each its own draft's mask)."""
    if alone:
        return (spans[0][2], positions[0]) if drafts[0].is_tree else (None, None)
    total = sum(n for _, n, _ in spans)
    tree_mask = torch.zeros(total, cached + total, dtype=torch.bool, device="cpu")  # the forward moves it
    for s, (offset, n, local) in zip(slots, spans):
        if len(s):
            tree_mask[offset : offset + n, s.tensor] = True
        tree_mask[offset : offset + n, cached + offset : cached + offset + n] = local
    return tree_mask, torch.cat(positions)
