"""Prepared weights: a quantized model kept on disk, so that a later start loads it instead of quantizing.

Quantizing a model (`int8.quantize_invariant`, int8 or int4) goes through every linear layer in Python, and
for a model of a billion or more weights that is most of a start. Its result depends only on the model's
files (their contents), the bits, the quantizer's code (and the kernels' sources, which read what it writes),
the versions of torch and transformers, and the CPU's vector width (reductions round by it). So it is stored
once per such *key*:

    <cache>/prepared/<folder name>-int<bits>-<CPU width>-<key digest>/
        weights.safetensors   every tensor of the quantized model: each quantized layer's `state()`
                              and the rest (embeddings, norms, rotary buffers), as they are in memory
        prepared.json         the key in clear and each quantized layer's kind

`load` builds the model's skeleton with transformers on the meta device (no weight is read), fuses its
gated MLPs as quantization does, rebuilds each linear layer from its tensors (`from_state`) and puts
every other tensor in place: the model quantization would give, bit for bit. An entry is written to a
temporary folder and renamed when complete, so a crash mid-write leaves nothing that a later run would
trust; an entry that cannot be read is dropped and prepared again. Writing a new entry drops the older
ones of the same model folder, bits and CPU width (made by other code or versions); the entries of another width
stay, so a machine used at two widths (`ATEN_CPU_CAPABILITY=avx2` on an AVX-512 CPU) does not quantize again at
every switch. `specdecode models clean`
empties the cache.

Hub ids are not cached (a hub id names no files until transformers has downloaded them): only local
folders, which registered models and .gguf files become once converted.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from specdecode.errors import UserError
from specdecode.models import digests, int4, int8
from specdecode.models.conversion import first_line
from specdecode.paths import cache_dir, console

FORMAT = 1  # the layout of an entry; a change makes every older entry a stranger
WEIGHTS, RECORD = "weights.safetensors", "prepared.json"
_KINDS = {"int8": int8.InvariantInt8Linear, "int4": int4.InvariantInt4Linear}


def root() -> Path:
    """Where every prepared model lives."""
    return cache_dir() / "prepared"


def key(folder: Path, bits: int) -> dict:
    """What a prepared `folder` at `bits` depends on: the contents of the folder's files (a digest read once per
    version of each file, `models.digests`), the quantizer's code and the kernels' sources, torch, transformers
    and the CPU's vector width."""
    folder = folder.resolve()
    code = hashlib.sha256(b"".join(path.read_bytes() for path in _code())).hexdigest()
    files = [path for path in sorted(folder.iterdir()) if path.is_file()]
    return {
        "format": FORMAT,
        "folder": str(folder),
        "files": dict(zip([path.name for path in files], digests.digests(files))),
        "bits": bits,
        "code": code,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }


def _code() -> list[Path]:
    """The code whose change changes what quantization gives, how an entry is read, or what the kernels make of
    it: the quantizers, this module and the kernels' C++ sources."""
    return [Path(int8.__file__), Path(int4.__file__), Path(__file__), *sorted(int4.KERNEL_SOURCES.glob("*.cpp"))]


def entry(folder: Path, bits: int) -> Path:
    """The folder that holds (or will hold) `folder` prepared at `bits` on this CPU width."""
    described = key(folder, bits)
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
    width = "".join(c for c in str(described["cpu"]).lower() if c.isalnum()) or "cpu"
    return root() / f"{folder.resolve().name}-int{bits}-{width}-{digest}"


# --- Store ------------------------------------------------------------------------------------------


def save(model: PreTrainedModel, folder: Path, bits: int, *, progress: bool = False) -> Path | None:
    """Store `model`, quantized from `folder` at `bits`, for later starts; returns its entry. A failure to
    write (a full disk, a read-only cache) is reported and returns None: the model in memory is ready."""
    destination = entry(folder, bits)
    temporary = destination.with_name(f".{destination.name}.tmp-{os.getpid()}")
    try:
        tensors, record = _flatten(model)
        record["key"] = key(folder, bits)
        _remove(temporary)
        temporary.mkdir(parents=True)
        save_file(tensors, temporary / WEIGHTS)
        (temporary / RECORD).write_text(json.dumps(record, indent=1))
        if not destination.exists():  # else another process stored the same entry first
            temporary.rename(destination)
    except OSError as error:
        console.print(f"[yellow]Could not store the prepared weights in {root()} ({first_line(error)}); "
                      "the next start prepares them again.[/yellow]")
        return None
    finally:
        _remove(temporary)
    _drop_stale(destination, record["key"])
    if progress:
        size = (destination / WEIGHTS).stat().st_size
        console.print(f"[dim]Kept the int{bits} weights ({size / 1e9:.2f} GB) in {destination}: later starts load "
                      "them (`specdecode models clean` removes them)[/dim]")
    return destination


