"""Prompt lookup: copy what followed an earlier occurrence of the context's last n-gram.

No model, no cost to speak of: when the output repeats the prompt (code edits, quoting, summaries of a
given text) whole spans are accepted at once; when nothing matches, the step is plain decoding.
"""

from __future__ import annotations

import numpy as np
import torch

from specdecode.drafters.base import Drafter
from specdecode.errors import UserError
from specdecode.types import Draft, SamplingParams


def find_continuation(context: np.ndarray, ngram: int, max_tokens: int) -> np.ndarray | None:
    """Tokens that followed the most recent earlier occurrence of the last `ngram` tokens of `context`.

    context: [length] int64. Returns at most max_tokens ids, or None when the n-gram never occurred before.
    """
    length = context.shape[0]
    if length <= ngram:
        return None
    tail = context[length - ngram :]
    # windows[i] = context[i : i + ngram] for every start i whose window ends before the tail begins
    windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], ngram)  # [length - ngram, ngram]
    starts = np.flatnonzero((windows == tail).all(axis=1))
    if starts.size == 0:
        return None
    begin = int(starts[-1]) + ngram  # the most recent occurrence: the likeliest to continue the same way
    return context[begin : begin + max_tokens]


class PromptLookupDrafter(Drafter):
    """Drafts by n-gram matching over the prompt and the output so far (longest n-gram first)."""

    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 10):
        if not 1 <= min_ngram <= max_ngram:
            raise UserError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_tokens < 1:
            raise UserError(f"prompt lookup needs num_tokens >= 1, got {num_tokens}")
        self.max_ngram, self.min_ngram, self.num_tokens = max_ngram, min_ngram, num_tokens

    def propose(self, context, max_tokens, params, generator) -> Draft:
        limit = min(self.num_tokens, max_tokens)
        if limit > 0:
            ids = np.asarray(context, dtype=np.int64)
            for ngram in range(self.max_ngram, self.min_ngram - 1, -1):
                found = find_continuation(ids, ngram, limit)
                if found is not None and found.size:
                    return Draft(tokens=torch.from_numpy(found.copy()))
        return Draft.empty()
