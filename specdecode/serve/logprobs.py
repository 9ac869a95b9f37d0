"""Log-probabilities as OpenAI's two endpoints write them: the chat's `{"content": [{"token", "logprob", "bytes",
"top_logprobs"}]}` and the completions' `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (with echo,
the prompt's tokens first, the first of them scored by nothing: null). The figures are the engine's
(`engine.logprobs`): the target's raw log-softmax at each token's position. A token's text is its own decoding,
so a character split over tokens shows as replacement characters in each (its `bytes` say which, as OpenAI's)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from specdecode.types import TokenLogprob


class TokenTexts:
    """Each token id's own text (`tokenizer.decode([id])`), remembered."""

    def __init__(self, tokenizer):
        self.text = lru_cache(maxsize=65536)(lambda token: tokenizer.decode([token]))


def chat_entries(entries: list[TokenLogprob], texts: TokenTexts) -> dict:
    """`choices[0].logprobs` of a chat answer, or of a streamed chunk's tokens."""

    def one(token: int, logprob: float) -> dict:
        text = texts.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries],
            "refusal": None}


def completion_entries(entries: Sequence[TokenLogprob | None], tokens: list[int], texts: TokenTexts,
                       offset: int = 0) -> dict:
    """`choices[0].logprobs` of a completion: `tokens` are the ids the entries stand for (an entry None: an unscored
    first prompt token); `offset`: where the first token's text starts in the choice's whole text. Each position's
    `top_logprobs` holds the likeliest tokens and the token itself (as vLLM's: logprobs=0 still names it)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        text = texts.text(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry.logprob)
        out["top_logprobs"].append(None if entry is None else {**{texts.text(t): v for t, v in entry.top},
                                                                text: entry.logprob})
        out["text_offset"].append(offset)
        offset += len(text)
    return out
