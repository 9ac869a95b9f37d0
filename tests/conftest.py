"""Shared fixtures: tiny randomly initialised Qwen2 models (the real architecture, no download)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specdecode.drafters import auto
from specdecode.drafters.composite import CompositeDrafter, Source
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.eagle_head import EagleHead, head_config
from specdecode.drafters.eagle3_head import Eagle3Config, Eagle3Head
from specdecode.drafters.medusa import MedusaDrafter, MedusaHeads
from specdecode.drafters.options import DrafterOptions
from specdecode.models import costs
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM

# A draft model's prices the tests choose (they time nothing): a draft forward at 0.4 of a target forward,
# verification width nearly free. Adaptive drafting weighs a draft by them; the methods measure them
# (`DraftModelDrafter.for_models`).
DRAFT_PRICES = {"draft_cost": 0.4, "curve": CostCurve.linear(0.03)}
# a GPU's shape of cost: a verification of 16 tokens 1.1x a one-token forward
FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.4))

VOCAB = 97
REAL_MEASURE = costs.measure  # before the session's fixture fixes every curve (`fixed_measure`)
DEVICE = torch.device("cpu")  # where the tiny models live: `pytest --device cuda` (set in pytest_configure)
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def benchmark_script(name: str):
    """benchmarks/<name>.py loaded as a module (the scripts are no package), for a test of its functions."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="where the tiny models run (cpu, cuda, cuda:N, mps); tests marked cpu_only skip elsewhere")
    parser.addoption("--no-skips", action="store_true",
                     help="fail the run if any test skipped (`make test`: what the set-up does not bring is behind a "
                          "marker that the run deselects, never a skip)")


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if session.config.getoption("--no-skips") and skipped and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = len(terminalreporter.stats.get("skipped", []))
    if config.getoption("--no-skips") and skipped:
        terminalreporter.write_line(f"--no-skips: {skipped} test(s) skipped, which fails the run: each must run or "
                                    "sit behind a marker the run deselects", red=True)


