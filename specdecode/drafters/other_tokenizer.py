"""A draft model with another tokenizer than the target's: its drafts travel to the target as text.

Universal assisted generation (transformers) and the string-level exact match of Timor et al. (2025,
"lossless speculative decoding algorithms for heterogeneous vocabularies"), as one step:

1. The context (target token ids) is decoded to text and encoded with the draft tokenizer, its end only
   (`Retokenizer`: each step decodes the new target tokens after a few they follow, and encodes the text
   after the last point where the draft tokenizer is known to split it), so a step's work does not grow
   with the context. The draft model's KV cache is cropped to the longest prefix it shares with those ids
   (`SyncedCache`), so only the tail that changed is fed, not the whole context again.
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
DECODE_WINDOW = 8  # the settled context tokens decoded with the new ones, for the right spacing
MAX_REFUSED = 3  # anchors refused in a row after which a sequence's text is encoded from the last one kept
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


class Retokenizer:
    """The context's text in the draft tokenizer's ids, kept in step as the context grows, with a step's work
    bounded by what changed: `draft_ids` of the whole context, without decoding or encoding it whole.

    Decoding: the *settled* context tokens (those whose text ends with a whole character) keep their text; the
    tokens after them are decoded after the last DECODE_WINDOW settled ones, and what that adds to those ones'
    own text is appended (as `added_text`), so spacing and characters split across tokens come out as in the
    whole. Where that is not a plain addition (a decoder that rewrites earlier text) the context is decoded whole.

    Encoding: the text is encoded from an *anchor* on: a character offset where the draft tokenizer splits the
    text whatever follows, whose ids before it are kept. An anchor is a single space between two non-space
    characters, the second settled: pre-tokenizers that split at whitespace (byte-level BPE's patterns, where a
    space only ever begins a pre-token; Metaspace; WordPiece's) start a pre-token there, and the ones after it
    depend only on the text after it. An anchor moves forward only where the tail encoded in two pieces split there
    gives the same ids as encoded whole, which refuses it for a tokenizer that does not split there (one that
    prepends a space marker to every text it encodes, say): after MAX_REFUSED refusals in a row its text is
    encoded from the last anchor kept (from the start, at worst, as every step did before). A text without such
    spaces (Chinese, say) keeps its anchor where the last one was. `decoded` and `encoded` count the tokens
    decoded and characters encoded (tests check that a step's work stays bounded)."""

    def __init__(self, source_tokenizer, draft_tokenizer):
        self.source, self.draft = source_tokenizer, draft_tokenizer
        self.decoded = self.encoded = 0
        self.reset()

    def reset(self) -> None:
        """A new context: nothing kept."""
        self.settled: list[int] = []  # the context tokens whose text is kept
        self.text = ""  # their text
        self.anchor = 0  # a character offset in `text` where the draft tokenizer splits it
        self.before: list[int] = []  # the draft ids of text[:anchor]
        self.refused = 0  # anchors refused in a row (MAX_REFUSED: the tokenizer is taken not to split there)

    def __call__(self, context: list[int]) -> list[int]:
        """The draft tokenizer's ids of the context's text (special tokens left out): `draft_ids` without the
        beginning-of-sequence token."""
        text = self._text(context)
        tail = self._encode(text[self.anchor :])
        start = self._next_anchor() if self.refused < MAX_REFUSED else None
        if start is not None:
            left, right = self._encode(text[self.anchor : start]), self._encode(text[start:])
            if left + right == tail:  # the draft tokenizer splits there
                self.before += left
                self.anchor, self.refused = start, 0
                tail = right
            else:
                self.refused += 1
        return self.before + tail

    def _decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.source.decode(ids, skip_special_tokens=True)

    def _encode(self, text: str) -> list[int]:
        self.encoded += len(text)
        return self.draft.encode(text, add_special_tokens=False)

    def _text(self, context: list[int]) -> str:
        """The text of `context`, settling its tokens where it ends with a whole character."""
        n = len(self.settled)
        text = None
        if n and len(context) >= n and context[:n] == self.settled:
            window = self.settled[-DECODE_WINDOW:]
            head, joined = self._decode(window), self._decode(window + context[n:])
            text = self.text + joined[len(head) :] if joined.startswith(head) else None
        if text is None:  # another context, or a decoder that rewrote the settled text: decoded whole
            self.reset()
            text = self._decode(context)
        if not text.endswith(REPLACEMENT):
            self.settled += context[len(self.settled) :]
            self.text = text
        return text

    def _next_anchor(self) -> int | None:
        """The last offset past the anchor where the draft tokenizer is taken to split the settled text: a single
        space between two non-space characters (the class docstring), or None."""
        text, end = self.text, len(self.text) - 1  # the space's next character must be settled
        while (space := text.rfind(" ", self.anchor + 1, end)) > 0:
            if not text[space - 1].isspace() and not text[space + 1].isspace():
                return space
            end = space
        return None


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
        draft_cost: float | None = None,
        curve: CostCurve | None = None,
        **options,
    ):
        super().__init__(model, num_tokens=num_tokens, min_tokens=min_tokens, max_tokens=max_tokens,
                         draft_cost=draft_cost, curve=curve, **options)
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.target_eos = target_tokenizer.eos_token_id  # proposed after a draft that ends its text
        self.retokenizer = Retokenizer(target_tokenizer, draft_tokenizer)

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        super().begin(prompt_ids, forget)
        self.retokenizer.reset()

    def draft_ids(self, context: list[int]) -> list[int]:
        """The context in draft tokens: its text (special tokens left out) in the draft tokenizer, after
        the draft's beginning-of-sequence token if it has one. Decoded and encoded whole: the reference
        the drafter's own `Retokenizer` keeps in step with less work."""
        text = self.target_tokenizer.decode(context, skip_special_tokens=True)
        return self._bos() + self.draft_tokenizer.encode(text, add_special_tokens=False)

    def _bos(self) -> list[int]:
        bos = self.draft_tokenizer.bos_token_id
        return [bos] if bos is not None else []

    def propose(self, context, max_tokens, params, generator) -> Draft:
        length = min(self._length(), max_tokens + 1)  # the last translated token is dropped
        if not self._ready(context, max_tokens):
            return Draft.empty()
        window = context_window(self.target_tokenizer, context) if length >= 2 else None
        draft_context = self._bos() + self.retokenizer(context) if window is not None else []
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
