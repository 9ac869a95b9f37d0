"""A draft model with another tokenizer than the target's: its drafts travel to the target as text.

Universal assisted generation (transformers) and the string-level exact match of Timor et al. (2025,
"lossless speculative decoding algorithms for heterogeneous vocabularies"), as one step:

1. The context (target token ids) is decoded to text and encoded with the draft tokenizer. The draft
   model's KV cache is cropped to the longest prefix it shares with those ids (`SyncedCache`), so only
   the tail that changed is fed, not the whole context again.
2. The draft model drafts greedily, its length adapted as `DraftModelDrafter` adapts it.
3. The draft tokens are decoded to text and translated to target tokens (`translate`): the text is cut
   before an incomplete character, re-encoded by the target tokenizer together with the text of the
   context's last few tokens, and only the tokens after the point where that text ends are kept. When a
   token straddles that point (the context's last token would merge with the new text) nothing is
   proposed; the last translated token is dropped (more text could merge with it), unless the draft
   model ended the text with its end-of-sequence token.

Lossless under greedy decoding and sampling alike: the translated tokens go to the verifier without
probabilities, as a one-hot draft (the glossary's deterministic drafter). Speculative sampling with a
one-hot proposal x accepts x with probability target(x) and otherwise samples from the target with x
removed and renormalised (`verify.chain.residual_distribution` of a one-hot row), so every output token
follows the target's distribution exactly whatever was proposed; greedy decoding keeps the prefix that
matches the target's argmax. This is the simple lossless route for vocabularies that differ: the draft
model's own distribution is not used (drafting greedily maximises the chance of a one-hot acceptance).
"""

from __future__ import annotations

import torch

from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.models.base import CausalLM
from specdecode.models.costs import CostCurve
from specdecode.types import Draft, SamplingParams

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character
MIN_WINDOW, MAX_WINDOW = 4, 12  # the context's last tokens re-encoded with the draft's text
DRAFT_WINDOW = 8  # the draft context's last tokens decoded with the draft tokens, for the right spacing


def whole_characters(text: str) -> str:
    """`text` up to its first replacement character: the bytes from there on do not make a whole
    character (a byte-level piece of one), so no target token of them is certain."""
    cut = text.find(REPLACEMENT)
    return text if cut < 0 else text[:cut]


def added_text(tokenizer, before: list[int], new: list[int]) -> str:
    """The text that the tokens `new` add after the tokens `before`, decoded together so that spacing
    and characters split across the two come out as in the whole; "" when decoding `new` changes the
    text of `before` (its last character was incomplete)."""
    head = tokenizer.decode(before, skip_special_tokens=True)
    whole = tokenizer.decode(before + new, skip_special_tokens=True)
    return whole[len(head):] if whole.startswith(head) else ""


def context_window(tokenizer, context: list[int]) -> list[int] | None:
    """The context's last MIN_WINDOW (or up to MAX_WINDOW) tokens, starting at a whole character; None
    when the context ends with an incomplete character (the target must finish it first) or no window
    starts at a whole character."""
    for size in range(min(MIN_WINDOW, len(context)), min(MAX_WINDOW, len(context)) + 1):
        window = context[-size:]
        text = tokenizer.decode(window)
        if text.endswith(REPLACEMENT):
            return None
        if text and not text.startswith(REPLACEMENT):
            return window
    return None


def translate(tokenizer, window: list[int], text: str, final: bool = False) -> list[int]:
    """The target tokens of `text` that are certain to follow a context ending with the tokens `window`.

    `window` and `text` are encoded together (the context's end may change how the text tokenizes), and
    the tokens after the prefix that decodes to exactly the window's text are kept: none when no prefix
    does (a token straddles the boundary: the context's last token would merge with the text). The text
    is cut before an incomplete character first, and the last token is dropped unless `final` (the text
    ends there): more text could merge with it.
    """
    text = whole_characters(text)
    if not text:
        return []
    head = tokenizer.decode(window)
    ids = tokenizer.encode(head + text, add_special_tokens=False)
    start = next((j for j in range(len(ids) + 1) if tokenizer.decode(ids[:j]) == head), None)
    if start is None:
        return []
    tokens = ids[start:]
    return tokens if final else tokens[:-1]


class OtherTokenizerDrafter(DraftModelDrafter):
    """Drafts with a model whose tokenizer differs from the target's, through text (see the module).

    Adaptive draft length as in `DraftModelDrafter`, counted in draft tokens; at least two, since the
    last translated token is dropped. The drafts carry no probabilities (one-hot), so the verifier
    stays exact under sampling."""

    name = "draft"

    def __init__(
        self,
        model: CausalLM,
        target_tokenizer,
        draft_tokenizer,
        num_tokens: int = 5,
        min_tokens: int = 2,
        max_tokens: int = 16,
        draft_cost: float = 0.4,
        curve: CostCurve | None = None,
        **options,
    ):
        super().__init__(model, num_tokens=num_tokens, min_tokens=min_tokens, max_tokens=max_tokens,
                         draft_cost=draft_cost, curve=curve, **options)
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.target_eos = target_tokenizer.eos_token_id  # proposed after a draft that ends its text

    def draft_ids(self, context: list[int]) -> list[int]:
        """The context in draft tokens: its text (special tokens left out) in the draft tokenizer, after
        the draft's beginning-of-sequence token if it has one."""
        text = self.target_tokenizer.decode(context, skip_special_tokens=True)
        bos = self.draft_tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + self.draft_tokenizer.encode(text, add_special_tokens=False)

    def propose(self, context, max_tokens, params, generator) -> Draft:
        length = min(self._length(), max_tokens + 1)  # the last translated token is dropped
        if not self._ready(context, max_tokens):
            return Draft.empty()
        window = context_window(self.target_tokenizer, context) if length >= 2 else None
        draft_context = self.draft_ids(context) if window is not None else []
        if window is None or not draft_context:
            return Draft.empty()
        # 1. the draft model, in step with the context, drafts greedily in its own tokens
        drafted, _ = self._draft(self._cache.sync(draft_context), length, SamplingParams(), None)
        ends = [i for i, token in enumerate(drafted) if token in self.model.eos_token_ids]
        drafted = drafted[: ends[0]] if ends else drafted
        # 2. its text, in the target's tokens that are certain after the context
        text = added_text(self.draft_tokenizer, draft_context[-DRAFT_WINDOW:], drafted)
        final = bool(ends) and self.target_eos is not None and REPLACEMENT not in text  # the text ends there
        tokens = translate(self.target_tokenizer, window, text, final=final) + ([self.target_eos] if final else [])
        return Draft(tokens=torch.tensor(tokens[:max_tokens], dtype=torch.long, device="cpu"))
