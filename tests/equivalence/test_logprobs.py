"""Log-probabilities: every method reports, for the tokens it emits, what plain decoding reports for the same
tokens (greedy: the same tokens, so the same figures, to float32's tolerance), and every reported figure is the
log-softmax of the target's raw logits at the token's position, recomputed here by a plain forward without a
cache, sampled and penalised runs included; the prompt's (echo) likewise, fed whole or in chunks.

Built as `test_every_method.py` builds its engines (its tiny chat models, its random heads)."""

from __future__ import annotations

import pytest
import torch

from test_every_method import LOSSLESS, PROMPTS, REFERENCE, folders, models, random_heads  # noqa: F401  (fixtures)
from specdecode.drafters import heads
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.methods import choose
from specdecode.types import SamplingParams, TokenLogprob

pytestmark = pytest.mark.usefixtures("one_thread")

TOP = 3
TOLERANCE = 1e-4  # float32 log-softmax over rows of a wider forward


def plain_logprobs(model, sequence: list[int], top: int = TOP) -> TokenLogprob:
    """The entry of the last token of `sequence`, from one forward without a cache over all of it."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, -2].float()
    logprobs = logits.log_softmax(-1)
    values, tokens = logprobs.topk(top)
    return TokenLogprob(sequence[-1], float(logprobs[sequence[-1]]), tuple(zip(tokens.tolist(), values.tolist())))


def assert_close(got: list[TokenLogprob], want: list[TokenLogprob], what: str = "") -> None:
    assert [g.token for g in got] == [w.token for w in want], what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.logprob == pytest.approx(w.logprob, abs=TOLERANCE), (what, i)
        assert [t for t, _ in g.top] == [t for t, _ in w.top], (what, i)
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=TOLERANCE), (what, i)


PLAIN: dict = {}


def plain(loaded, prompt: tuple[int, ...], params: SamplingParams) -> list[TokenLogprob]:
    """Plain greedy decoding's entries (made once per prompt and parameters), themselves checked against forwards
    without a cache: plain decoding shares the code that reads them (`engine.logprobs.riders`), so a mistake there
    (the raw row's argmax for the emitted token's figure, under a penalty or a bias) would be in both sides alike."""
    if (prompt, params) in PLAIN:
        return PLAIN[prompt, params]
    engine = SpeculativeEngine(loaded.target, loaded.tokenizer)
    result = engine.generate(list(prompt), GenerationConfig(max_new_tokens=20, sampling=params, logprobs=TOP))
    assert result.logprobs is not None
    sequence = list(prompt) + result.token_ids
    assert_close(result.logprobs, [plain_logprobs(loaded.target.model, sequence[: len(prompt) + i + 1])
                                   for i in range(result.new_tokens)], f"plain {params}")
    PLAIN[prompt, params] = result.logprobs
    return result.logprobs


GREEDY = [SamplingParams(), SamplingParams(repetition_penalty=1.5, logit_bias=((33, 2.0),))]


@pytest.mark.parametrize("variant", LOSSLESS)
def test_greedy_logprobs_are_plain_decodings(variant, models, random_heads,  # noqa: F811  (imported fixtures)
                                              monkeypatch):
    monkeypatch.setattr(heads, "shipped_head", lambda model, kind: random_heads / kind)
    reference = None if "-tree" in variant else REFERENCE
    engine = models.engine_for(choose(variant, reference=reference, only_if_taken=True))
    for text in PROMPTS[:2]:
        prompt = tuple(models.encode(text))
        for params in GREEDY:
            result = engine.generate(list(prompt), GenerationConfig(max_new_tokens=20, sampling=params, logprobs=TOP))
            assert result.logprobs is not None and len(result.logprobs) == result.new_tokens
            assert_close(result.logprobs, plain(models, prompt, params), f"{variant} {params}")


@pytest.mark.parametrize("variant", ["ar", "pld", "pld-tree", "draft", "draft-tree", "suffix-tree"])
def test_sampled_logprobs_are_the_targets_raw_ones(variant, models):  # noqa: F811  (imported fixture)
    """Whatever was sampled, with or without penalties, each token's entry is the raw log-softmax at its
    position (read after the verdict, as sampling needs)."""
    reference = None if "-tree" in variant else REFERENCE
    engine = models.engine_for(choose(variant, reference=reference, only_if_taken=True))
    prompt = models.encode(PROMPTS[0])
    for params in [SamplingParams(temperature=1.0, top_k=20), SamplingParams(0.7, frequency_penalty=1.0, min_p=0.1)]:
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=12, sampling=params, logprobs=TOP, seed=3))
        sequence = prompt + result.token_ids
        want = [plain_logprobs(models.target.model, sequence[: len(prompt) + i + 1]) for i in range(result.new_tokens)]
        assert result.logprobs is not None
        assert_close(result.logprobs, want, variant)


@pytest.mark.parametrize("chunk", [None, 3])
def test_echo_scores_every_prompt_token_but_the_first(models, chunk):  # noqa: F811  (imported fixture)
    """Fed whole, or three tokens a forward: each prompt token's entry is a plain forward's; the generated
    tokens follow as without echo; max_new_tokens 0 generates nothing (lm-eval's log-likelihood requests)."""
    engine = SpeculativeEngine(models.target, models.tokenizer, models.engine_for(choose("pld-tree")).drafter)
    if chunk is not None:
        engine.prefill_chunk = chunk
    prompt = models.encode(PROMPTS[1])
    want = [plain_logprobs(models.target.model, prompt[: i + 1]) for i in range(1, len(prompt))]
    for new in (0, 1, 8):
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=new, logprobs=TOP, echo=True))
        assert result.prompt_logprobs is not None and result.logprobs is not None
        assert_close(result.prompt_logprobs, want, f"echo {new}")
        assert result.new_tokens == new
        assert_close(result.logprobs, plain(models, tuple(prompt), SamplingParams())[:new], f"generated {new}")


def test_no_logprobs_unless_asked(models):  # noqa: F811  (imported fixture)
    result = SpeculativeEngine(models.target, models.tokenizer).generate(models.encode(PROMPTS[0]),
                                                                         GenerationConfig(max_new_tokens=4))
    assert result.logprobs is None and result.prompt_logprobs is None
