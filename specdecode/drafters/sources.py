"""What a composite drafter's sources are (`drafters.composite`): a drafter and its cost class, and how the
target's hidden states the forward returns are shared among the sources (and a batch's sequences) that read them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from specdecode.drafters.base import Drafter
from specdecode.errors import UserError

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM

CostClass = Literal["free", "expensive"]
COST_CLASSES = ("free", "expensive")


@dataclass(frozen=True)
class Source:
    """A drafter the composite asks, and its cost class (see the module docstring)."""

    drafter: Drafter
    cost: CostClass = "free"

    def __post_init__(self) -> None:
        if self.cost not in COST_CLASSES:
            raise UserError(f"a source's cost class is one of {COST_CLASSES}, got {self.cost!r}")


Hidden = bool | tuple[int, ...]  # what a drafter asks of the target's hidden states (`Needs.hidden`)


def hidden_request(needs: Sequence[Hidden], final_layer: int | None) -> tuple[Hidden, list[list[int] | None]]:
    """(what to ask the target's forward for, each source's blocks of it) given each source's `Needs.hidden`.
    All asking for the final-norm state (True): True, and each its one block. Otherwise a tuple of layers, the
    final-norm state as `final_layer` (the target's layer count), each source's layers as indices into it.
    [True, (2, 5)], final_layer 8 -> ((8, 2, 5), [[0], [1, 2]])"""
    asked = [need for need in needs if need]
    if not asked:
        return False, [None] * len(needs)
    if all(need is True for need in asked):
        return True, [[0] if need else None for need in needs]
    if final_layer is None:
        raise ValueError("sources asking for the final-norm state beside layer inputs need the target's layer count")
    own = [(final_layer,) if need is True else need if need else () for need in needs]
    layers: list[int] = []
    for wanted in own:
        layers += [layer for layer in wanted if layer not in layers]
    return tuple(layers), [[layers.index(layer) for layer in wanted] if wanted else None for wanted in own]


def columns(hidden: torch.Tensor, blocks: list[int], count: int) -> torch.Tensor:
    """A source's blocks of the hidden states asked for, `count` blocks side by side:
    [n, count * d] -> [n, len(blocks) * d]."""
    if count == 1 or blocks == list(range(count)):
        return hidden
    rows = hidden.shape[0]
    return hidden.view(rows, count, -1)[:, blocks].reshape(rows, -1)


class HiddenRequest:
    """The hidden states a batch's forward asks for (`CausalLM.forward`'s `output_hidden`): what the engine keeps
    for its caller (`keep_hidden`) and what each sequence's drafter reads (`Needs.hidden`), as one request
    (`hidden_request`); `columns` gives each of them its own."""

    def __init__(self, keep: bool | tuple[int, ...], needs: list[bool | tuple[int, ...]], last: int | None):
        self.request, self._blocks = hidden_request([keep, *needs], last)
        self._count = 1 if self.request is True else len(self.request or ())

    def columns(self, hidden: torch.Tensor, who: int) -> torch.Tensor | None:
        """[n, d * asked] -> who's columns (0: the caller's, i + 1: the i-th sequence's drafter's; None: none)."""
        blocks = self._blocks[who]
        return None if blocks is None else columns(hidden, blocks, self._count)


def final_layer(target: CausalLM) -> int | None:
    """The index of the target's final-norm state among its layers' (`hidden_request`), if known."""
    config = getattr(getattr(target, "model", None), "config", None)
    return getattr(config, "num_hidden_layers", None)
