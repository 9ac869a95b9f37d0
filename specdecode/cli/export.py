"""`specdecode export eagle`: a trained EAGLE-3 head as the draft-model folder vLLM or SGLang loads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specdecode.cli.options import console
from specdecode.errors import UserError
from specdecode.models.registry import DEFAULT_TARGET, registered_models

export_app = typer.Typer(help="Export trained heads in the layout serving engines load.", no_args_is_help=True)


@export_app.command("eagle")
def export_eagle(
    out: Annotated[Path, typer.Argument(metavar="OUT_DIR", help="Folder to write (new or empty).")],
    fmt: Annotated[str, typer.Option("--format", help="The engine to load it: vllm or sglang.")],
    head: Annotated[Path | None, typer.Option(
        help="An EAGLE-3 head folder (`specdecode train eagle3`; default: the one shipped for --target).")] = None,
    target: Annotated[str | None, typer.Option(help=(
        "Target model: registered name, .gguf file, folder or hub id (default: the --head's own, as its record "
        f"names it; without --head, {DEFAULT_TARGET})."))] = None,
) -> None:
    """Write an EAGLE-3 head for TARGET as the draft-model folder vLLM or SGLang loads (LlamaForCausalLMEagle3,
    with the target's LM head rows of its draft vocabulary), and print how to serve it."""
    from specdecode.drafters.heads import RECORDS, kind_of, ships
    from specdecode.training.export import FILE_LIMIT, check_destination, export_eagle3, serve_commands

    known = check_destination(fmt, out)  # before anything loads
    if head is not None and not head.is_dir():
        raise UserError(f"no such folder: {head}")
    if head is not None and any((head / RECORDS[kind]).is_file() for kind in ("eagle", "medusa")):
        raise UserError(f"{head} holds {kind_of(head)} heads; the engines load EAGLE-3 heads (`specdecode train "
                        "eagle3 --out DIR`)")
    if head is not None:
        target = head_target(head, target)
    target = target or DEFAULT_TARGET
    if head is None and not ships(target, "eagle3"):
        raise UserError(f"no EAGLE-3 head ships for {target}: train one (`specdecode train eagle3 --target ... --out "
                        "DIR`) and give it with --head DIR")

    from specdecode.api import load_models
    from specdecode.drafters.eagle3 import load_shipped
    from specdecode.drafters.eagle3_head import Eagle3Head
    from specdecode.models.hf import torch_target

    eagle3_head, _ = Eagle3Head.load(head) if head is not None else load_shipped(target)
    config = eagle3_head.config.to_dict()
    model = torch_target(load_models(target, None, dtype="float32", progress=True).target, "exporting a head").model
    layers = model.config.num_hidden_layers
    if any(i >= layers for i in config.get("aux_layers") or ()):  # the engines capture a decoder layer's input
        raise UserError(f"the head reads layers {list(config['aux_layers'])} but {target} has {layers}: is this "
                        "the head's target?")
    exported = export_eagle3(eagle3_head.state_dict(), config, model.get_output_embeddings().weight, None, out,
                             known)  # no embedding: both engines share the target's
    console.print(f"wrote {out}: config.json, {', '.join(exported.files)}")
    if head is not None and (head / "checkpoint.pt").is_file():  # (`specdecode train ... --seconds` ran out first)
        console.print(f"[yellow]note:[/] {head} holds a run cut short (checkpoint.pt): this is the head so far; the "
                      "training command carries on from it")
    for name in exported.oversize:
        console.print(f"[yellow]note:[/] {name} holds one tensor of over {FILE_LIMIT / 1e6:.0f} MB, more than the "
                      "repository takes in a file: keep this folder out of git")
    engine_target = f"<the Hugging Face id of {target}>" if target in registered_models() else target
    print(serve_commands(engine_target, out, fmt))


def head_target(head: Path, target: str | None) -> str | None:
    """The target to export a head for: `target`, else the one the head's record names (the LM head rows baked in
    are that model's); a UserError where both are given and differ (the rows would be another model's)."""
    from specdecode.drafters.eagle3_head import CONFIG
    from specdecode.paths import read_record

    if not (head / CONFIG).is_file():
        return target  # (Eagle3Head.load says what the folder lacks)
    recorded = read_record(head / CONFIG, "an EAGLE-3 head's record", "train it again").get("target")
    if target is None or recorded is None:
        return target or recorded
    if same_model(target, recorded) or not (recorded in registered_models() or Path(recorded).expanduser().exists()):
        return target  # (a head trained for a folder since moved: the --target given)
    raise UserError(f"the head in {head} was trained for {recorded}, not {target}: its draft vocabulary's LM head "
                    "rows would be another model's (leave --target out to export it for its own)")


def same_model(a: str, b: str) -> bool:
    """Whether two names of a model (a registered name, a path as typed) name the same one."""
    paths = [Path(name).expanduser().resolve() if Path(name).expanduser().exists() else name for name in (a, b)]
    return paths[0] == paths[1]
