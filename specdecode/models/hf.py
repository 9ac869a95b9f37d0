"""The PyTorch backend: any causal LM from transformers, through its public forward."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdecode import devices
from specdecode.devices import to_device
from specdecode.errors import UserError
from specdecode.models.base import CausalLM, Entries, ForwardOutput
from specdecode.models.cache import attention_layer, attention_window, cache_keyword, growing_cache, keys_values
from specdecode.models.int4 import InvariantInt4Linear
from specdecode.models.int8 import InvariantInt8Linear
from specdecode.models.lean import QUANTIZED_LAYERS, LeanDecoder, lean_decoder


def _eos_ids(model: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    for config in (model.generation_config, model.config):
        eos = getattr(config, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return frozenset(ids)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of weights in a module, quantized Linear layers included (they keep theirs outside parameters())."""
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    for child in module.modules():
        if isinstance(child, torch.ao.nn.quantized.dynamic.Linear):
            total += child.weight().numel()  # one byte each
        elif isinstance(child, QUANTIZED_LAYERS):
            total += child.weight_bytes
    return total


class HFCausalLM(CausalLM):
    """A transformers model plus a KV cache (`models.cache.growing_cache`) for one sequence (or several, through
    masks). Quantized models of the Llama family run through `models.lean` (transformers' arithmetic, bit for
    bit, without its machinery); the rest through transformers' forward."""

    SPARE_CACHE = True  # a sibling's cache grows as it is fed: one costs nothing up front (`holding.measuring`)

    several_sequences = True

    def __init__(self, model: PreTrainedModel, eos_token_ids: frozenset[int] | None = None):
        self.model = model.eval()
        self.vocab_size = model.get_output_embeddings().out_features  # (a Linear head, int8 or not)
        # a model whose layers attend to a window has its sequences kept within the narrowest one: past it, drafts
        # verified under masks of its own making, or entries moved by slot, would ignore the window
        self.window = attention_window(model.config)
        self.max_context = min(getattr(model.config, "max_position_embeddings", 32768), self.window or 1 << 62)
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else _eos_ids(model)
        self._cache = growing_cache(model.config)
        self._length = 0
        self._lean = lean_decoder(model)
        devices.settle_attention(model.device)  # the kernels its attention may use there, fixed once

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights live, and so every input and the cache: the one source of truth for the device.
        `forward` takes inputs from anywhere (host tensors too) and moves them here once."""
        return self.model.device

    @property
    def precision(self) -> str:
        """The path the weights run on: "int4" (`models.int4`), "int8" (`models.int8`), else the dtype's name
        ("bfloat16"...)."""
        head = self.model.get_output_embeddings()
        if isinstance(head, InvariantInt4Linear):
            return "int4"
        if isinstance(head, InvariantInt8Linear):
            return "int8"
        return str(self.dtype).removeprefix("torch.")

    @property
    def weight_bytes_per_token(self) -> int:
        embedding = self.model.get_input_embeddings().weight
        head = self.model.get_output_embeddings()
        total = module_bytes(self.model)
        if isinstance(head, QUANTIZED_LAYERS) or embedding is not head.weight:
            total -= embedding.numel() * embedding.element_size()  # a lookup reads one row
        return total

    @property
    def cost_key(self) -> str:
        config = self.model.config
        key = f"hf|{config._name_or_path}|{config.model_type}|{self.precision}|{self.weight_bytes_per_token}"
        # a GPU's curve is its own (its name, capability, torch and CUDA); the CPU's machine is in the file name
        return key if self.device.type == "cpu" else f"{key}|{devices.name(self.device)}"

    @property
    def cache_length(self) -> int:
        return self._length

    def _allowed(self, tree_mask: torch.Tensor) -> torch.Tensor:
        """[n, m] bool over the last m tokens -> [n, cached + n] bool over the cache and the input."""
        n, m = tree_mask.shape
        if m > self._length + n:
            raise ValueError(f"a tree mask over {m} tokens, but the cache and the input hold {self._length + n}")
        allowed = torch.ones(n, self._length + n, dtype=torch.bool, device=self.device)
        allowed[:, self._length + n - m :] = to_device(tree_mask, self.device)
        return allowed

    def _attention_mask(self, tree_mask: torch.Tensor) -> torch.Tensor:
        """[n, m] bool over the last m tokens -> the [1, 1, n, cached + n] additive mask transformers takes."""
        n = tree_mask.shape[0]
        mask = torch.zeros((n, self._length + n), dtype=self.dtype, device=self.device)
        mask.masked_fill_(~self._allowed(tree_mask), torch.finfo(self.dtype).min)
        return mask[None, None]  # [1, 1, n, cached + n]

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        num_logits: int | None = None,
        output_hidden: bool | tuple[int, ...] = False,
        rows: torch.Tensor | None = None,
    ) -> ForwardOutput:
        n, device = token_ids.numel(), self.device
        token_ids = to_device(token_ids, device)
        if positions is None:
            positions = torch.arange(self._length, self._length + n, device=device)
        positions = to_device(positions, device)
        num_logits = n if num_logits is None else num_logits
        rows = torch.arange(n - num_logits, n, device=device) if rows is None else to_device(rows, device)
        if self._lean is not None:
            return self._lean_forward(self._lean, token_ids, positions, tree_mask, rows, output_hidden)
        out = self._model_forward(token_ids, positions, tree_mask, rows, output_hidden)
        self._length += n
        hidden = None  # every fed token's: the final-norm state, or the named layers' inputs side by side
        if output_hidden is True:
            hidden = out.hidden_states[-1][0]
        elif output_hidden:
            hidden = torch.cat([out.hidden_states[i][0] for i in output_hidden], dim=-1)
        return ForwardOutput(logits=out.logits[0].float(), hidden=hidden)

    def _model_forward(self, token_ids, positions, tree_mask, rows, output_hidden):
        n = token_ids.numel()
        return self.model(
            input_ids=token_ids.view(1, n),
            position_ids=positions.view(1, n),
            attention_mask=None if tree_mask is None else self._attention_mask(tree_mask),
            **{cache_keyword(self.model): self._cache},
            use_cache=True,
            # Indices, not a count: transformers then gathers a contiguous copy of those hidden states;
            # a count gives a strided view, and the bf16 LM head on a strided input is far slower on CPU
            # (docs/results/code-choices.md).
            logits_to_keep=rows,
            output_hidden_states=bool(output_hidden),
        )

    def _lean_forward(self, lean: LeanDecoder, token_ids, positions, tree_mask, rows,
                      output_hidden) -> ForwardOutput:
        n = token_ids.numel()
        allowed = None if tree_mask is None else self._allowed(tree_mask)  # [n, cached + n]
        trace: list[torch.Tensor] | None = [] if output_hidden and output_hidden is not True else None
        final = lean.run(range(len(lean.decoder.layers)), token_ids.view(n), positions.view(n), allowed, self._cache,
                         trace)  # [n, hidden]
        self._length += n
        hidden = None
        if output_hidden is True:
            hidden = final
        elif trace is not None:  # transformers' hidden_states: each layer's input, then the final-norm states
            states = trace[:-1] + [final]
            hidden = torch.cat([states[i] for i in output_hidden], dim=-1)
        return ForwardOutput(logits=lean.logits(final[rows]), hidden=hidden)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot crop a cache of {self._length} tokens to {length}")
        if length < self._length:
            self._cache.crop(length - self._length)  # transformers takes minus the count to drop
            self._length = length

    @torch.inference_mode()  # the cache holds inference tensors
    def _move(self, start: int, keep: list[int]) -> None:
        source = start + torch.tensor(keep, device=self.device)
        for layer in self._cache.layers:
            keys, values = keys_values(layer)  # [batch, kv_heads, length, head_dim]
            keys[..., start : start + len(keep), :] = keys[..., source, :]
            values[..., start : start + len(keep), :] = values[..., source, :]

    def reset(self) -> None:
        self._cache = growing_cache(self.model.config)
        self._length = 0

    @torch.inference_mode()
    def entries(self, slots: torch.Tensor) -> Entries:
        index = to_device(slots, self.device)
        return Entries([t.index_select(-2, index) for layer in self._cache.layers for t in keys_values(layer)])

    @torch.inference_mode()
    def append_entries(self, entries: Entries, n: int) -> None:
        pairs = zip(entries.tensors[::2], entries.tensors[1::2], strict=True)
        for layer, (keys, values) in zip(self._cache.layers, pairs, strict=True):
            attention_layer(layer).update(keys[..., :n, :], values[..., :n, :])
        self._length += n

    def sibling(self) -> HFCausalLM:
        """The same weights on the same path over a KV cache of their own (what the server's batch runs on beside
        a job that holds this one's cache)."""
        return HFCausalLM(self.model, self.eos_token_ids)


def torch_target(target: CausalLM, what: str) -> HFCausalLM:
    """`target` itself, when it runs on the torch backend: `what` (a method, training, an export) runs the
    target's own layers or reads its weights."""
    if not isinstance(target, HFCausalLM):
        raise UserError(f"{what} runs the target's own layers, which needs the torch backend "
                        f"(this target is {type(target).__name__}); use --backend torch")
    return target
