"""The EAGLE head (Li et al. 2024) and its view of one sequence: the module that drafts at the level of the target's
features, its storage, and the state a drafter keeps of a sequence (`HeadState`: the context's features and the head's
KV cache over them). The drafters that run it are `drafters.eagle`'s; the same state on the static path is
`drafters.static_heads.StaticHeadState`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from transformers import DynamicCache, Qwen2Config, Qwen2Model

from specdecode.devices import to_device
from specdecode.drafters.base import tensor_bytes
from specdecode.drafters.heads import for_drafting, lm_head_rows, load_head, save_head
from specdecode.models.cache import cache_keyword

WEIGHTS, CONFIG = "eagle.safetensors", "eagle.json"


def head_config(target_config, intermediate_size: int | None = None) -> Qwen2Config:
    """One decoder layer with the target's width and attention, a (possibly narrower) MLP."""
    known = Qwen2Config().to_dict()
    config = Qwen2Config(**{key: value for key, value in target_config.to_dict().items() if key in known})
    config.num_hidden_layers = 1
    config.layer_types = ["full_attention"]
    config.intermediate_size = intermediate_size or target_config.intermediate_size
    config.vocab_size = 1  # inputs come as embeddings
    config.pad_token_id = config.bos_token_id = config.eos_token_id = None  # (the target's lie past that row)
    config.use_sliding_window = False
    config.tie_word_embeddings = False
    return config


