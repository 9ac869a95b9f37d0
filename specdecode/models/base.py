"""The one interface between the engine and a model backend.

A backend holds one sequence and its KV cache. The engine and the drafters only ever:

- feed new tokens (with explicit positions, and for token trees an attention mask among the new tokens)
  and get float32 logits (and, on request, last hidden states) for the last few of them;
- crop the cache back to a length after a rejection, or, after a token tree, compact it to the
  accepted path.

That is all a backend has to implement; PyTorch/transformers is one backend, llama.cpp another.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_logits, vocab] float32
    hidden: torch.Tensor | None = None  # [n, hidden_size (x layers)] every fed token's hidden states, on request


@dataclass
class Entries:
    """A copy of some of a cache's entries (`CausalLM.entries`), kept apart from it, to be appended to it again
    (`CausalLM.append_entries`): the keys and values of a context's first tokens, in the backend's own layout."""

    tensors: list[torch.Tensor]  # each with the tokens along dimension -2

    def __len__(self) -> int:
        return self.tensors[0].shape[-2]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class CausalLM(abc.ABC):
    """A causal language model with a KV cache over a single sequence."""

    # True: the cache may hold several sequences side by side, told apart by full attention masks over
    # cache and input (`tree_mask` of cache_length + n columns), logits by `rows`, slots gathered by
    # compact(0, keep): what `engine.batch.BatchEngine` needs.
    several_sequences: bool = False
    # True: as a draft model it can grow a token tree in its own cache (a draft model's tree drafting); llama.cpp's
    # context holds a tree only for the one forward that verifies it
    grows_trees: bool = True
    # True: a one-time measurement on first use (the cost curve: `models.costs.cached`) prints no line, as
    # `load_models(progress=False)` asks
    quiet: bool = False

    vocab_size: int  # rows of the output distribution (may exceed the tokenizer's vocabulary)
    max_context: int  # positions the model supports
    eos_token_ids: frozenset[int]

    @property
    def device(self) -> torch.device:
        """Where the model runs and its inputs belong (a backend moves host inputs there itself)."""
        return torch.device("cpu")

    @property
    def precision(self) -> str:
        """The path its weights run on, as reports name it: "bfloat16", "int8", a GGUF file's quantization."""
        return "unknown"

    @property
    @abc.abstractmethod
    def cache_length(self) -> int:
        """How many tokens the KV cache holds."""

    @property
    @abc.abstractmethod
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights read to decode one token (embedding lookups excluded): the cost of a forward
        on hardware where decoding is bound by memory, as on CPUs."""

    @abc.abstractmethod
    def forward(
        self,
        token_ids: torch.Tensor,  # [n] int64, appended to the cache
        *,
        positions: torch.Tensor | None = None,  # [n] int64; default: cache_length, cache_length + 1, ...
        # [n, m] bool, m <= cache_length + n: new token i may attend to the j-th of the last m tokens (cached
        # or new); the tokens before those m are visible to all. None: causal.
        tree_mask: torch.Tensor | None = None,
        num_logits: int | None = None,  # logits for the last num_logits tokens only (default: all n)
        # True: the final-norm hidden state of every fed token (`ForwardOutput.hidden`); a tuple of layer
        # indices: the inputs of those decoder layers (transformers' hidden_states[i]) side by side
        output_hidden: bool | tuple[int, ...] = False,
        # [r] int64: logits for these rows of the n, in this order (overrides num_logits); backends with
        # `several_sequences` only (the batch engine asks for each sequence's rows)
        rows: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Run the model over `token_ids`, store their keys and values, return the last logits."""

    @abc.abstractmethod
    def crop(self, length: int) -> None:
        """Drop cache entries past `length`."""

    def compact(self, start: int, keep: list[int] | tuple[int, ...]) -> None:
        """Keep the cache's first `start` entries followed by entries start + keep[0], start + keep[1], ...
        and drop the rest: after a tree, `keep` is the accepted path. The only way the cache shrinks
        after verification; a chain's path 0, 1, ..., m - 1 is a plain crop."""
        keep = list(keep)
        if keep != list(range(len(keep))):
            self._move(start, keep)
        self.crop(start + len(keep))

    def _move(self, start: int, keep: list[int]) -> None:
        """Copy cache entries start + keep[i] to start + i (keep ascending, so nothing is overwritten
        before it is read)."""
        raise NotImplementedError(f"{type(self).__name__} cannot verify token trees")

    def reset(self) -> None:
        """Forget the sequence."""
        self.crop(0)

    def entries(self, slots: torch.Tensor) -> Entries:
        """A copy of the cache's entries at `slots` ([n] int64, in order), which outlives every later change to
        the cache (`several_sequences` backends: the batch engine keeps ended contexts' prefixes so)."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy its cache's entries")

    def append_entries(self, entries: Entries, n: int) -> None:
        """Append the first `n` entries of a copy (`entries`) to the cache, as if their tokens had been fed at the
        positions they were fed at before (a prefix's keys and values do not depend on where in the cache they
        lie, only on their positions)."""
        raise NotImplementedError(f"{type(self).__name__} cannot take entries copied out of a cache")

    @property
    def cost_key(self) -> str:
        """Names the weights, dtype and backend, to cache the model's cost curve under."""
        return f"{type(self).__name__}|{self.vocab_size}|{self.weight_bytes_per_token}"

    def cost_curve(self):
        """The cost of a forward over n tokens relative to one (`models.live_curve.LiveCurve`): measured on first
        use on this machine and cached, then corrected by the forwards the engine times. One per model,
        shared by its engines and drafters."""
        from specdecode.models import live_curve

        if getattr(self, "_live_curve", None) is None:
            self._live_curve = live_curve.live(self)
        return self._live_curve
