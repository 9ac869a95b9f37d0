"""What the commands share: the console, the choices (methods, dtypes, backends) and the options several
commands take, with their help text."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from specdecode import paths
from specdecode.errors import UserError
from specdecode.methods import takers, variant_names

console = paths.console  # the package's one stderr console (`paths`): messages never folded

if TYPE_CHECKING:  # members computed from the registry are beyond a type checker: to it, a str enum
    class MethodName(StrEnum):
        """A registered method's name (`specdecode.methods.METHODS`), tree forms included (`pld-tree`), as the
        command line takes it."""
else:
    MethodName = StrEnum("MethodName", {name: name for name in variant_names()})


class DType(StrEnum):
    """The target's path (`DTypeOption`)."""

    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"
    int8 = "int8"
    int4 = "int4"


TargetOption = Annotated[str, typer.Option(help="Target model: registered name, .gguf file, folder or hub id.")]
DrafterOption = Annotated[str, typer.Option(help=(
    "Draft model, for draft (its chain also drafts from a model of another tokenizer), composite, and auto where no "
    "head drafts; none: no draft model."))]
DTypeOption = Annotated[DType, typer.Option(help=(
    "Target's path: auto (the fastest here: the model's own forwards timed on each candidate path, once per "
    "machine and model), bfloat16, float16, float32, int8 (int8 weights and per-row int8 activations, computed "
    "row by row so speculation stays exact; not the float model's output), or int4 (4-bit weights, the same exactness, "
    "AVX2 CPUs; its kernel compiles on first use). On a GPU (--device cuda) auto is bfloat16 (float16 where the "
    "GPU lacks it), and int8 and int4, CPU kernels, are refused. Probabilities are always float32."))]
DeviceOption = Annotated[str, typer.Option(help=(
    "Where the torch backend runs: auto (CUDA where torch sees a GPU, else the CPU), cpu, cuda, cuda:N or mps. "
    "The draft model and trained heads follow the target; a seed's draws differ from one kind of device to "
    "another. The llama.cpp backend runs on the CPU."))]


def backend_device(backend, device: str) -> str | None:
    """The device `load_models` gets: the torch backend's; for llama.cpp None, unless one was named."""
    return None if backend.value == "llamacpp" and device == "auto" else device


class DraftDType(StrEnum):
    """The draft model's weights (`DraftDTypeOption`)."""

    auto = "auto"
    int4 = "int4"
    int8 = "int8"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


DraftDTypeOption = Annotated[DraftDType, typer.Option(
    help="Draft model weights: auto (default: int4 where its kernel runs, else int8; on a GPU bfloat16), int4 "
    "(4-bit weights, AVX2 CPUs: the cheapest draft token), int8 (cheaper than bfloat16 on a CPU), bfloat16, "
    "float16 or float32. Lossless whatever it is: the target verifies every token.")]
TreeOption = Annotated[bool, typer.Option(
    "--tree", help="Draft a token tree instead of a chain (methods with a tree form).")]
BudgetOption = Annotated[int | None, typer.Option(
    min=1, max=4096, help="Tree nodes verified per step (default: chosen each step from the measured cost curve).")]


class Backend(StrEnum):
    """Which library runs the models (`BackendOption`)."""

    torch = "torch"
    llamacpp = "llamacpp"


class MemoryScope(StrEnum):
    """Who shares the memory of earlier requests (`specdecode serve --memory-scope`)."""

    tenant = "tenant"
    request = "request"
    server = "server"


class ChunkPolicy(StrEnum):
    """When a long prompt's chunk goes into a step of the batch (`specdecode serve --chunk-policy`,
    `engine.pacing.CHUNK_POLICIES`)."""

    turns = "turns"
    every = "every"


BackendOption = Annotated[Backend, typer.Option(
    help="torch: any transformers model (target's path per --dtype, drafter per --draft-dtype); llamacpp: .gguf "
         "files through llama.cpp.")]
ChoicesOption = Annotated[str | None, typer.Option(
    help="A fixed tree shape for --method draft --tree: JSON choices like [[0],[1],[0,0]], or 'default'.")]
DatastoreOption = Annotated[Path | None, typer.Option(
    help=f"A retrieval datastore for {takers('datastore')} (`specdecode datastore build`; default for rest and "
         "composite: the Python standard library's, built once; auto retrieves only from one given here).")]
HeadOption = Annotated[Path | None, typer.Option(
    help=f"A trained head's folder for {takers('head')} (`specdecode train eagle3|eagle|medusa --out DIR`; its record "
         "must fit the target; default: the head shipped for the default target). A server or benchmark gives it "
         "to the methods of its kind.")]
ReferenceOption = Annotated[Path | None, typer.Option(
    help=f"A document to draft from, for {takers('reference')} (retrieved passages, a file being edited).")]


def read_reference(path: Path | None) -> str | None:
    """The text of the --reference document (None without one)."""
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read the reference document {path}: {error}") from None
    if not text.strip():
        raise UserError(f"the reference document {path} is empty")
    return text