def _flatten(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of `model` by its dotted name (a quantized layer's by `state()`), and the record of the
    quantized layers' kinds. A tensor held under two names is stored under each (the LM head, which the
    Qwen2.5 models tie to the embeddings, is quantized apart from them: nothing else is tied)."""
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, str] = {}
    storages: set[int] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        kind = next((kind for kind, cls in _KINDS.items() if type(module) is cls), None)
        if kind is not None:
            layers[module_name] = kind
            owned = module.state().items()
        else:
            owned = [*module._parameters.items(), *module._buffers.items()]
        for field, tensor in owned:
            if tensor is None:
                continue
            tensor = tensor.detach()
            if tensor.untyped_storage().data_ptr() in storages or not tensor.is_contiguous():
                tensor = tensor.clone(memory_format=torch.contiguous_format)  # safetensors stores a storage once
            storages.add(tensor.untyped_storage().data_ptr())
            tensors[prefix + field] = tensor
    return tensors, {"format": FORMAT, "layers": layers}


def _drop_stale(kept: Path, kept_key: dict) -> None:
    """Remove the other entries of the same folder, bits and CPU width (their key no longer matches: other code
    or versions; an entry of another width stays, for a machine run at two widths), and the temporaries of
    writers that died mid-write."""
    stem = glob.escape(kept.name.rsplit("-", 1)[0])
    same = ("folder", "bits", "cpu")
    for other in root().glob(stem + "-*"):
        try:
            other_key = json.loads((other / RECORD).read_text())["key"]
        except (OSError, ValueError, KeyError):
            continue
        if other != kept and [other_key.get(field) for field in same] == [kept_key[field] for field in same]:
            _remove(other)
    for temporary in root().glob(f".{stem}-*.tmp-*"):
        pid = temporary.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(temporary)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


# --- Load -------------------------------------------------------------------------------------------


def load(folder: Path, bits: int) -> PreTrainedModel | None:
    """`folder` prepared at `bits` as quantization left it (eval mode, no gradients), or None when it was
    not stored yet. An entry that cannot be read is reported, removed, and None returned."""
    path = entry(folder, bits)
    if not (path / RECORD).is_file():
        return None
    try:
        return _restore(folder, path)
    except UserError:  # not the entry's fault (the int4 kernel does not compile): the caller says what to do
        raise
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as error:
        console.print(f"[yellow]The prepared weights in {path} cannot be read ({first_line(error)}); "
                      "preparing them again.[/yellow]")
        _remove(path)
        return None


def _restore(folder: Path, path: Path) -> PreTrainedModel:
    record = json.loads((path / RECORD).read_text())
    if record.get("format") != FORMAT:
        raise ValueError(f"format {record.get('format')}, not {FORMAT}")
    tensors = load_file(path / WEIGHTS)
    # the skeleton as from_pretrained makes it (config, generation config, tied weights), no weight read
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto", attn_implementation="sdpa", device_map="meta")
    model.eval().requires_grad_(False)
    int8.fuse_gate_up(model)
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module_name, _, field = name.rpartition(".")
        by_module.setdefault(module_name, {})[field] = tensor
    layers = dict(record["layers"])
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                setattr(parent, child_name, _layer(layers.pop(name), by_module.pop(name), child))
    if layers:
        raise ValueError(f"quantized layers the model does not have: {', '.join(list(layers)[:3])}")
    for module_name, fields in by_module.items():
        module = model.get_submodule(module_name)
        for field, tensor in fields.items():
            _put(module, field, tensor)
    empty = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if empty:
        raise ValueError(f"no stored tensor for {', '.join(empty[:3])}")
    model.set_attn_implementation(int8.ATTENTION)
    return model


def _layer(kind: str, state: dict[str, torch.Tensor], linear: nn.Linear) -> nn.Module:
    """The quantized layer of `kind` from its stored state, in place of the skeleton's `linear`."""
    layer = (int4.InvariantInt4Linear.from_state(state, linear.in_features) if kind == "int4"
             else int8.InvariantInt8Linear.from_state(state))
    if (layer.out_features, layer.in_features) != (linear.out_features, linear.in_features):
        raise ValueError(f"a stored layer of shape {layer.out_features}x{layer.in_features} where the model "
                         f"has {linear.out_features}x{linear.in_features}")
    return layer


def _put(module: nn.Module, field: str, tensor: torch.Tensor) -> None:
    """`tensor` as `module`'s parameter or buffer `field` (the skeleton says which)."""
    if field in module._parameters:
        module._parameters[field] = nn.Parameter(tensor, requires_grad=False)
    elif field in module._buffers:
        module._buffers[field] = tensor
    else:
        raise ValueError(f"{type(module).__name__} has no parameter or buffer {field!r}")


# --- Clean ------------------------------------------------------------------------------------------


def clean() -> int:
    """Remove every prepared model (and any temporary left by an interrupted write); returns the bytes freed."""
    size = sum(path.stat().st_size for path in root().rglob("*") if path.is_file()) if root().is_dir() else 0
    _remove(root())
    return size


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
