"""What every runner of the benchmark is, ours or a peer's: a name, whether its output must equal plain
decoding, and a function from prompt ids to an `Output`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specdecode.engine import GenerationConfig
from specdecode.types import StepStats


@dataclass
class Output:
    token_ids: list[int]
    seconds: float
    steps: list[StepStats] | None  # None for peers, whose loop we cannot see into
    prefill_seconds: float | None = None  # until the first new token (None: not known)


@dataclass(frozen=True)
class Runner:
    name: str
    lossless: bool
    peer: bool  # not ours: transformers' generate() or llama.cpp's own
    run: Callable[[list[int], GenerationConfig], Output]
    forget: Callable[[], None] = lambda: None  # drop what the method learnt from earlier prompts
    max_context: int | None = None  # positions its model holds, when not the target's (a llama.cpp context)
