"""The one interface between the engine and a model backend.

A backend holds one sequence and its KV cache. The engine and the drafters only ever:

- feed new tokens (with explicit positions, and for token trees an attention mask among the new tokens)
  and get float32 logits (and, on request, last hidden states) for the last few of them;
- crop the cache back to a length after a rejection.

That is all a backend has to implement; PyTorch/transformers is one backend, llama.cpp another.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_logits, vocab] float32
    hidden: torch.Tensor | None = None  # [num_logits, hidden_size], final-norm hidden states, on request


class CausalLM(abc.ABC):
    """A causal language model with a KV cache over a single sequence."""

    vocab_size: int  # rows of the output distribution (may exceed the tokenizer's vocabulary)
    max_context: int  # positions the model supports
    eos_token_ids: frozenset[int]

    @property
    @abc.abstractmethod
    def cache_length(self) -> int:
        """How many tokens the KV cache holds."""

    @property
    @abc.abstractmethod
    def weights_per_token(self) -> int:
        """Parameters read to decode one token (embedding lookups excluded): the cost of a forward on
        hardware where decoding is bound by memory, as on CPUs."""

    @abc.abstractmethod
    def forward(
        self,
        token_ids: torch.Tensor,  # [n] int64, appended to the cache
        *,
        positions: torch.Tensor | None = None,  # [n] int64; default: cache_length, cache_length + 1, ...
        tree_mask: torch.Tensor | None = None,  # [n, n] bool, node i may attend to new token j
        num_logits: int | None = None,  # logits for the last num_logits tokens only (default: all n)
        output_hidden: bool = False,
    ) -> ForwardOutput:
        """Run the model over `token_ids`, store their keys and values, return the last logits."""

    @abc.abstractmethod
    def crop(self, length: int) -> None:
        """Drop cache entries past `length` (the only way the cache ever shrinks)."""

    def reset(self) -> None:
        """Forget the sequence."""
        self.crop(0)
