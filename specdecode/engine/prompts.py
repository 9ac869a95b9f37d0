"""A prompt's way into the target's cache before its first step, whichever engine feeds it: the checks
(`check_prompt`), the chunks a long prompt is fed in (`prefill_spans`, `prefill`) and what each chunk reports
(`Prefilled`)."""

from __future__ import annotations

import operator
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from specdecode.engine import logprobs
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.types import TokenLogprob


@dataclass(frozen=True)
class Prefilled:
    """A chunk of a prompt's prefill fed (`prefill`): `fed` of the prompt's `total` tokens are in the cache."""

    fed: int
    total: int


def token_ids(prompt: Any) -> list[int]:
    """A prompt as a list of token ids (Python's, numpy's or a tensor's integers; a tensor of one row too); a
    UserError for anything else, saying what it is (text, several prompts, numbers that are not ids)."""
    if isinstance(prompt, str | bytes):
        raise UserError("the prompt is token ids here: encode a text first (`models.encode(text)`)")
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:  # (a tokenizer's `return_tensors="pt"`)
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise UserError(f"the prompt is one row of token ids, got a tensor of shape {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    try:
        items = list(prompt)
    except TypeError:
        raise UserError(f"the prompt is a list of token ids, not {type(prompt).__name__}") from None
    ids = []
    for item in items:
        try:
            if isinstance(item, bool):
                raise TypeError
            ids.append(operator.index(item))
        except (TypeError, RuntimeError):  # (a tensor of several numbers: RuntimeError)
            if isinstance(item, list | tuple | torch.Tensor | str):
                raise UserError("the prompt is one text or one list of token ids, not several "
                                "(engine.batch.BatchEngine decodes several prompts at once)") from None
            raise UserError(f"token ids are whole numbers, got {item!r}") from None
    return ids


def check_prompt(target: CausalLM, prompt: Any) -> list[int]:
    """The prompt's token ids (`token_ids`), or a UserError for a prompt the target cannot take."""
    prompt_ids = token_ids(prompt)
    if not prompt_ids:
        raise UserError("the prompt is empty")
    if len(prompt_ids) >= target.max_context:
        why = (f" (its layers attend to a window of {target.max_context} tokens, and a sequence is kept within it)"
               if getattr(target, "window", None) == target.max_context else "")
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; the model's context holds {target.max_context}{why}")
    bad = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
    if bad:
        raise UserError(f"token ids out of the vocabulary (size {target.vocab_size}): {bad[:5]}")
    return prompt_ids


def prefill_spans(prompt_length: int, chunk: int) -> list[tuple[int, int]]:
    """The spans [start, end) of a prompt fed before its first step, `chunk` tokens each from its start; the
    last 1 to `chunk` tokens are left to the first step, which feeds them with its draft."""
    return [(start, start + chunk) for start in range(0, prompt_length - chunk, chunk)]


def prefill(target: CausalLM, prompt_ids: list[int], chunk: int, hidden: bool | tuple[int, ...] = False,
            scored: list[TokenLogprob] | None = None, top: int = 0) -> Generator[Prefilled, None, list[torch.Tensor]]:
    """Feed a prompt but its last chunk into the target's empty cache, one chunk a forward (`prefill_spans`),
    yielding after each. Returns the chunks' hidden states [chunk, d] when asked (`CausalLM.forward`'s
    `output_hidden`), for a drafter that reads them (`after_prefill`). With `scored` (a list; echo): the prompt
    is fed but its last token, and each fed token's row scores the token after it, appended to `scored` with
    `top` alternatives (`engine.logprobs.of_prompt`), so that every prompt token but the first gets its entry."""
    pieces = []
    last = len(prompt_ids) - 1
    spans = prefill_spans(len(prompt_ids), chunk) if scored is None else [
        (start, min(start + chunk, last)) for start in range(0, last, chunk)]
    for start, end in spans:
        # (without `scored`, one row of logits, unused: every backend computes at least one)
        out = target.forward(torch.tensor(prompt_ids[start:end], device="cpu"),
                             num_logits=1 if scored is None else end - start, output_hidden=hidden)
        if scored is not None:
            scored.extend(logprobs.of_prompt(out.logits, prompt_ids[start + 1 : end + 1], top))
        if out.hidden is not None:  # asked for
            pieces.append(out.hidden)
        yield Prefilled(end, len(prompt_ids))
    return pieces
