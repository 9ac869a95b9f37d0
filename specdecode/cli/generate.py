"""`specdecode generate`, `specdecode demo` and `specdecode methods`: one method on one prompt, every method
side by side, the list of methods."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from specdecode.cli.options import (
    Backend, BackendOption, BudgetOption, ChoicesOption, DatastoreOption, DeviceOption, DraftDType, DraftDTypeOption,
    DrafterOption, DType, DTypeOption, HeadOption, MethodName, ReferenceOption, TargetOption, TreeOption,
    backend_device, console, read_reference)
from specdecode.methods import METHODS
from specdecode.models.registry import DEFAULT_DRAFTER, DEFAULT_TARGET
from specdecode.tables import compact_table

if TYPE_CHECKING:
    from specdecode.constraints import Constraint


def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    method: Annotated[MethodName, typer.Option(help=(
        "Decoding method (`specdecode methods`). The default, auto, composes what the loaded models allow "
        "(prompt lookup, the suffix cache, one trained head of the target, the draft model as a fallback) and asks "
        "each only while it pays."
    ))] = MethodName("auto"),
    max_new_tokens: Annotated[int, typer.Option(min=1, max=1 << 20, help="Tokens to generate at most.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, max=100.0, help="0 means greedy decoding.")] = 0.0,
    top_k: Annotated[int, typer.Option(min=0, help="Keep the k likeliest tokens (0: off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    seed: Annotated[int | None, typer.Option(help=(
        "Seed for sampling: reproduces ar's sampled output, and a speculative method's where its drafts do not "
        "follow timings (docs/verification.md, Randomness); else the same distribution, not the same tokens."))] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    dtype: DTypeOption = DType("auto"),
    draft_dtype: DraftDTypeOption = DraftDType("auto"),
    backend: BackendOption = Backend("torch"),
    device: DeviceOption = "auto",
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text and a table.")] = False,
    tree: TreeOption = False,
    budget: BudgetOption = None,
    choices: ChoicesOption = None,
    datastore: DatastoreOption = None,
    reference: ReferenceOption = None,
    head: HeadOption = None,
    target: TargetOption = DEFAULT_TARGET,
    drafter: DrafterOption = DEFAULT_DRAFTER,
    json_schema: Annotated[Path | None, typer.Option(
        "--json-schema", help="A JSON Schema file: the output is JSON that validates against it.")] = None,
    regex: Annotated[str | None, typer.Option(help="The output matches this regular expression whole.")] = None,
    grammar: Annotated[Path | None, typer.Option(
        help="A Lark grammar file: the output is in its language (its start rule).")] = None,
) -> None:
    """Generate a continuation of PROMPT with one method and print it with its statistics. With --json-schema,
    --regex or --grammar the output is constrained (losslessly under every method: docs, Structured output)."""
    from specdecode.api import load_models
    from specdecode.engine import GenerationConfig
    from specdecode.methods import choose, parse_choices
    from specdecode.types import SamplingParams

    constraint = read_constraint(json_schema, regex, grammar)  # before any model loads
    choice = choose(method.value, tree=tree, budget=budget, choices=parse_choices(choices) if choices else None,
                    datastore=datastore, reference=read_reference(reference), head=head)
    choice.check_backend(backend.value)
    needs_draft = choice.loads_draft_model(target, backend.value)
    models = load_models(target, drafter if needs_draft else None, dtype=dtype.value, draft_dtype=draft_dtype.value,
                         backend=backend.value, device=backend_device(backend, device))
    if dtype.value == "auto" and backend.value == "torch":  # the path a quantized target runs is another model
        console.print(f"target path: {models.target.precision} (--dtype auto: the fastest here; --dtype float32 or "
                      "bfloat16 keeps the float model)", highlight=False)
    ids = models.encode(prompt, chat=chat)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        stop=tuple(stop or ()),
        seed=seed,
        constraint=constraint,
    )
    engine = models.engine_for(choice)
    if as_json:
        result = engine.generate(ids, config)
        print(json.dumps({**result.summary(), "precision": models.target.precision}))
    else:
        result = engine.generate(ids, config, on_step=lambda event: print(event.text, end="", flush=True))
        print()
        from specdecode.demo import stats_table

        console.print(stats_table([result.summary()]))
    if len(ids) + len(result.token_ids) >= models.target.max_context and len(result.token_ids) < max_new_tokens:
        console.print(f"[yellow]the output stopped at the model's context of {models.target.max_context} tokens "
                      f"(the prompt's {len(ids)} and {len(result.token_ids)} new), short of --max-new-tokens "
                      f"{max_new_tokens}[/yellow]")




def read_constraint(json_schema: Path | None, regex: str | None, grammar: Path | None) -> Constraint | None:
    """The constraint the options ask for (one at most), read and checked; a UserError for a file that is not
    there or a schema, expression or grammar the grammar engine refuses."""
    from specdecode.constraints import Constraint
    from specdecode.errors import UserError

    given = [name for name, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
             if value is not None]
    if len(given) > 1:
        raise UserError(f"give one constraint, not {' and '.join(given)}")

    def text(path: Path) -> str:
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"cannot read {path}: {error}") from None

    if json_schema is not None:
        return Constraint.json_schema(text(json_schema))
    if grammar is not None:
        return Constraint.grammar(text(grammar))
    return Constraint.regex(regex) if regex is not None else None


def demo(
    max_new_tokens: Annotated[int, typer.Option(min=1, max=4096, help="Tokens per answer.")] = 96,
    dtype: DTypeOption = DType("auto"),
    draft_dtype: DraftDTypeOption = DraftDType("auto"),
    device: DeviceOption = "auto",
    target: TargetOption = DEFAULT_TARGET,
    drafter: DrafterOption = DEFAULT_DRAFTER,
) -> None:
    """Side by side on the default models: every method answers the same prompts; text, speed, speedup."""
    from specdecode.demo import run_demo

    run_demo(target=target, drafter=drafter, dtype=dtype.value, draft_dtype=draft_dtype.value,
             max_new_tokens=max_new_tokens, device=device)




def list_methods(
    as_json: Annotated[bool, typer.Option("--json", help="Print every method's registry entry as JSON.")] = False,
) -> None:
    """List the decoding methods."""
    if as_json:
        print(json.dumps([dataclasses.asdict(m) for m in METHODS.values()], indent=1))
        return
    Console().print(methods_table())
    Console().print(f"auto here: {auto_here()}", highlight=False)


def auto_here(target: str = DEFAULT_TARGET, drafter: str | None = DEFAULT_DRAFTER) -> str:
    """What `auto` is made of on this machine with the default models (as `drafters.auto` composes it: one shipped
    head on torch, the first of medusa and eagle3 that ships, as `drafters.auto.shipped_kind` picks it; the draft model
    only where no head drafts), read from the package's files without loading a model or importing torch."""
    from pathlib import Path

    from specdecode.models.dtype_choice import cached_choice
    from specdecode.models.registry import get_model

    folder = Path(__file__).resolve().parents[1] / "heads" / get_model(target).name
    kind = next((kind for kind in ("medusa", "eagle3") if (folder / kind / f"{kind}.json").is_file()), None)
    copies = "prompt lookup, the suffix cache"
    fallback = f" and the draft model {drafter}" if drafter else ""
    on_torch = (f"{copies} and the {kind} head's tree (it ships for {target}; the draft model is not loaded)" if kind
                else f"{copies}{fallback}")
    path = cached_choice(get_model(target).name)
    where = (f"; the target's path here: {path} (--dtype auto's choice)" if path else
             "; the target's path: --dtype auto times the candidates at the first load")
    batch = ("; served on torch, several requests in one batch, without the draft model"
             + (f" ({kind} drafting for all of them in one call)" if kind else ""))
    return f"on torch, {on_torch}; on llama.cpp, {copies}{fallback}{batch}{where}"


def methods_table() -> Table:
    """The methods, one row each: short flag columns and the description, the only column that wraps."""
    table = compact_table({
        "draft": "needs a draft model (same: with the target's tokenizer; any: any tokenizer, its chain drafts "
                 "translated through text; if loaded: uses one where it is loaded)",
        "tree": "has a token-tree form (--tree, or NAME-tree)",
        "lossless": "the output follows the target's distribution exactly (NO: lossy)",
        "batch": "served, decoded in one batch with other requests (auto without its draft-model fallback); no: "
                 "runs alone, by turns with the batch",
        "--json": "every field of the registry",
    }, leading=1)
    table.add_column("method", no_wrap=True)
    for flag in ("draft", "tree", "lossless", "batch"):
        table.add_column(flag, no_wrap=True)
    table.add_column("description", ratio=1)
    for m in METHODS.values():
        draft = ("any" if m.other_tokenizer else "same") if m.needs_draft_model else (
            "if loaded" if m.uses_draft_model else "no")
        table.add_row(m.name, draft, "yes" if m.tree else "no", "yes" if m.lossless else "NO",
                      "yes" if m.batchable else "no", m.summary)
    return table