class EagleHead(nn.Module):
    """(feature, next token's embedding) pairs -> predicted next features; logits over `vocab_ids`."""

    vocab_ids: torch.Tensor  # a buffer (register_buffer), declared for the type checker

    def __init__(self, config: Qwen2Config, vocab_ids: torch.Tensor):
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.layer = Qwen2Model(config)
        self.register_buffer("vocab_ids", vocab_ids.long().clone(), persistent=True)  # draft index -> token id

    def forward(
        self,
        features: torch.Tensor,  # [b, n, d] the target's (or predicted) features at positions t
        embeddings: torch.Tensor,  # [b, n, d] the target's embeddings of the tokens at t + 1
        position_ids: torch.Tensor,  # [b, n]
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        x = self.fc(torch.cat([features, embeddings], dim=-1))
        out = self.layer(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                         **{cache_keyword(self.layer): cache}, use_cache=cache is not None)
        return out.last_hidden_state  # [b, n, d]

    # -- storage ---------------------------------------------------------------------------------

    def save(self, folder: Path, record: dict) -> None:
        save_head(self, folder, WEIGHTS, CONFIG, self.config.to_dict(), record)

    @classmethod
    def load(cls, folder: Path, dtype: torch.dtype = torch.bfloat16,
             device: torch.device | str = "cpu") -> tuple[EagleHead, dict]:
        shape, weights, record = load_head(folder, WEIGHTS, CONFIG, "EAGLE")
        head = cls(Qwen2Config(**shape), weights["vocab_ids"])
        head.load_state_dict(weights)
        return head.to(device=device, dtype=dtype).eval(), record


class State(Protocol):
    """What the EAGLE drafters use of a head's view of one sequence: `HeadState` for an EAGLE head,
    `eagle3.Eagle3State` for an EAGLE-3 one."""

    device: torch.device
    vocab_ids: torch.Tensor  # draft index -> token id, on the device
    fed: int  # context pairs in the head's cache

    def reset(self, forget: bool = False) -> None: ...
    def memory_bytes(self) -> int: ...
    def observe(self, hidden: torch.Tensor, num_pending: int, path: tuple[int, ...], /) -> None: ...
    def run(self, features: torch.Tensor, tokens: list[int] | torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor | None = None, /) -> torch.Tensor: ...
    def crop(self) -> None: ...
    def sync(self, context: list[int], /) -> torch.Tensor | None: ...
    def probs(self, feature: torch.Tensor, /) -> torch.Tensor: ...
    def logits(self, features: torch.Tensor, /) -> torch.Tensor: ...


class HeadState:
    """A head's view of one sequence: the target's features of the context (from the verification
    forwards), the head's KV cache over the context's pairs, and the speculative entries after them. All of
    it lives on the target's device, where the head drafts."""

    quantize = True  # the head's layers on the quantized kernels where the device is a CPU that has them

    def __init__(self, head: EagleHead, target_model):
        self.embed = target_model.get_input_embeddings()
        self.device = self.embed.weight.device  # the target's
        # the head as it drafts: float32 on the target's device (`heads.for_drafting`), over its LM head's rows
        self.head, self.lm_head = for_drafting(head, lm_head_rows(target_model, head.vocab_ids), self.quantize)
        self.dtype = torch.float32
        self.vocab_ids = head.vocab_ids.to(self.device)  # draft index -> token id
        self.vocab_size = target_model.get_output_embeddings().out_features
        self.reset()

    def reset(self, forget: bool = False) -> None:
        """Ready for a new sequence (a head keeps nothing of earlier ones)."""
        self.features: list[torch.Tensor] = []  # [d] the target's feature at each context position (but the last)
        self.cache = DynamicCache(config=self.head.config)
        self.fed = 0  # context pairs in the head's cache: positions 0 .. fed - 1
        self.cached = 0  # entries in the head's cache (the fed pairs, then speculative ones)
        self.last: torch.Tensor | None = None  # the head's prediction after its last real pair

    def memory_bytes(self) -> int:
        return tensor_bytes(self.head, self.lm_head, self.features)

    def observe(self, hidden: torch.Tensor, num_pending: int, path: tuple[int, ...]) -> None:
        # the fed tokens: the pending context tokens, then the draft's nodes; the context gains the
        # accepted nodes `path` (their features are the target's now), the last verdict token has none yet
        rows = list(range(num_pending)) + [num_pending + node for node in path]
        self.features += list(hidden[to_device(rows, hidden.device)].to(self.dtype))  # [pending + accepted] rows

    def run(self, features: torch.Tensor, tokens: list[int] | torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed pairs (features[i], tokens[i]) at `positions` [n] (on the device) to the head's cache; `tokens`
        from the host or the device, `mask` [n, cached + n] bool from the host (None: causal); returns its
        predictions [n, d]."""
        embeddings = self.embed(to_device(tokens, self.device)[None]).to(features.dtype)  # [1, n, d]
        additive = None
        if mask is not None:
            additive = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)  # [n, cached + n]
            additive = additive.masked_fill_(~to_device(mask, self.device), torch.finfo(self.dtype).min)[None, None]
        self.cached += len(tokens)
        return self.head(features[None], embeddings, positions[None], attention_mask=additive, cache=self.cache)[0]

    def crop(self) -> None:
        """Drop the speculative entries."""
        if self.cached > self.fed:
            self.cache.crop(self.fed - self.cached)  # transformers takes minus the count to drop
            self.cached = self.fed

    def sync(self, context: list[int]) -> torch.Tensor | None:
        """Feed the context's pairs (f_t, x_{t+1}) not yet in the head's cache; the head's prediction of
        the feature after the context (None before the target's first forward)."""
        if len(context) < 2 or len(self.features) < len(context) - 1:
            return None
        self.crop()
        end = len(context) - 1
        if self.fed < end:
            new = torch.stack(self.features[self.fed : end])
            positions = torch.arange(self.fed, end, device=self.device)
            self.last = self.run(new, context[self.fed + 1 : end + 1], positions)[-1]
            self.fed = end
        return self.last

    def probs(self, feature: torch.Tensor) -> torch.Tensor:
        """[..., V'] the draft distribution over the truncated vocabulary."""
        return torch.softmax(self.lm_head(feature).float(), dim=-1)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[n, vocab] full-vocabulary logits: the head's over its vocabulary, -inf elsewhere."""
        return full_vocabulary(features, self.lm_head(features).float(), self.vocab_ids, self.vocab_size)


def full_vocabulary(features: torch.Tensor, draft_logits: torch.Tensor, vocab_ids: torch.Tensor,
                    vocab_size: int) -> torch.Tensor:
    """[n, V'] logits over a head's draft vocabulary `vocab_ids` -> [n, vocab_size], -inf elsewhere. The
    buffer is made from `features` (`new_full`): on their device, and, in a sync count, their stand-in for
    device data (`devices.Tracked`), as a GPU's would be."""
    out = features.new_full((features.shape[0], vocab_size), float("-inf"), dtype=torch.float32)
    out[:, vocab_ids] = draft_logits
    return out
