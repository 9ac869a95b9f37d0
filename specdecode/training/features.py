"""Teacher-forced features: the target run over the training corpus once, its last hidden state kept for
every position (what Medusa's heads and EAGLE's head read, and from which the target's own next-token
distribution is the LM head away, so nothing else needs keeping).

Stored as safetensors shards in a folder, each with
  tokens     [n] int32      the token ids of its sequences, one after another
  hidden     [n, d] bf16    the target's last hidden state (after its final norm) at each token
  assistant  [n] uint8      1 where the token belongs to an assistant turn
  starts     [s + 1] int64  where each sequence begins (and the end)
  aux        [n, k d] bf16  with `layers` (EAGLE-3): the inputs of k target decoder layers side by side
and `features.json` describing the target, the corpus and the shards.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode.errors import UserError
from specdecode.training.corpus import Sequence

SHARD_TOKENS = 65_536
MANIFEST = "features.json"


@dataclass
class Shard:
    tokens: torch.Tensor  # [n] int64
    hidden: torch.Tensor  # [n, d] bfloat16
    assistant: torch.Tensor  # [n] bool
    starts: torch.Tensor  # [s + 1] int64
    aux: torch.Tensor | None = None  # [n, k d] bfloat16: the inputs of the `aux_layers` (EAGLE-3)

    def sequences(self):
        """(tokens, hidden, assistant) of each sequence."""
        for begin, end in zip(self.starts[:-1].tolist(), self.starts[1:].tolist()):
            yield self.tokens[begin:end], self.hidden[begin:end], self.assistant[begin:end]

    def sequences_with_aux(self):
        """(tokens, hidden, assistant, aux) of each sequence."""
        if self.aux is None:
            raise UserError("these features hold no layer inputs for EAGLE-3; rebuild them into an empty folder")
        for begin, end in zip(self.starts[:-1].tolist(), self.starts[1:].tolist()):
            yield (self.tokens[begin:end], self.hidden[begin:end], self.assistant[begin:end],
                   self.aux[begin:end])


@torch.inference_mode()
def hidden_states(model, token_ids: list[int], layers: tuple[int, ...] | None = None):
    """[n, d] the model's last hidden state (after its final norm, as its LM head reads it); with `layers`,
    also [n, k d] the inputs of those decoder layers (transformers' hidden_states[i]) side by side."""
    out = model.model(input_ids=torch.tensor([token_ids]), output_hidden_states=layers is not None)
    if layers is None:
        return out.last_hidden_state[0]
    return out.last_hidden_state[0], torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


def extract(model, sequences: list[Sequence], out: Path, describe: dict, progress: bool = True,
            layers: tuple[int, ...] | None = None) -> Path:
    """Run `model` (a transformers causal LM) over every sequence and write the shards to `out`; with
    `layers`, the inputs of those decoder layers too (EAGLE-3)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    out.mkdir(parents=True, exist_ok=True)
    total = sum(len(s.token_ids) for s in sequences)
    pending: list[tuple[Sequence, torch.Tensor]] = []
    shards, start = [], time.perf_counter()

    def flush():
        if not pending:
            return
        name = f"shard-{len(shards):04d}.safetensors"
        lengths = [len(s.token_ids) for s, _ in pending]
        save_file({
            "tokens": torch.tensor([t for s, _ in pending for t in s.token_ids], dtype=torch.int32),
            "hidden": torch.cat([h[0] if layers else h for _, h in pending]).to(torch.bfloat16).contiguous(),
            "assistant": torch.tensor([a for s, _ in pending for a in s.assistant], dtype=torch.uint8),
            "starts": torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int64),
            **({"aux": torch.cat([a for _, (_, a) in pending]).to(torch.bfloat16).contiguous()} if layers else {}),
        }, str(out / name))
        shards.append({"file": name, "tokens": sum(lengths), "sequences": len(lengths)})
        pending.clear()

    columns = [TextColumn("target features"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
               TimeRemainingColumn()]
    with _one_call_attention(model), Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("features", total=total)
        for sequence in sequences:
            pending.append((sequence, hidden_states(model, sequence.token_ids, layers)))
            bar.advance(task, len(sequence.token_ids))
            if sum(len(s.token_ids) for s, _ in pending) >= SHARD_TOKENS:
                flush()
        flush()
    manifest = {**describe, "tokens": total, "sequences": len(sequences),
                "assistant_tokens": sum(sum(s.assistant) for s in sequences),
                "by_source": {src: sum(len(s.token_ids) for s in sequences if s.source == src)
                              for src in sorted({s.source for s in sequences})},
                "hidden_size": int(model.config.hidden_size), "aux_layers": list(layers) if layers else None,
                "seconds": round(time.perf_counter() - start, 1),
                "shards": shards}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


@contextlib.contextmanager
def _one_call_attention(model):
    """The int8 path's row-by-row attention keeps a token's logits batch-invariant, which features need not
    be: within this block one attention call per layer instead of one per row (the same values to
    rounding, many times faster on a long sequence); other models as they are."""
    from specdecode.models.int8 import ATTENTION

    invariant = getattr(model.config, "_attn_implementation", None) == ATTENTION
    if invariant:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if invariant:
            model.set_attn_implementation(ATTENTION)


def load(folder: Path) -> tuple[dict, list[Shard]]:
    """The manifest and every shard of a features folder."""
    manifest_path = Path(folder) / MANIFEST
    if not manifest_path.is_file():
        raise UserError(f"{folder} holds no features ({MANIFEST} is missing): `specdecode train eagle|medusa --data DIR` builds them")
    manifest = json.loads(manifest_path.read_text())
    shards = []
    for entry in manifest["shards"]:
        tensors = load_file(str(Path(folder) / entry["file"]))
        shards.append(Shard(tensors["tokens"].long(), tensors["hidden"], tensors["assistant"].bool(), tensors["starts"],
                            tensors.get("aux")))
    return manifest, shards
