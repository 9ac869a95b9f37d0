"""Teacher-forced features: the target run over the training corpus once, its last hidden state kept for
every position (what Medusa's heads and EAGLE's head read, and from which the target's own next-token
distribution is the LM head away, so nothing else needs keeping).

Stored as safetensors shards in a folder, each with
  tokens     [n] int32      the token ids of its sequences, one after another
  hidden     [n, d] bf16    the target's last hidden state (after its final norm) at each token
  assistant  [n] uint8      1 where the token belongs to an assistant turn
  starts     [s + 1] int64  where each sequence begins (and the end)
  aux        [n, k d] bf16  with `layers` (EAGLE-3): the inputs of k target decoder layers side by side
and `features.json` describing the target, the corpus and the shards, with each shard's sequence ids:
a folder is added to sequence by sequence (`Writer`), so an extraction cut short carries on, and the
features `specdecode train data` keeps of its answers as it generates them need no second pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import time
from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdecode.errors import UserError
from specdecode.paths import damaged, read_record
from specdecode.training.answer_store import same_target
from specdecode.training.corpus import Sequence

SHARD_TOKENS = 65_536
# what a damaged file's message says to do
REBUILD = "build the features again in a new folder (`specdecode train eagle|medusa --data DIR`)"
MANIFEST = "features.json"


@dataclass
class Shard:
    tokens: torch.Tensor  # [n] int64
    hidden: torch.Tensor  # [n, d] bfloat16
    assistant: torch.Tensor  # [n] bool
    starts: torch.Tensor  # [s + 1] int64
    aux: torch.Tensor | None = None  # [n, k d] bfloat16: the inputs of the `aux_layers` (EAGLE-3)
    ids: list[str] | None = None  # each sequence's id (`sequence_id`); None in folders of the older layout

    def sequences(self):
        """(tokens, hidden, assistant) of each sequence."""
        for begin, end in zip(self.starts[:-1].tolist(), self.starts[1:].tolist()):
            yield self.tokens[begin:end], self.hidden[begin:end], self.assistant[begin:end]

    def keys(self, index: int) -> list[str]:
        """Each sequence's name for the held-out split (`loop.split`): its id, or, in a folder of the older
        layout, its place there (`index`: the shard's)."""
        return list(self.ids) if self.ids else [f"{index}/{i}" for i in range(len(self.starts) - 1)]

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
    also [n, k d] the inputs of those decoder layers (transformers' hidden_states[i]) side by side; on the
    model's device."""
    out = model.model(input_ids=torch.tensor([token_ids], device=model.device), output_hidden_states=layers is not None)
    if layers is None:
        return out.last_hidden_state[0]
    return out.last_hidden_state[0], torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


class Writer:
    """A features folder open for adding sequences, each under its id: they collect into shards of about
    SHARD_TOKENS tokens, and the manifest is rewritten after every shard, so a kill loses only the
    sequences not yet in a shard; a folder opened again (same target and layers) knows the ids it holds
    (`done`) and adds to them. `specdecode train data` writes the features of its answers here as it
    generates them; `extract` fills in the rest."""

    def __init__(self, folder: Path, describe: dict, hidden_size: int, layers: tuple[int, ...] | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / MANIFEST
        identity = {"target_key": describe.get("target_key"), "aux_layers": list(layers) if layers else None}
        if path.is_file():
            self.manifest = read_record(path, "a features manifest", REBUILD)
            if _older(self.manifest):
                raise UserError(f"{self.folder} holds features of an older layout that cannot be added to; "
                                "pick an empty folder")
            for key, value in identity.items():
                kept = self.manifest.get(key)
                if key == "target_key" and same_target(kept, value):
                    continue  # (a registered target cached elsewhere)
                if kept != value:
                    raise UserError(f"{self.folder} holds features with {key}={self.manifest.get(key)!r}, not "
                                    f"{value!r}; pick another folder")
        else:
            self.manifest = {**describe, **identity, "hidden_size": hidden_size, "seconds": 0.0, "shards": []}
        self.done = _held(self.manifest)
        self.pending: list[tuple[str, Sequence, torch.Tensor, torch.Tensor | None]] = []

    def add(self, ident: str, sequence: Sequence, hidden: torch.Tensor, aux: torch.Tensor | None = None) -> None:
        """A sequence's features: `hidden` [n, d] (the final-norm states), `aux` [n, k d] (the layer inputs),
        from any device (kept on the host until written); nothing if the folder holds that id already."""
        if ident in self.done:
            return
        if hidden.shape[0] != len(sequence.token_ids) or (aux is None) != (self.manifest["aux_layers"] is None):
            raise ValueError(f"features of {ident} do not fit its {len(sequence.token_ids)} tokens or the layers")
        aux = None if aux is None else aux.to("cpu", torch.bfloat16)
        self.pending.append((ident, sequence, hidden.to("cpu", torch.bfloat16), aux))
        self.done.add(ident)
        if sum(len(s.token_ids) for _, s, _, _ in self.pending) >= SHARD_TOKENS:
            self.flush()

    def flush(self, seconds: float = 0.0) -> None:
        """Write the pending sequences as a shard, then the manifest (with `seconds` more spent)."""
        self.manifest["seconds"] = round(self.manifest["seconds"] + seconds, 1)
        if self.pending:
            name = f"shard-{len(self.manifest['shards']):04d}.safetensors"
            sequences = [s for _, s, _, _ in self.pending]
            lengths = [len(s.token_ids) for s in sequences]
            aux = [a for _, _, _, a in self.pending if a is not None]  # all or none: EAGLE-3's layer inputs
            save_file({
                "tokens": torch.tensor([t for s in sequences for t in s.token_ids], dtype=torch.int32),
                "hidden": torch.cat([h for _, _, h, _ in self.pending]).contiguous(),
                "assistant": torch.tensor([a for s in sequences for a in s.assistant], dtype=torch.uint8),
                "starts": torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64),
                **({"aux": torch.cat(aux).contiguous()} if aux else {}),
            }, str(self.folder / name))
            by_source: dict[str, int] = {}
            for s in sequences:
                by_source[s.source] = by_source.get(s.source, 0) + len(s.token_ids)
            self.manifest["shards"].append({
                "file": name, "tokens": sum(lengths), "sequences": len(lengths),
                "assistant_tokens": sum(sum(s.assistant) for s in sequences), "by_source": by_source,
                "ids": [ident for ident, _, _, _ in self.pending]})
            self.pending.clear()
        shards = self.manifest["shards"]
        self.manifest["tokens"] = sum(s["tokens"] for s in shards)
        self.manifest["sequences"] = sum(s["sequences"] for s in shards)
        self.manifest["assistant_tokens"] = sum(s["assistant_tokens"] for s in shards)
        self.manifest["by_source"] = dict(sorted(sum((Counter(s["by_source"]) for s in shards), Counter()).items()))
        temporary = self.folder / (MANIFEST + ".tmp")
        temporary.write_text(json.dumps(self.manifest, indent=1))
        os.replace(temporary, self.folder / MANIFEST)  # a kill leaves the old manifest or the new one


def sequence_id(sequence: Sequence) -> str:
    """What names a sequence in a features folder: its own id, or one made from its tokens."""
    if sequence.id:
        return sequence.id
    digest = hashlib.sha1(array("q", sequence.token_ids).tobytes() + bytes(sequence.assistant)).hexdigest()
    return f"{sequence.source}:{digest[:20]}"


def missing(folder: Path, sequences: list[Sequence]) -> list[Sequence]:
    """The sequences a features folder does not hold yet."""
    manifest_path = Path(folder) / MANIFEST
    if not manifest_path.is_file():
        return list(sequences)
    have = _held(read_record(manifest_path, "a features manifest", REBUILD))
    return [s for s in sequences if sequence_id(s) not in have]


def older_layout(folder: Path) -> bool:
    """Whether `folder` holds features of the layout before ids were kept per shard: built whole, used as
    they are, never added to."""
    manifest_path = Path(folder) / MANIFEST
    return manifest_path.is_file() and _older(read_record(manifest_path, "a features manifest", REBUILD))


def _older(manifest: dict) -> bool:
    return any("ids" not in shard for shard in manifest["shards"])


def _held(manifest: dict) -> set[str]:
    """The ids of the sequences a manifest's shards hold."""
    return {ident for shard in manifest["shards"] for ident in shard.get("ids", ())}


def extract(model, sequences: list[Sequence], out: Path, describe: dict, progress: bool = True,
            layers: tuple[int, ...] | None = None) -> Path:
    """Run `model` (a transformers causal LM) over every sequence `out` does not hold yet and add their
    features there (`Writer`: a run cut short carries on where it stopped); with `layers`, the inputs of
    those decoder layers too (EAGLE-3)."""
    from rich.progress import BarColumn, TextColumn, TimeRemainingColumn

    from specdecode.progress import Progress

    writer = Writer(out, describe, int(model.config.hidden_size), layers)
    todo = [s for s in sequences if sequence_id(s) not in writer.done]
    columns = [TextColumn("target features"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
               TimeRemainingColumn()]
    start = time.perf_counter()
    with _one_call_attention(model), Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("features", total=sum(len(s.token_ids) for s in todo))
        try:
            for sequence in todo:
                if sequence_id(sequence) in writer.done:  # the same sequence twice in the list
                    continue
                states = hidden_states(model, sequence.token_ids, layers)
                writer.add(sequence_id(sequence), sequence, *(states if layers else (states,)))
                bar.advance(task, len(sequence.token_ids))
        finally:  # an interrupted run keeps what it finished
            writer.flush(time.perf_counter() - start)
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
    """The manifest and every shard of a features folder. The features are mapped from their files, not
    read: a million tokens' are some 12 GB, and the training reads windows of them."""
    manifest_path = Path(folder) / MANIFEST
    if not manifest_path.is_file():
        raise UserError(f"{folder} holds no features ({MANIFEST} is missing): "
                        "`specdecode train eagle|medusa --data DIR` builds them")
    manifest = read_record(manifest_path, "a features manifest", REBUILD)
    shards = []
    for entry in manifest["shards"]:
        with damaged(Path(folder) / entry["file"], "a shard of features", REBUILD):
            tensors = _mapped(Path(folder) / entry["file"])
        shards.append(Shard(tensors["tokens"].long(), tensors["hidden"], tensors["assistant"].bool(), tensors["starts"],
                            tensors.get("aux"), entry.get("ids")))
    return manifest, shards


_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


def _mapped(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as views of the file mapped into memory (copy-on-write: writing to them
    leaves the file alone). The layout: 8 bytes giving the header's length, the JSON header (each tensor's
    dtype, shape and byte range after the header), the data."""
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) if path.stat().st_size > 8 + length else None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, (begin, end) = _DTYPES[info["dtype"]], info["data_offsets"]
        if end == begin:
            tensor = torch.empty(0, dtype=dtype)
        else:
            count, offset = (end - begin) // dtype.itemsize, 8 + length + begin
            tensor = torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset)
        out[name] = tensor.view(info["shape"])
    return out
