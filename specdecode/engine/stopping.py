"""Stop strings over streamed token ids, and text deltas that never split a character."""

from __future__ import annotations

import math
from collections.abc import Sequence


class TextTracker:
    """Decodes the generated ids incrementally and watches for stop strings.

    Tokenizers decode an incomplete UTF-8 sequence as U+FFFD; such a tail is held back until the next
    token completes it (or the generation ends), and so is an end of the text that a stop string begins with, until
    the text shows it is not the stop string (a client never sees a stop string's beginning the output then lacks).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), min_tokens: int = 0, stop_token_ids: Sequence[int] = ()):
        """`min_tokens`: a stop string counts only once a token at that position or later completes it (vLLM's);
        `stop_token_ids`: one of these ending the output is left out of its text (vLLM's, with its default
        `include_stop_str_in_output` false; the token stays in the output's ids)."""
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.stop_ids = frozenset(stop_token_ids)
        self.min_tokens = min_tokens
        self._after: float | None = 0.0 if min_tokens <= 1 else None  # a stop string must end past this much text
        self.text = ""  # the text emitted so far
        self._joins = joins(tokenizer)
        self._settled: tuple[int, int | None, str] = (0, None, "")  # ids up to a character's end, the last, their text

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _text_of(self, ids: Sequence[int]) -> str:
        """`decode(ids)` of a growing output: where the tokenizer's decoding joins (`joins`), the text of the ids
        settled at an earlier step (they ended at a character's end) and the decoding of the rest, so that a step
        decodes its new ids (and any held back with an incomplete character), not the whole output again."""
        count, last, text = self._settled
        if not self._joins or count > len(ids) or (count and ids[count - 1] != last):  # (not the output settled)
            count, text = 0, ""
        text += self.decode(ids[count:])
        if self._joins and ids and not text.endswith("\ufffd"):
            self._settled = (len(ids), ids[-1], text)
        return text

    def _shown(self, ids: Sequence[int]) -> Sequence[int]:
        """The ids whose text the output shows: all, but a stop token id that ends them (it ends the output)."""
        return ids[:-1] if ids and ids[-1] in self.stop_ids else ids

    def _stop_begun(self, text: str) -> int:
        """The length of the longest end of `text` that a stop string begins with (0: none); each stop string's
        ends tried longest first, down to the longest found so far."""
        longest = 0
        for stop in self.stop:
            longest = next((n for n in range(min(len(stop) - 1, len(text)), longest, -1)
                            if stop.startswith(text[len(text) - n :])), longest)
        return longest

    def _first_stop(self, text: str, after: float = 0.0) -> int | None:
        """Where the first stop string that ends past `after` characters begins (None: none)."""
        if after == math.inf:
            return None
        hits = [i for i in (text.find(s, max(0, int(after) - len(s) + 1)) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self, ids: Sequence[int]) -> float:
        """The text a stop string must end past: that of the output's first min_tokens - 1 tokens, once there are
        as many (before: all of it)."""
        if self._after is None and len(ids) >= self.min_tokens - 1:
            self._after = float(len(self.decode(ids[: self.min_tokens - 1]).rstrip("\ufffd")))
        return math.inf if self._after is None else self._after

    def update(self, ids: Sequence[int], previous: int) -> tuple[str, int | None]:
        """ids: every generated id so far; previous: how many of them the earlier calls saw.

        Returns the new text and, when a stop string appeared, how many ids to keep (up to the id that
        completes the stop string); the text then ends right before the stop string.
        """
        ids = self._shown(ids)
        full = self._text_of(ids)
        keep = None
        after = self._held(ids) if self.stop else 0.0
        cut = self._first_stop(full, after) if self.stop else None
        if cut is not None:
            keep = next(
                (n for n in range(previous + 1, len(ids)) if self._first_stop(self.decode(ids[:n]), after) is not None),
                len(ids),
            )
            full = full[:cut]
        else:  # held back: an incomplete character, and an end a stop string may begin with (not output if it does)
            full = full.rstrip("\ufffd")
            full = full[: len(full) - self._stop_begun(full)]
        delta = full[len(self.text) :]
        self.text = full if len(full) > len(self.text) else self.text
        return delta, keep

    def finish(self, ids: Sequence[int]) -> str:
        """The text not yet emitted once generation has ended (a held-back tail)."""
        ids = self._shown(ids)
        full = self.decode(ids)
        cut = self._first_stop(full, self._held(ids)) if self.stop else None
        full = full if cut is None else full[:cut]
        delta = full[len(self.text) :]
        self.text = full
        return delta


def joins(tokenizer) -> bool:
    """Whether the tokenizer decodes ids as the decodings of any two parts of them joined, wherever the first part's
    bytes end a character: a byte-level decoder (GPT-2's, Qwen's, Llama 3's: every token's bytes joined, then read as
    UTF-8) with no clean-up of spaces afterwards. Others are decoded whole each time."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel" and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
