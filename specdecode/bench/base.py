"""What every runner of the benchmark is, ours, a peer's or an engine's over HTTP: a name, whether its output
must equal plain decoding, and a function from prompt ids (or, for an engine that templates the conversation
itself, the chat messages) to an `Output`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specdecode.bench.engine_stats import ServerStats
from specdecode.engine import GenerationConfig
from specdecode.types import StepStats


@dataclass
class Output:
    token_ids: list[int]
    seconds: float
    steps: list[StepStats] | None  # None for peers, whose loop we cannot see into
    prefill_seconds: float | None = None  # until the first new token (None: not known)
    # an engine over HTTP: its answer as sent, the new tokens as it counted them (`usage`; token_ids may
    # then be empty: an engine that streams text only), and the speculative figures it reports
    text: str | None = None
    new_tokens: int | None = None  # None: len(token_ids)
    server: ServerStats | None = None
    prompt_tokens: int | None = None  # the prompt as the engine counted it (a check that it saw ours)


@dataclass(frozen=True)
class Runner:
    name: str
    lossless: bool
    peer: bool  # not ours: transformers' generate() or llama.cpp's own
    run: Callable[[list[int], GenerationConfig], Output]
    forget: Callable[[], None] = lambda: None  # drop what the method learnt from earlier prompts
    max_context: int | None = None  # positions its model holds, when not the target's (a llama.cpp context)
    # an engine that applies its own chat template: called with the conversation (and the tools an agentic task
    # offers, OpenAI's definitions) instead of `run`
    chat: Callable[[list[dict], GenerationConfig, tuple[dict, ...]], Output] | None = None
