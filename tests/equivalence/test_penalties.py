"""Equivalence under penalties and biases: for every lossless method, greedy speculation with a repetition,
frequency and presence penalty and a logit bias == greedy plain decoding under the same, token for token.

Each drafted position's logits are penalised by the tokens before it, drafted ones included
(`engine.penalties`), so a draft the penalties would have changed is turned down where plain decoding would
have gone elsewhere. Built as `test_every_method.py` builds its engines (its tiny chat models, its random heads);
the batch engine is held to the same, several sequences of different penalties side by side.
"""

from __future__ import annotations

import pytest

from conftest import greedy_runs
from test_every_method import LOSSLESS, PROMPTS, REFERENCE, folders, models, random_heads  # noqa: F401  (fixtures)
from specdecode.drafters import heads
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine.batch import BatchEngine
from specdecode.methods import choose
from specdecode.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [6, 30]
PENALTIES = {  # name: the greedy sampling parameters
    "repetition": SamplingParams(repetition_penalty=1.8),
    "frequency+presence+bias": SamplingParams(frequency_penalty=1.5, presence_penalty=0.7,
                                              logit_bias=((5, 3.0), (40, -100.0))),
    "all": SamplingParams(repetition_penalty=1.3, frequency_penalty=-0.5, presence_penalty=1.0,
                          logit_bias=((33, 2.0),)),
}


def plain_outputs(loaded, params: SamplingParams, prompts: list[list[int]]) -> list[list[int]]:
    engine = SpeculativeEngine(loaded.target, loaded.tokenizer)
    return [engine.generate(p, GenerationConfig(max_new_tokens=max(LENGTHS), sampling=params)).token_ids
            for p in prompts]


@pytest.fixture(scope="module")
def references(models):  # noqa: F811  (imported fixture)
    """(prompts, {penalty: plain greedy continuations under it})."""
    prompts = [models.encode(text) for text in PROMPTS]
    return prompts, {name: plain_outputs(models, params, prompts) for name, params in PENALTIES.items()}


def test_the_penalties_change_plain_decoding(models, references):  # noqa: F811  (imported fixture)
    """Else the cases below would test nothing."""
    prompts, outputs = references
    free = plain_outputs(models, SamplingParams(), prompts)
    for name, output in outputs.items():
        assert output != free, name


def method_engine(loaded, variant: str, head_folder, monkeypatch) -> SpeculativeEngine:
    """The method's engine as `test_every_method.py` builds it (its random heads as the shipped ones)."""
    monkeypatch.setattr(heads, "shipped_head", lambda model, kind: head_folder / kind)
    reference = None if "-tree" in variant else REFERENCE
    return loaded.engine_for(choose(variant, reference=reference, only_if_taken=True))


@pytest.mark.parametrize("variant", LOSSLESS)
def test_greedy_output_under_penalties_is_plain_decoding(variant, models, references,  # noqa: F811  (imported
                                                         random_heads, monkeypatch):  # noqa: F811  fixtures)
    engine = method_engine(models, variant, random_heads, monkeypatch)
    prompts, outputs = references
    for name, params in PENALTIES.items():
        for i, prompt in enumerate(prompts):
            for n in LENGTHS:
                result = engine.generate(prompt, GenerationConfig(max_new_tokens=n, sampling=params))
                assert result.token_ids == outputs[name][i][:n], (name, i, n)


def test_drafts_do_get_turned_down_by_a_penalty(models, references):  # noqa: F811  (imported fixture)
    """Prompt lookup copies what came before, exactly what a repetition penalty forbids: its drafts are
    rejected where plain decoding would not have taken them, and the output is still plain decoding's."""
    prompts, outputs = references
    engine = SpeculativeEngine(models.target, models.tokenizer, PromptLookupDrafter(max_ngram=2, num_tokens=4),
                               gate=False)
    params = PENALTIES["repetition"]
    results = list(greedy_runs_under(engine, prompts, outputs["repetition"], params))
    assert sum(s.drafted - s.accepted for r in results for s in r.steps) > 0


def greedy_runs_under(engine, prompts, references, params):
    for i, prompt in enumerate(prompts):
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=max(LENGTHS), sampling=params))
        assert result.token_ids == references[i]
        yield result


def test_the_batch_engine_under_penalties(models, references):  # noqa: F811  (imported fixture)
    """Several sequences of different penalties in one batch, drafting by prompt lookup (chain and tree):
    each one's output is its plain decoding's."""
    prompts, outputs = references
    for variant in ("pld", "pld-tree"):
        batch = BatchEngine(models.target, models.tokenizer, gate=False)
        idents = {}
        for name, params in PENALTIES.items():
            for i, prompt in enumerate(prompts):
                drafter = models.engine_for(choose(variant)).drafter
                config = GenerationConfig(max_new_tokens=max(LENGTHS), sampling=params)
                idents[batch.add(prompt, config, drafter)] = outputs[name][i]
        finished = {}
        while batch.members:
            for ident, _, result in batch.step():
                if result is not None:
                    finished[ident] = result.token_ids
        assert finished == idents, variant


def test_plain_greedy_runs_agree_without_penalties(models):  # noqa: F811  (imported fixture)
    """The neutral values change nothing: the default parameters' output."""
    prompts = [models.encode(text) for text in PROMPTS]
    neutral = SamplingParams(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, min_p=0.0)
    assert not neutral.penalised
    assert plain_outputs(models, neutral, prompts) == plain_outputs(models, SamplingParams(), prompts)
    list(greedy_runs(SpeculativeEngine(models.target, models.tokenizer), prompts[:1],
                     plain_outputs(models, SamplingParams(), prompts[:1]), [5]))


def min_tokens_params(loaded, min_tokens: int = 7) -> SamplingParams:
    """A bias that makes an end-of-sequence token the likeliest everywhere, held off by min_tokens."""
    return SamplingParams(min_tokens=min_tokens, logit_bias=((min(loaded.target.eos_token_ids), 30.0),))


@pytest.fixture(scope="module")
def held_open(models):  # noqa: F811  (imported fixture)
    """Plain greedy decoding under `min_tokens_params`: min_tokens tokens, then the end."""
    prompts = [models.encode(text) for text in PROMPTS]
    outputs = plain_outputs(models, min_tokens_params(models), prompts)
    eos = models.target.eos_token_ids
    assert all(len(o) == 8 and o[-1] in eos and not eos & set(o[:-1]) for o in outputs)
    return prompts, outputs


@pytest.mark.parametrize("variant", LOSSLESS)
def test_greedy_output_under_min_tokens_is_plain_decoding(variant, models, held_open,  # noqa: F811  (imported
                                                          random_heads, monkeypatch):  # noqa: F811  fixtures)
    """Every drafted row before min_tokens, by its own position, has the end held off (`engine.penalties`)."""
    engine = method_engine(models, variant, random_heads, monkeypatch)
    prompts, outputs = held_open
    for i, prompt in enumerate(prompts):
        config = GenerationConfig(max_new_tokens=20, sampling=min_tokens_params(models))
        assert engine.generate(prompt, config).token_ids == outputs[i], i
    batch = BatchEngine(models.target, models.tokenizer, gate=False)
    if engine.drafter is None or engine.drafter.batchable:
        idents = {batch.add(p, GenerationConfig(max_new_tokens=20, sampling=min_tokens_params(models)),
                            engine.drafter.for_sequence() if engine.drafter else None): o
                  for p, o in zip(prompts, outputs)}
        finished = {}
        while batch.members:
            finished.update({i: r.token_ids for i, _, r in batch.step() if r is not None})
        assert finished == idents
