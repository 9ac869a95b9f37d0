"""Equivalence for every lossless method in the registry: greedy speculative output == plain greedy output.

Parameterised over `methods.variant_names()` (chains, trees, fixed-shape trees) less the lossy methods, so
a method is covered the day it is registered. Each is built as the command line and the server build it
(`methods.choose`, then `api.Models.engine_for`) on tiny chat models (float32 Qwen2s, the draft model a
shallower one), with the sources methods draft from: a reference document (to the chain forms) and the
default datastore (a small one in tests, `conftest.small_default_datastore`). The trained methods get
random heads for the tiny target in place of the shipped ones. One engine serves every prompt and length
in turn, as a server keeps one, so what a drafter carries from one sequence to the next is covered too.

Configurations beyond the registry's defaults are in `test_drafter_configurations.py` and in each
drafter's own tests.
"""

from __future__ import annotations

import pytest

from conftest import (
    DEVICE, TOKENS, greedy_runs, random_eagle3_head, random_eagle_head, random_medusa_heads, tiny_chat_qwen2,
    tiny_tokenizer, wrong_device_trap,
)
from specdecode.api import load_models
from specdecode.constraints import Constraint
from specdecode.drafters import heads
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.methods import choose, resolve, variant_names
from specdecode.models import costs
from specdecode.drafters.static_heads import StaticHeadState
from specdecode.drafters.eagle3 import StaticEagle3State
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.models.static import StaticCausalLM
from specdecode.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["the cat sat on the mat and the cat", "a dog and the cat sat on the dog", "the the the"]
LENGTHS = [1, 6, 30]
REFERENCE = "the cat sat on the mat. the dog sat on the cat. a dog and the cat sat on the mat. " * 2
LOSSLESS = [name for name in variant_names() if resolve(name)[0].lossless]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[str]:
    """A tiny chat model three layers deep (EAGLE-3 reads three), and one a layer deep as its draft model
    (cheap enough, on the fixed cost curve, for the draft model's chain to draft at all)."""
    folders = []
    for layers in (3, 1):
        folders.append(tmp_path_factory.mktemp(f"tiny-chat-{layers}"))
        tiny_chat_qwen2(vocab_size=len(TOKENS) + 10, layers=layers).save_pretrained(folders[-1])
        tiny_tokenizer().save_pretrained(folders[-1])
    return list(map(str, folders))


@pytest.fixture(scope="module")
def models(folders):
    """The two models on the dynamic path (transformers' forward, a cache that grows)."""
    return load_models(*folders, dtype="float32", draft_dtype="float32", progress=False, device=DEVICE, static=False)


@pytest.fixture(scope="module")
def static_models(folders):
    """The same two models on the static path (`models.static`: CUDA graphs on a GPU, the same step run
    eagerly elsewhere)."""
    models = load_models(*folders, dtype="float32", draft_dtype="float32", progress=False, device=DEVICE, static=True)
    assert isinstance(models.target, StaticCausalLM) and isinstance(models.draft, StaticCausalLM)
    return models


@pytest.fixture(scope="module")
def plain(models) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, plain greedy continuations) on the tiny target."""
    prompts = [models.encode(text) for text in PROMPTS]
    engine = SpeculativeEngine(models.target, models.tokenizer)
    return prompts, [engine.generate(p, GenerationConfig(max_new_tokens=max(LENGTHS))).token_ids for p in prompts]


@pytest.fixture(scope="module")
def random_heads(models, tmp_path_factory):
    """A folder of random trained heads for the tiny target, laid out as the shipped ones are."""
    folder = tmp_path_factory.mktemp("heads")
    target = models.target.model
    random_eagle_head(target).save(folder / "eagle", {})
    random_eagle3_head(target).save(folder / "eagle3", {})
    random_medusa_heads(target, scale=0.5).save(folder / "medusa", {})
    return folder


@pytest.mark.parametrize("variant", LOSSLESS)
def test_greedy_output_is_plain_decoding(variant, models, plain, random_heads, monkeypatch):
    monkeypatch.setattr(heads, "shipped_head", lambda model, kind: random_heads / kind)
    reference = None if "-tree" in variant else REFERENCE  # (pld's tree form refuses one)
    engine = models.engine_for(choose(variant, reference=reference, only_if_taken=True))
    assert engine.method == variant and (engine.drafter is None) == (variant == "ar")
    prompts, references = plain
    list(greedy_runs(engine, prompts, references, LENGTHS))  # each run is checked as it comes


@pytest.mark.parametrize("variant", LOSSLESS)
def test_the_static_path_outputs_what_the_dynamic_path_does(variant, static_models, plain, random_heads,
                                                             monkeypatch):
    """Every method on the static-shape path (the target, the draft model and the EAGLE heads on fixed widths,
    Medusa's heads through the target's runner; the methods that share the target's cache on its dynamic twin):
    greedy output is the dynamic path's plain decoding, token for token, in float32."""
    monkeypatch.setattr(heads, "shipped_head", lambda model, kind: random_heads / kind)
    reference = None if "-tree" in variant else REFERENCE
    engine = static_models.engine_for(choose(variant, reference=reference, only_if_taken=True))
    shares = resolve(variant)[0].shares_target_cache
    assert isinstance(engine.target, StaticCausalLM) != shares
    if variant.startswith("eagle"):
        static_state = StaticEagle3State if variant.startswith("eagle3") else StaticHeadState
        assert isinstance(engine.drafter.state, static_state)  # type: ignore[union-attr]
    if variant.startswith("medusa"):
        assert isinstance(engine.drafter, MedusaDrafter) and engine.drafter.runner is not None
    prompts, references = plain
    list(greedy_runs(engine, prompts, references, LENGTHS))


@pytest.mark.parametrize("variant", variant_names())
def test_no_tensor_lands_on_the_wrong_device(variant, models, plain, random_heads, monkeypatch):
    """Every method, greedy and sampled, with every tensor its engine and drafter create without naming a
    device sent to `meta` (`conftest.wrong_device_trap`): a tensor built on the host where the model's
    device was meant fails here on the CPU as it would on a GPU. Greedy output is still plain decoding's."""
    monkeypatch.setattr(heads, "shipped_head", lambda model, kind: random_heads / kind)
    reference = None if "-tree" in variant else REFERENCE
    engine = models.engine_for(choose(variant, reference=reference, only_if_taken=True))
    prompts, references = plain
    sampled = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=0.8, top_p=0.9), seed=1)
    held_open = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(min_tokens=6))
    constrained = GenerationConfig(max_new_tokens=12, constraint=Constraint.regex(r"(the|a) (cat|dog) sat on the mat"))
    with wrong_device_trap():
        greedy = engine.generate(prompts[0], GenerationConfig(max_new_tokens=12))
        engine.generate(prompts[1], sampled)
        engine.generate(prompts[1], held_open)  # (min_tokens: the rows held open)
        engine.generate(prompts[0], constrained)  # (a forced run, a tree hung from it)
    if resolve(variant)[0].lossless:
        assert greedy.token_ids == references[0][:12]


