"""The registry of decoding methods: a name, what it needs, and how to build its drafter.

The CLI, the Python API and the benchmark all enumerate this one table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specdecode.drafters.base import Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.errors import UserError
from specdecode.models.base import CausalLM


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    needs_draft_model: bool
    build: Callable[[CausalLM, CausalLM | None], Drafter | None]  # (target, draft model) -> drafter
    lossless: bool = True


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("ar", "plain autoregressive decoding (the baseline)", False, lambda target, draft: None),
        Method(
            "draft",
            "an independent draft model drafts a chain, adaptive length",
            True,
            lambda target, draft: DraftModelDrafter(
                draft, draft_cost=draft.weights_per_token / target.weights_per_token
            ),
        ),
        Method("pld", "prompt lookup: copy what followed the last n-gram earlier", False, lambda target, draft: PromptLookupDrafter()),
    ]
}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise UserError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}") from None
