"""`specdecode export eagle`: a trained EAGLE-3 head as the draft-model folder vLLM or SGLang loads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specdecode.cli.options import TargetOption, console
from specdecode.errors import UserError
from specdecode.models.registry import DEFAULT_TARGET

export_app = typer.Typer(help="Export trained heads in the layout serving engines load.", no_args_is_help=True)


@export_app.command("eagle")
def export_eagle(
    out: Annotated[Path, typer.Argument(metavar="OUT_DIR", help="Folder to write (new or empty).")],
    fmt: Annotated[str, typer.Option("--format", help="The engine to load it: vllm or sglang.")],
    head: Annotated[Path | None, typer.Option(
        help="An EAGLE-3 head folder (`specdecode train eagle3`; default: the one shipped for --target).")] = None,
    target: TargetOption = DEFAULT_TARGET,
) -> None:
    """Write an EAGLE-3 head for TARGET as the draft-model folder vLLM or SGLang loads (LlamaForCausalLMEagle3,
    with the target's LM head rows of its draft vocabulary), and print how to serve it."""
    from specdecode.drafters.heads import ships
    from specdecode.models.registry import registered_models
    from specdecode.training.export import FILE_LIMIT, check_destination, export_eagle3, serve_commands

    known = check_destination(fmt, out)  # before anything loads
    if head is not None and not head.is_dir():
        raise UserError(f"no such folder: {head}")
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
    for name in exported.oversize:
        console.print(f"[yellow]note:[/] {name} holds one tensor of over {FILE_LIMIT / 1e6:.0f} MB, more than the "
                      "repository takes in a file: keep this folder out of git")
    engine_target = f"<the Hugging Face id of {target}>" if target in registered_models() else target
    print(serve_commands(engine_target, out, fmt))