@pytest.mark.parametrize("variant", LOSSLESS)
def test_greedy_output_is_plain_decoding_after_a_chunked_prefill(variant, models, random_heads, monkeypatch):
    """The same with the prompts (about 30 tokens) fed five tokens a forward before the first step
    (`engine.prompts.prefill`), plain decoding's fed whole. (That the heads get the prompt's hidden states
    as before: `exact/test_prefill_chunks.py`.)"""
    monkeypatch.setattr(heads, "shipped_head", lambda model, kind: random_heads / kind)
    prompts = [models.encode(" ".join([text] * 3)) for text in PROMPTS[:2]]
    assert all(len(p) > costs.MIN_CHUNK for p in prompts)  # long enough to be chunked
    plain = SpeculativeEngine(models.target, models.tokenizer)
    references = [plain.generate(p, GenerationConfig(max_new_tokens=max(LENGTHS))).token_ids for p in prompts]
    reference = None if "-tree" in variant else REFERENCE
    engine = models.engine_for(choose(variant, reference=reference, only_if_taken=True))
    engine.prefill_chunk = 5
    list(greedy_runs(engine, prompts, references, LENGTHS[1:]))


def test_every_lossless_method_is_here():
    """Every method is lossless but the ones that say otherwise; none is left out."""
    assert {resolve(name)[0].name for name in LOSSLESS} == {
        resolve(name)[0].name for name in variant_names() if resolve(name)[0].lossless}
    assert {"ar", "draft-tree-fixed", "eagle3-tree", "suffix-tree"} <= set(LOSSLESS)
    assert "medusa-typical" not in LOSSLESS


# methods whose drafts under sampling come with the distributions they were drawn from: verified by speculative
# sampling, their sampled answer is their own (docs/verification.md, "Randomness")
DRAWN = {"draft", "layerskip", "earlyexit", "sparse-kv"}  # the draft model's chain and the self-speculative ones
# nothing drafted on these tiny models (no draft of theirs pays): here plain decoding against itself; the two drafters
# are held to plain greedy output where they draft in reference_vs_fast/test_self_speculative.py and test_sparse_kv.py
SILENT = {"ar", "earlyexit", "sparse-kv"}


@pytest.mark.parametrize("variant", LOSSLESS)
def test_a_seed_gives_plain_decodings_sampled_answer(variant, models, plain, random_heads, monkeypatch):
    """Under sampling with a seed, a method whose drafts carry no distributions (copies, tries, a head's top-k)
    outputs plain decoding's sampled answer token for token, whatever it drafted (each output position's uniform
    decides its token: `sampling`); the methods of DRAWN draft with distributions, which speculative sampling
    verifies."""
    monkeypatch.setattr(heads, "shipped_head", lambda model, kind: random_heads / kind)
    reference = None if "-tree" in variant else REFERENCE
    engine = models.engine_for(choose(variant, reference=reference, only_if_taken=True))
    verifier, with_probs, drafted = engine.verifier, [], []

    def recording(rows, draft, *args, **kwargs):
        with_probs.append(draft.probs is not None)
        drafted.append(len(draft))
        return verifier(rows, draft, *args, **kwargs)

    engine.verifier = recording
    plain_engine = SpeculativeEngine(models.target, models.tokenizer)
    prompts, _ = plain
    for i, prompt in enumerate(prompts):
        config = GenerationConfig(max_new_tokens=max(LENGTHS), seed=7 + i,
                                  sampling=SamplingParams(temperature=0.9, top_p=0.95))
        answer = engine.generate(prompt, config).token_ids
        if variant not in DRAWN:
            assert answer == plain_engine.generate(prompt, config).token_ids, f"prompt {i}"
    assert (sum(drafted) > 0) == (variant not in SILENT)
    assert any(with_probs) == (variant in DRAWN - SILENT)
