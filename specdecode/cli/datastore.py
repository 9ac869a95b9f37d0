"""`specdecode datastore build`: a retrieval datastore from a folder of text files."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer

from specdecode.cli.options import TargetOption
from specdecode.drafters.retrieval.defaults import DEFAULT_MAX_TOKENS, DEFAULT_PATTERN
from specdecode.errors import UserError
from specdecode.models.registry import DEFAULT_TARGET

datastore_app = typer.Typer(help="Build retrieval datastores (for REST-style retrieval drafting).",
                            no_args_is_help=True)


def _load_tokenizer(spec: str):
    """The tokenizer alone of a target given as for --target (a registered name, a .gguf file, a model
    folder or a hub id): building a datastore needs no weights."""
    from transformers import AutoTokenizer

    from specdecode.models.loading import prepare_registered, registered_models

    if spec in registered_models():
        return AutoTokenizer.from_pretrained(prepare_registered(spec))
    path = Path(spec).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():  # a folder holding one .gguf file
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise UserError(f"{path} is not a model folder: no config.json and {len(ggufs)} .gguf files")
        path = ggufs[0]
    if path.is_file() and path.suffix != ".gguf":
        raise UserError(f"{path} is a file but not a .gguf file; pass a .gguf file or a model folder")
    try:
        if path.is_file():
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return AutoTokenizer.from_pretrained(path if path.exists() else spec)  # a model folder or a hub id
    except (OSError, ValueError) as error:
        raise UserError(f"could not load the tokenizer of {spec!r}: {str(error).strip().splitlines()[0]}") from None


@datastore_app.command("build")
def datastore_build(
    corpus_dir: Annotated[Path, typer.Argument(help="Folder of text files to index.")],
    out: Annotated[Path, typer.Argument(help="The datastore file to write (.npz).")],
    pattern: Annotated[str, typer.Option(help="Which files under CORPUS_DIR, as a glob.")] = DEFAULT_PATTERN,
    max_tokens: Annotated[int, typer.Option(
        min=1, help="Refuse corpora of more tokens (sorting takes about 16 bytes a token).")] = DEFAULT_MAX_TOKENS,
    target: TargetOption = DEFAULT_TARGET,
) -> None:
    """Tokenize the files under CORPUS_DIR with the target's tokenizer and index them for --method rest."""
    import resource

    from specdecode.drafters.retrieval import build_datastore

    if not corpus_dir.is_dir():
        raise UserError(f"no such folder: {corpus_dir}")
    if out.is_dir():
        raise UserError(f"{out} is a folder; give the datastore file to write (a .npz path)")
    existing = next(folder for folder in [out.parent, *out.parent.parents] if folder.exists())  # (the rest is made)
    if not existing.is_dir() or not os.access(existing, os.W_OK):  # before the tokenizing, not after it
        raise UserError(f"cannot write {out}: {existing} is no folder this user can write in")
    tokenizer = _load_tokenizer(target)
    start = time.perf_counter()
    datastore = build_datastore(corpus_dir, tokenizer, pattern=pattern, max_tokens=max_tokens)
    datastore.save(out)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    info = datastore.info
    print(f"{out}: {info.tokens:,} tokens from {info.files:,} files, {out.stat().st_size / 1e6:.1f} MB, "
          f"built in {seconds:.1f} s, peak memory {peak / 2**30:.2f} GiB")
