"""The `specdecode` command: one module per command or group of commands.

- `options`: the console, the choices and the options several commands share
- `generate`: `generate`, `demo`, `methods`
- `bench`: `bench`
- `serve`: `serve`
- `datastore`: `datastore build`
- `train`: `train data`, `train eagle`, `train eagle3`, `train medusa`
- `export`: `export eagle`
- `models`: `models fetch`, `models list`, `models clean`
"""

from __future__ import annotations

import signal
import sys
from typing import Annotated

import typer
from rich.markup import escape

from specdecode.cli import bench, datastore, export, generate, serve, train
from specdecode.cli.options import console
from specdecode.errors import UserError
from specdecode.cli import models as model_commands

app = typer.Typer(
    help="Speculative decoding for large language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        print(f"specdecode {version('specdecode')}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False) -> None:
    """Speculative decoding for large language models."""


app.add_typer(model_commands.app, name="models")
app.command()(generate.generate)
app.command()(generate.demo)
app.command()(bench.bench)
app.command()(serve.serve)
app.command("methods")(generate.list_methods)
app.add_typer(datastore.datastore_app, name="datastore")
app.add_typer(train.train_app, name="train")
app.add_typer(export.export_app, name="export")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # `kill` ends a command as Ctrl-C does, so long jobs (`train data`, feature extraction) keep what they
    # finished: their `finally` blocks write the manifests and the pending features (the server installs its own)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        app()
    except UserError as error:
        # as written ("[ray]" too), and on one line whatever the width: a path in it stays whole to copy or grep
        console.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
