"""Log-probabilities as OpenAI's two endpoints write them: the chat's `{"content": [{"token", "logprob", "bytes",
"top_logprobs"}]}` and the completions' `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (with echo,
the prompt's tokens first, the first of them scored by nothing: null). The figures are the engine's
(`engine.logprobs`): the target's raw log-softmax at each token's position. A token's text is its own decoding,
so a character split over tokens shows as replacement characters in each (its `bytes` say which, as OpenAI's)."""

from __future__ import annotations

import codecs
import functools
import re
from collections.abc import Sequence

from specdecode.types import TokenLogprob

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece


class TokenTexts:
    """Each token id's own text (`tokenizer.decode([id])`) and bytes (`token_bytes`), remembered."""

    def __init__(self, tokenizer):
        self.text = functools.lru_cache(maxsize=65536)(lambda token: tokenizer.decode([token]))
        self.bytes = functools.lru_cache(maxsize=65536)(lambda token: token_bytes(tokenizer, token, self.text(token)))


def token_bytes(tokenizer, token: int, text: str) -> list[int]:
    """The bytes a token stands for: its text's, but where its text holds a replacement character (the token is part
    of a character), its vocabulary piece's: a SentencePiece byte piece `<0xNN>`, or a byte-level BPE's piece read
    back through its byte alphabet (GPT-2's, which Qwen's and Llama 3's tokenizers use)."""
    if "\ufffd" not in text:
        return list(text.encode("utf-8"))
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        if match := BYTE_PIECE.fullmatch(piece):
            return [int(match[1], 16)]
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if type(decoder).__name__ == "ByteLevel" and all(c in _byte_alphabet() for c in piece):
            return [_byte_alphabet()[c] for c in piece]
    return list(text.encode("utf-8"))


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """A byte-level BPE's character for each byte, read back: character -> byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {character: byte for byte, character in bytes_to_unicode().items()}


def chat_entries(entries: list[TokenLogprob], texts: TokenTexts) -> dict:
    """`choices[0].logprobs` of a chat answer, or of a streamed chunk's tokens."""

    def one(token: int, logprob: float) -> dict:
        return {"token": texts.text(token), "logprob": logprob, "bytes": texts.bytes(token)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries],
            "refusal": None}


class Offsets:
    """Where each token's text starts in a completion's text (`text_offset`), token after token: at the characters
    its earlier tokens' bytes complete, so that the tokens of one character all start where it does, whether the
    answer comes whole or streamed."""

    def __init__(self, texts: TokenTexts, start: int = 0):
        self.texts, self.at = texts, start
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # (invalid bytes read as the tokenizer's do)

    def take(self, token: int) -> int:
        """The next token's offset: where the text stands, past the replacement character of a held byte sequence
        that the token's bytes do not go on with (it ends there, invalid, before the token's text)."""
        held = bool(self._utf8.getstate()[0])
        out = self._utf8.decode(bytes(self.texts.bytes(token)))
        here = self.at + (1 if held and out.startswith("\ufffd") else 0)
        self.at += len(out)
        return here


def completion_entries(entries: Sequence[TokenLogprob | None], tokens: list[int], offsets: Offsets) -> dict:
    """`choices[0].logprobs` of a completion: `tokens` are the ids the entries stand for (an entry None: an unscored
    first prompt token); `offsets`: where the choice's text stands before the first of them (and the token texts).
    Each position's `top_logprobs` holds the likeliest tokens and the token itself (as vLLM's: logprobs=0 still names
    it)."""
    texts = offsets.texts
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        text = texts.text(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry.logprob)
        out["top_logprobs"].append(None if entry is None else _by_text(entry, text, texts))
        out["text_offset"].append(offsets.take(token))
    return out


def _by_text(entry: TokenLogprob, text: str, texts: TokenTexts) -> dict[str, float]:
    """A completion's `top_logprobs` at one position, keyed by text as OpenAI's: where several tokens read the same
    (byte tokens of a split character all read U+FFFD) the likeliest's figure, and the token's own at its text."""
    top: dict[str, float] = {}
    for token, value in sorted(entry.top, key=lambda pair: -pair[1]):
        top.setdefault(texts.text(token), value)
    top[text] = entry.logprob
    return top
