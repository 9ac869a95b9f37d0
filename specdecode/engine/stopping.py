"""Stop strings over streamed token ids, and text deltas that never split a character."""

from __future__ import annotations

from collections.abc import Sequence


class TextTracker:
    """Decodes the generated ids incrementally and watches for stop strings.

    Tokenizers decode an incomplete UTF-8 sequence as U+FFFD; such a tail is held back until the next
    token completes it (or the generation ends).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.text = ""  # the text emitted so far

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def update(self, ids: Sequence[int], previous: int) -> tuple[str, int | None]:
        """ids: every generated id so far; previous: how many of them the earlier calls saw.

        Returns the new text and, when a stop string appeared, how many ids to keep (up to the id that
        completes the stop string); the text then ends right before the stop string.
        """
        full = self.decode(ids)
        keep = None
        cut = self._first_stop(full) if self.stop else None
        if cut is not None:
            keep = next(
                (n for n in range(previous + 1, len(ids)) if self._first_stop(self.decode(ids[:n])) is not None),
                len(ids),
            )
            full = full[:cut]
        else:
            full = full.rstrip("\ufffd")
        delta = full[len(self.text) :]
        self.text = full if len(full) > len(self.text) else self.text
        return delta, keep

    def finish(self, ids: Sequence[int]) -> str:
        """The text not yet emitted once generation has ended (a held-back tail)."""
        full = self.decode(ids)
        cut = self._first_stop(full) if self.stop else None
        full = full if cut is None else full[:cut]
        delta = full[len(self.text) :]
        self.text = full
        return delta