def pytest_configure(config):
    global DEVICE
    from specdecode import devices

    DEVICE = devices.resolve(config.getoption("--device"))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs a worker a core: two threads each would contend
        torch.set_num_threads(1)
    # the console folds what it prints at 80 columns where stderr is no terminal, a long path mid-word; tests
    # match messages holding temporary paths, whose length differs from run to run (a worker's are longer)
    os.environ["COLUMNS"] = "250"
    if DEVICE.type == "cuda":  # float32 means float32: exactness is checked without TF32's rounding
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def pytest_collection_modifyitems(config, items):
    # the real-model files first, then the statistical ones (thousands of runs a case, a minute or two a file), then
    # the rest: with a worker a core (`make test`, a file at a time) the longest files start early, and none starts
    # last to run on alone while the other worker idles
    items.sort(key=lambda item: ("slow" not in item.keywords, item.path.parent.name != "statistical"))
    if DEVICE.type == "cpu":
        return
    skip = pytest.mark.skip(reason=f"CPU only (int8/int4 kernels, llama.cpp, real models); running on {DEVICE}")
    for item in items:
        if "cpu_only" in item.keywords or "slow" in item.keywords or "peers" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def wrong_device_trap():
    """Inside, a tensor created without naming its device lands on `meta`, where it has no values: it fails
    the moment it meets a real tensor or is read on the host. The models still run on the CPU (transformers'
    own forward runs with the CPU as the default), so what fails is the engine's and the drafters' own code:
    a tensor it built on the host for a model that, on a GPU, would be elsewhere. Host data must say
    device="cpu"; device data takes the model's device."""
    from transformers import PreTrainedModel

    def call_on_the_models_device(self, *args, **kwargs):
        with torch.device(self.device):
            return torch.nn.Module.__call__(self, *args, **kwargs)

    def step_on_the_host(self, *args, **kwargs):  # torch's optimisers keep their step counts on the host
        with torch.device("cpu"):
            return adamw_step(self, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(PreTrainedModel, "__call__", call_on_the_models_device, raising=False)
    adamw_step = torch.optim.AdamW.step  # (the online head's optimiser)
    patch.setattr(torch.optim.AdamW, "step", step_on_the_host)
    try:
        with torch.device("meta"):
            yield
    finally:
        patch.undo()


def tiny_qwen2(
    seed: int, layers: int = 2, hidden: int = 64, vocab: int = VOCAB, dtype=torch.float32, max_positions: int = 512
) -> Qwen2ForCausalLM:
    """A tiny Qwen2 with peaky enough logits that greedy continuations are varied but not degenerate."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # larger output weights make the distributions less flat
        model.lm_head.weight.mul_(8.0)
    model.to(DEVICE)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


def tiny_architecture(kind: str):
    """A tiny random float32 model, on the CPU, of a Llama-family architecture the lean and static paths write out:
    "qwen2" (`tiny_qwen2`), "llama" (biased attention), "llama-mlp-bias" (unbiased attention, biased MLP), "mistral"
    or "qwen3" (per-head query and key norms)."""
    from transformers import (
        LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    )

    torch.manual_seed(7)
    if kind == "qwen2":
        return tiny_qwen2(seed=7, layers=3).cpu()
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES, attention_bias=True)).eval()
    if kind == "llama-mlp-bias":
        return LlamaForCausalLM(LlamaConfig(**SIZES, mlp_bias=True)).eval()
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=16)).eval()
    return MistralForCausalLM(MistralConfig(**SIZES, sliding_window=None)).eval()


def noisy_copy(model, scale: float, seed: int):
    """A copy of `model` with seeded Gaussian noise (scale x each tensor's std) on every weight: a drafter
    that agrees with the model often but not always."""
    import copy

    clone = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * scale * p.std())
    return clone


@pytest.fixture(scope="session", autouse=True)
def small_default_datastore(tmp_path_factory):
    """The default retrieval datastore (the standard library) is built, in tests, from one small stdlib
    package into a temporary folder: the real one takes a minute and lives in the user's cache."""
    import json as some_package
    import shutil

    from specdecode.drafters.retrieval import build

    library = tmp_path_factory.mktemp("stdlib")
    shutil.copytree(Path(some_package.__file__).parent, library / "json")
    stores = tmp_path_factory.mktemp("datastores")
    patch = pytest.MonkeyPatch()
    patch.setattr(build, "stdlib_folder", lambda: library)
    original = build.default_datastore_path
    patch.setattr(build, "default_datastore_path", lambda tokenizer: stores / original(tokenizer).name)
    yield stores
    patch.undo()


FIXED_SLOPE = 0.05  # the cost curve every test model gets: width nearly free, as on a bf16-capable CPU


def fixed_measure(model, sizes=None, *args, **kwargs):
    """A cost curve for tests that no clock decides: a forward over n tokens costs 1 + 0.05 (n - 1), and a
    one-token forward's seconds are proportional to the model's weight bytes (so a draft model's relative
    cost is the ratio of the two models' sizes). A measured curve follows how busy the machine is, and
    with it what the gate verifies, which a test must not depend on."""
    curve = costs.CostCurve.linear(FIXED_SLOPE, sizes or costs.SIZES)
    return costs.CostCurve(curve.sizes, curve.relative, seconds=model.weight_bytes_per_token * 1e-11)


@pytest.fixture(scope="session", autouse=True)
def cost_curves_in_a_temporary_folder(tmp_path_factory):
    """Test models get fixed cost curves (`fixed_measure`), cached in a temporary folder, not the user's
    cache; tests of measurement itself ask for `real_measure`."""
    from specdecode.models.base import CausalLM

    folder = tmp_path_factory.mktemp("costs")
    patch = pytest.MonkeyPatch()
    patch.setattr(costs, "cache_root", lambda: folder)
    patch.setattr(costs, "measure", fixed_measure)
    # the fixed curve as it is: not a LiveCurve, which would follow the timings of the test's forwards
    patch.setattr(CausalLM, "cost_curve", lambda self: costs.cached(self, self.cost_key))
    yield folder
    patch.undo()


@pytest.fixture(scope="session", autouse=True)
def layer_searches_in_a_temporary_folder(tmp_path_factory):
    """Self-speculation's layer searches (layerskip, early-exit) cache their results in a temporary folder,
    not the user's (a test may still name its own)."""
    from specdecode.drafters.self_speculative import search

    folder = tmp_path_factory.mktemp("layerskip")
    cache_path = search.cache_path
    patch = pytest.MonkeyPatch()

    def temporary(*args):  # a folder the caller names, or the test's own SPECDECODE_CACHE, else the session's
        named = args[5] if len(args) > 5 else None
        return cache_path(*args[:5], named or (None if os.environ.get("SPECDECODE_CACHE") else folder))

    patch.setattr(search, "cache_path", temporary)
    yield folder
    patch.undo()


@pytest.fixture(scope="session", autouse=True)
def prepared_weights_in_a_temporary_folder(tmp_path_factory):
    """Test models quantized at int8 or int4 are kept (`models.prepared`) in a temporary folder, not the
    user's cache; the registered models (folders in the user's cache) keep the user's, as a run of theirs
    would, and a test that sets SPECDECODE_CACHE gets its own."""
    from specdecode.models import digests, prepared
    from specdecode.paths import cache_dir

    folder = tmp_path_factory.mktemp("prepared")
    entry = prepared.entry
    store = digests.store
    patch = pytest.MonkeyPatch()
    # the files' digests likewise (`models.digests`): the session's, or the test's own SPECDECODE_CACHE's
    patch.setattr(digests, "store", lambda: store() if os.environ.get("SPECDECODE_CACHE") else folder / "digests.json")

    def temporary(model_folder, bits):
        own = entry(model_folder, bits)
        users = os.environ.get("SPECDECODE_CACHE") or Path(model_folder).resolve().is_relative_to(cache_dir())
        return own if users else folder / own.name

    patch.setattr(prepared, "entry", temporary)
    yield folder
    patch.undo()


@pytest.fixture
def real_measure(monkeypatch):
    """costs.measure as it is: timing forwards."""
    monkeypatch.setattr(costs, "measure", REAL_MEASURE)
    return REAL_MEASURE


@pytest.fixture(scope="session")
def tiny_target() -> Qwen2ForCausalLM:
    return tiny_qwen2(seed=0, layers=3)


@pytest.fixture(scope="session")
def tiny_drafter() -> Qwen2ForCausalLM:
    return tiny_qwen2(seed=1, layers=1, hidden=32)


@pytest.fixture
def target_lm(tiny_target) -> HFCausalLM:
    return HFCausalLM(tiny_target)


def random_prompts(count: int, seed: int = 0, low: int = 3, high: int = 24, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lengths]


class LetterTokenizer:
    """A stand-in tokenizer for engine tests: token i decodes to one letter (a..z, cycling)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


# --- A tiny tokenizer and model folder, for loading and the command line ---------------------------

BYTE_TOKENS = list(bytes_to_unicode().values())  # the 256 byte-level symbols
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = BYTE_TOKENS + ["".join(pair) for pair in MERGES] + SPECIAL_TOKENS
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(TOKENS[: -len(SPECIAL_TOKENS)])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_chat_qwen2(vocab_size: int, seed: int = 0, layers: int = 2, max_positions: int = 128) -> Qwen2ForCausalLM:
    """A tiny Qwen2 that goes with tiny_tokenizer() (byte-level BPE, chat template, <|im_end|> as EOS)."""
    model = tiny_qwen2(seed, layers=layers, hidden=64, vocab=vocab_size, max_positions=max_positions)
    model.config.eos_token_id = model.generation_config.eos_token_id = TOKENS.index("<|im_end|>")
    return model




def write_tiny_gguf(model: Qwen2ForCausalLM, path) -> None:
    """Write `model` as an F32 GGUF with llama.cpp tensor names and a byte-level BPE tokenizer."""
    import gguf
    import numpy as np

    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    normal, control = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL
    writer.add_token_types([control if token in SPECIAL_TOKENS else normal for token in TOKENS])
    writer.add_token_merges([" ".join(pair) for pair in MERGES])
    writer.add_bos_token_id(TOKENS.index("<|endoftext|>"))
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    writer.add_pad_token_id(TOKENS.index("<|endoftext|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, tensor.float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


QWEN25_TEMPLATE = Path(__file__).parent / "fixtures" / "qwen2.5-chat-template.jinja"  # renders tools, <tool_call>


@pytest.fixture(scope="session")
def tiny_tool_folder(tmp_path_factory: pytest.TempPathFactory):
    """A tiny chat model whose tokenizer has Qwen2.5's own chat template (tools rendered in the system message,
    calls written as `<tool_call>` JSON), with a context long enough for a few tools' definitions."""
    folder = tmp_path_factory.mktemp("tiny-tools")
    tiny_chat_qwen2(vocab_size=len(TOKENS) + 10, max_positions=4096).save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN25_TEMPLATE.read_text()
    tokenizer.save_pretrained(folder)
    return folder


TOOL_MODEL = "tiny-tools"  # the name `tool_servers` serve the tiny tool model under


@pytest.fixture(scope="session")
def tool_servers(tiny_tool_folder):
    """The tiny tool model (`tiny_tool_folder`) served as TOOL_MODEL, by a server per method, each its default
    (lm-eval names no method): {method: base URL ending in /v1}; the clients' tests share them
    (`test_serve_clients.py`, `test_serve_responses.py`)."""
    from specdecode.api import load_models
    from specdecode.serve.app import Server, ServerThread, create_app

    models = load_models(str(tiny_tool_folder), str(tiny_tool_folder), dtype="float32", progress=False)
    running = {m: ServerThread(create_app(Server(models, TOOL_MODEL, default_method=m, methods=[m])))
               for m in ("ar", "auto")}
    yield {m: r.url + "/v1" for m, r in running.items()}
    for r in running.values():
        r.stop()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory):
    """A local model folder: tiny random Qwen2 with more logits rows than tokens, like Qwen2.5."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_chat_qwen2(vocab_size=len(TOKENS) + 10).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def three_layers(tmp_path_factory):
    """A tiny model folder deep enough for EAGLE-3's three layers (no head ships for it)."""
    folder = tmp_path_factory.mktemp("tiny-three")
    tiny_chat_qwen2(vocab_size=len(TOKENS) + 10, layers=3).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and where another job shares the cores two threads contend
    (10-20x slower here); use with `pytestmark = pytest.mark.usefixtures("one_thread")`. The setting is
    restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def greedy_references(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Plain greedy continuations of each prompt from transformers' own generate()."""
    return [model.generate(torch.tensor([p], device=model.device), max_new_tokens=max_new_tokens,
                           do_sample=False)[0, len(p) :].tolist()
            for p in prompts]


def greedy_runs(engine, prompts: list[list[int]], references: list[list[int]], lengths: list[int]):
    """Generate every prompt at every length with `engine` (greedy), checking that each output is plain
    greedy decoding's first n tokens, made in at most n target forwards, with per-step statistics that
    add up to it; yields (prompt index, n, result) for each module's own further checks."""
    from specdecode.engine import GenerationConfig

    for i, prompt in enumerate(prompts):
        for n in lengths:
            result = engine.generate(prompt, GenerationConfig(max_new_tokens=n))
            assert result.token_ids == references[i][:n], f"prompt {i}, {n} tokens"
            assert sum(s.new_tokens for s in result.steps) == len(result.token_ids)
            assert result.target_forwards <= n
            yield i, n, result


def random_medusa_heads(target, num_heads: int = 3, vocab: int | None = None, seed: int = 0,
                        scale: float = 1.0) -> MedusaHeads:
    """Medusa heads with random blocks (`scale` sets how far each head strays from the identity)."""
    torch.manual_seed(seed)
    d = target.config.hidden_size
    heads = MedusaHeads(d, num_heads, torch.arange(target.config.vocab_size)[: vocab or target.config.vocab_size])
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.normal_(0, scale / math.sqrt(d))
    return heads.float().eval().to(target.device)


def watching_head(model, seen: list) -> MedusaDrafter:
    """A Medusa tree drafter (random heads, priced on FLAT) that appends to `seen`, at each verdict, the pending
    tokens it is told of and the rows of hidden states it is handed."""

    class Watching(MedusaDrafter):
        def observe(self, outcome):
            seen.append((outcome.num_pending, outcome.require_hidden().shape[0]))
            super().observe(outcome)

    return Watching(random_medusa_heads(model), model, FLAT, tree=True, top_k=2)


def auto_prototype(model, draft_model=None, curve: CostCurve = FLAT, reads_late: bool = False) -> CompositeDrafter:
    """`auto` as `drafters.auto` composes it where a Medusa head drafts (prompt lookup, the suffix cache, the head
    as the fallback; random heads), priced on `curve`; the draft model beside it when given (which stays out of the
    batch). `reads_late`: the head on a GPU's policy (its tree kept on the device, read with the verdict)."""
    head = MedusaDrafter(random_medusa_heads(model, scale=0.5), model, curve, tree=True, top_k=2, max_nodes=8)
    head.reads_late = reads_late
    sources = [*auto.copy_sources(HFCausalLM(model), DrafterOptions(), curve), Source(head, "expensive")]
    if draft_model is not None:
        sources.append(Source(DraftModelDrafter(HFCausalLM(draft_model), num_tokens=3, **DRAFT_PRICES), "expensive"))
    return auto.compose(sources, curve, final_layer=model.config.num_hidden_layers)


def random_eagle_head(target, vocab: int | None = None, seed: int = 0, intermediate: int = 32) -> EagleHead:
    """An EAGLE head with random weights for `target`, over its first `vocab` tokens (default: all)."""
    torch.manual_seed(seed)
    ids = torch.arange(target.config.vocab_size)[: vocab or target.config.vocab_size]
    return EagleHead(head_config(target.config, intermediate), ids).float().eval().to(target.device)


def oracle_eagle_head(target, prompt: list[int], max_new_tokens: int) -> tuple[EagleHead, list[int]]:
    """(an EAGLE head whose 'prediction' is the target's own next feature, wired in by hand, along the
    target's greedy continuation of `prompt`; that continuation): its drafts are the target's own tokens."""
    reference = greedy_references(target, [prompt], max_new_tokens)[0]
    full = prompt + reference
    with torch.inference_mode():
        truth = target.model(input_ids=torch.tensor([full], device=target.device)).last_hidden_state[0]

    class Oracle(EagleHead):
        def forward(self, features, embeddings, position_ids, attention_mask=None, cache=None):
            return truth[(position_ids[0] + 1).clamp(max=len(full) - 1)][None]  # f_{t+1}, the target's own

    return (Oracle(head_config(target.config, 32), torch.arange(target.config.vocab_size)).eval().to(target.device),
            reference)


def random_eagle3_head(target, vocab: int | None = None, seed: int = 0, intermediate: int = 32) -> Eagle3Head:
    """An EAGLE-3 head with random weights for `target`, over `vocab` of its tokens chosen at random (default: all)."""
    torch.manual_seed(seed)
    size = vocab or target.config.vocab_size
    config = Eagle3Config.for_target(target.config, intermediate, size)
    ids = torch.randperm(target.config.vocab_size)[:size].sort().values
    return Eagle3Head(config, ids).float().eval().to(target.device)


def tiny_training_features(folder: Path):
    """(model, sequences, shards): a tiny chat model's features over repetitive chat text, for training tests."""
    from specdecode.training import corpus, features

    tokenizer, model = tiny_tokenizer(), tiny_chat_qwen2(vocab_size=len(TOKENS), seed=2)
    texts = [("the cat sat on the mat. " * 4, "the mat was red. " * 5), ("one two three. " * 3, "four five six. " * 5)]
    sequences = [corpus.Sequence("sharegpt", *corpus.tokenize(
        tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}], 128))
        for q, a in texts * 6]
    features.extract(model, sequences, folder, {"target": "tiny"}, progress=False)
    return model, sequences, features.load(folder)[1]


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run the `specdecode` command with `args` in-process: (exit code, stdout, stderr)."""
    from specdecode.cli import main

    monkeypatch.setattr(sys, "argv", ["specdecode", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


class Dispatched(TorchDispatchMode):
    """Counts the operations that compute (views left out): on a GPU, about one kernel launch each."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))
