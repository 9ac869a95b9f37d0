"""Storage of the trained heads that draft from the target's features (EAGLE, Medusa): one folder per
head, its weights in safetensors (bfloat16) and a JSON file with its shape and its training record.

The repository ships the heads trained for the default target under specdecode/heads/<model>/<kind>; a head
trained with `specdecode train KIND --out DIR` drafts from DIR (`--head DIR`, `DrafterOptions.head`) once its
record says it fits the target (`check_fits`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from specdecode.errors import UserError
from specdecode.paths import damaged, read_record, write_atomically

H = TypeVar("H", bound=nn.Module)  # a trained head, copied for drafting as the class it is


def save_head(module: nn.Module, folder: Path, weights: str, config: str, shape: dict, record: dict) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in module.state_dict().items()}
    # each whole or not at all, the record last: a save cut short leaves the old head or a folder without one
    write_atomically(folder / weights, lambda path: save_file(tensors, str(path)))
    write_atomically(folder / config, json.dumps({"config": shape, **record}, indent=1))


def load_head(folder: Path, weights: str, config: str, kind: str) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(shape, tensors, record) of a stored head; a clear error when the folder holds none."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / weights).is_file() or not (folder / config).is_file():
        raise UserError(f"{folder} holds no {kind} head ({weights} and {config}); train one with "
                        f"`specdecode train {kind.lower()}`")
    fix = f"train it again (`specdecode train {kind.lower()}`)"
    record = read_record(folder / config, f"a {kind} head's record", fix)
    with damaged(folder / weights, f"a {kind} head's weights", fix):
        return record.pop("config"), load_file(str(folder / weights)), record


RECORDS = {"eagle": "eagle.json", "eagle3": "eagle3.json", "medusa": "medusa.json"}  # kind -> its JSON record


def kinds_in(folder: str | Path) -> list[str]:
    """The kinds of head whose JSON record a folder holds (one, where it is a head's folder)."""
    return [kind for kind, record in RECORDS.items() if (Path(folder).expanduser() / record).is_file()]


def kind_of(folder: str | Path) -> str:
    """The kind of head a folder holds ("eagle", "eagle3", "medusa"), by its JSON record; a UserError if none."""
    folder = Path(folder).expanduser()
    kinds = kinds_in(folder)
    if len(kinds) != 1:
        if kinds:
            raise UserError(f"{folder} holds more than one trained head ({', '.join(RECORDS[k] for k in kinds)}): "
                            "move all but one head's files to a folder of their own")
        raise UserError(f"{folder} holds no trained head (one of {', '.join(RECORDS.values())}); write one with "
                        "`specdecode train eagle3|eagle|medusa --out DIR`")
    return kinds[0]


def check_fits(folder: Path, kind: str, record: dict, hidden_size: int, vocab_size: int, target_config) -> None:
    """A one-line UserError unless a head (its `hidden_size`, and `vocab_size`: the target vocabulary it was
    trained over, or for heads that store only their draft vocabulary's ids the highest id + 1) fits the target
    whose transformers config is `target_config`. A record that names its target's vocabulary (`target_vocab_size`,
    written by `specdecode train`) must name this target's."""
    target_vocab = target_config.vocab_size
    vocab_size = record.get("target_vocab_size", vocab_size)
    fits = hidden_size == target_config.hidden_size and (
        vocab_size == target_vocab if kind == "eagle3" or "target_vocab_size" in record else vocab_size <= target_vocab)
    if not fits:
        trained_for = record.get("target") or "another model"
        target = Path(str(target_config._name_or_path).rstrip("/")).name or "this target"
        raise UserError(f"the {kind} head in {folder} was trained for {trained_for} (hidden size {hidden_size}, "
                        f"vocabulary {vocab_size}); {target} has hidden size {target_config.hidden_size}, vocabulary "
                        f"{target_vocab}: train one for it with `specdecode train {kind} --target ... --out DIR`")


def shipped_head(target, kind: str) -> Path:
    """Where the repository keeps a trained head for a target: specdecode/heads/<model name>/<kind>. `target`:
    a transformers model, or before it loads its name or path (a registered name, a hub id, a folder), which
    names the same folder as the model loaded from it. Lower case, as the folders are: a hub id
    (`Qwen/Qwen2.5-Coder-1.5B-Instruct`) finds its model's heads (their records are checked against it on load)."""
    config = getattr(target, "config", None)
    name = Path(str(config._name_or_path if config is not None else target).rstrip("/")).name.lower()
    return Path(__file__).resolve().parents[1] / "heads" / name / kind


def ships(target, kind: str) -> bool:
    """Whether a head of `kind` ships for `target` (as `shipped_head` names its folder)."""
    return (shipped_head(target, kind) / RECORDS[kind]).is_file()


def shipped_heads() -> list[tuple[str, str, Path]]:
    """(target name, kind, folder) of every head the package ships."""
    root = Path(__file__).resolve().parents[1] / "heads"
    return [(folder.parent.name, kind, folder) for folder in sorted(root.glob("*/*"))
            for kind in [folder.name] if (folder / RECORDS.get(kind, "-")).is_file()]


def head_folder(target, kind: str, head: str | None):
    """The transformers model behind `target` and the folder of the head to draft with: `head` (a folder
    `specdecode train KIND --out` wrote), else the one shipped for the target; or a clear error."""
    model = getattr(target, "model", None)
    if model is None:
        raise UserError(f"{kind} drafts from the target's hidden states: run it on the torch backend")
    if head is not None:
        if kind_of(head) != kind:
            raise UserError(f"{head} holds {kind_of(head)} heads, not {kind} (`specdecode train {kind} --out DIR`)")
        return model, Path(head).expanduser()
    if not ships(model, kind):
        raise UserError(f"no {kind} head ships for {Path(str(model.config._name_or_path)).name}: train one with "
                        f"`specdecode train {kind} --target ... --out DIR`, then pass --head DIR")
    return model, shipped_head(model, kind)


# The bits a trained head drafts with where the machine has the quantized kernels (`for_drafting`); None:
# float32. A head's drafting step reads all its weights for a few rows, like a target's decoding step, so the
# bytes of its weights decide what it costs beside a target step (docs/results/code-choices.md).
DRAFT_BITS: int | None = 4


def lm_head_rows(target_model, ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` ([k] token ids) of the target's LM head, [k, d] on its device, without the graph: an int4 head
    dequantizes only those rows (`InvariantInt4Linear.weight_rows`), any other gives `weight[ids]`."""
    lm_head = target_model.get_output_embeddings()
    select = getattr(lm_head, "weight_rows", None)
    if select is not None:
        return select(ids)
    weight = lm_head.weight.detach()
    return weight[ids.to(weight.device)]


def for_drafting(head: H, lm_rows: torch.Tensor, quantize: bool = True) -> tuple[H, nn.Module]:
    """(a float32 copy of a trained head, a layer computing its draft logits from the LM head's rows of its
    vocabulary `lm_rows` [V', d]) as they draft, both on the device of `lm_rows` (the target's): on the CPU
    their linear layers on the quantized kernels (DRAFT_BITS) where this machine has them; elsewhere in
    float32 (the kernels are the CPU's; and with `quantize` False, as the static path wants them). Lossless
    whatever it does to the drafts: drafts are only proposals, and sampled verification uses the distribution
    the head drafted from."""
    from specdecode.models import int4
    from specdecode.models.int8 import quantize_linears

    device = lm_rows.device
    drafting = copy.deepcopy(head).float().eval().to(device)
    linear = nn.Linear(lm_rows.shape[1], lm_rows.shape[0], bias=False, device=device)
    linear.weight.data = lm_rows.detach().float().contiguous()
    logits: nn.Module = linear
    if quantize and DRAFT_BITS is not None and device.type == "cpu" and int4.usable():
        quantize_linears(drafting, DRAFT_BITS)
        logits = quantize_linears(nn.Sequential(linear), DRAFT_BITS)[0]
    return drafting, logits.eval()
