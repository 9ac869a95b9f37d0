"""Storage of the trained heads that draft from the target's features (EAGLE, Medusa): one folder per
head, its weights in safetensors (bfloat16) and a JSON file with its shape and its training record.

The repository ships the heads trained for the default target under specdecode/heads/<model>/<kind>.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from specdecode.errors import UserError

H = TypeVar("H", bound=nn.Module)  # a trained head, copied for drafting as the class it is


def save_head(module: nn.Module, folder: Path, weights: str, config: str, shape: dict, record: dict) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in module.state_dict().items()}
    save_file(tensors, str(folder / weights))
    (folder / config).write_text(json.dumps({"config": shape, **record}, indent=1))


def load_head(folder: Path, weights: str, config: str, kind: str) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(shape, tensors, record) of a stored head; a clear error when the folder holds none."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / weights).is_file() or not (folder / config).is_file():
        raise UserError(f"{folder} holds no {kind} head ({weights} and {config}); train one with "
                        f"`specdecode train {kind.lower()}`")
    record = json.loads((folder / config).read_text())
    return record.pop("config"), load_file(str(folder / weights)), record


def shipped_head(target_model, kind: str) -> Path:
    """Where the repository keeps a trained head for a target: specdecode/heads/<model name>/<kind>."""
    name = Path(str(target_model.config._name_or_path).rstrip("/")).name
    return Path(__file__).resolve().parents[1] / "heads" / name / kind


def shipped_or_explain(target, kind: str, weights: str):
    """The transformers model behind `target` and the folder of its shipped head, or a clear error."""
    model = getattr(target, "model", None)
    if model is None:
        raise UserError(f"{kind} drafts from the target's hidden states: run it on the torch backend")
    folder = shipped_head(model, kind.lower())
    if not (folder / weights).is_file():
        raise UserError(f"no {kind} head for {Path(str(model.config._name_or_path)).name}: train one with "
                        f"`specdecode train {kind.lower()} --data DIR --out {folder}`")
    return model, folder


# The bits a trained head drafts with where the machine has the quantized kernels (`for_drafting`); None:
# float32. A head's drafting step reads all its weights for a few rows, like a target's decoding step: the
# shipped EAGLE-3 head's tree steps took 27.8 ms in float32, 6.8 in int8 and 3.2 in int4 beside a ~45 ms
# int4 target step (README, *Figures behind the code's choices*).
DRAFT_BITS: int | None = 4


def for_drafting(head: H, lm_rows: torch.Tensor) -> tuple[H, nn.Module]:
    """(a float32 copy of a trained head, a layer computing its draft logits from the LM head's rows of its
    vocabulary `lm_rows` [V', d]) as they draft, both on the device of `lm_rows` (the target's): on the CPU
    their linear layers on the quantized kernels (DRAFT_BITS) where this machine has them; elsewhere in
    float32 (the kernels are the CPU's). Lossless whatever it does to the drafts: drafts are only proposals,
    and sampled verification uses the distribution the head drafted from."""
    from specdecode.models import int4
    from specdecode.models.int8 import quantize_linears

    device = lm_rows.device
    drafting = copy.deepcopy(head).float().eval().to(device)
    linear = nn.Linear(lm_rows.shape[1], lm_rows.shape[0], bias=False, device=device)
    linear.weight.data = lm_rows.detach().float().contiguous()
    logits: nn.Module = linear
    if DRAFT_BITS is not None and device.type == "cpu" and int4.available():
        quantize_linears(drafting, DRAFT_BITS)
        logits = quantize_linears(nn.Sequential(linear), DRAFT_BITS)[0]
    return drafting, logits.eval()
