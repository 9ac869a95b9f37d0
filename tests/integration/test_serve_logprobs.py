"""Log-probabilities and penalties on `specdecode serve` (tiny model pair, the official `openai` client): each answer's
figures are the engine's (`engine.logprobs`: the target's raw log-softmax), the same whichever method speculates,
streamed or whole; completions' echo with max_tokens 0 scores the prompt (lm-eval's log-likelihood requests, a
batch of one token list included); the penalties and bias reach the engine and greedy output under them is the
engine's plain decoding under them."""

from __future__ import annotations

import openai
import pytest
import torch

from specdecode.api import load_models
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.serve.app import Server, ServerThread, create_app
from specdecode.types import SamplingParams

MODEL = "tiny"
METHODS = ["ar", "pld", "draft-tree-fixed", "suffix"]
PROMPT = "the cat sat on the mat and the cat sat on"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def models(tiny_folder):
    return load_models(str(tiny_folder), str(tiny_folder), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def client(models):
    running = ServerThread(create_app(Server(models, MODEL, default_method="ar", methods=METHODS)))
    yield openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)
    running.stop()


def engine_result(models, prompt_ids: list[int], max_tokens: int, params: SamplingParams | None = None,
                  logprobs: int | None = None):
    config = GenerationConfig(max_new_tokens=max_tokens, sampling=params or SamplingParams(), logprobs=logprobs)
    return SpeculativeEngine(models.target, models.tokenizer).generate(prompt_ids, config)


@pytest.mark.parametrize("method", METHODS)
def test_completion_logprobs_are_plain_decodings(client, models, method):
    ids = models.tokenizer(PROMPT)["input_ids"]
    want = engine_result(models, ids, 16, logprobs=20)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=20,
                                         extra_body={"method": method})
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=TOLERANCE)
    assert logprobs.tokens == [models.tokenizer.decode([t]) for t in want.token_ids]
    # greedy: its own is the top (keys are token texts: several byte tokens read "\ufffd")
    assert all(max(top.values()) == pytest.approx(lp, abs=TOLERANCE)
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    for top, entry, token in zip(logprobs.top_logprobs, want.logprobs, want.token_ids):
        likeliest: dict[str, float] = {}  # a text several tokens read keeps the likeliest's figure (was the last's)
        for alternative, value in sorted(entry.top, key=lambda pair: -pair[1]):
            likeliest.setdefault(models.tokenizer.decode([alternative]), value)
        assert top == pytest.approx(likeliest | {models.tokenizer.decode([token]): entry.logprob}, abs=TOLERANCE)
    assert_offsets_point_at_the_tokens(models, response.choices[0].text, logprobs)


def assert_offsets_point_at_the_tokens(models, text: str, logprobs) -> None:
    """Each token's `text_offset` is where its text stands in the choice's text (a token that is part of a character,
    reading "\ufffd", where that character stands; a special token's text is not in the choice's); never falling."""
    special = set(models.tokenizer.all_special_tokens)
    for token, at in zip(logprobs.tokens, logprobs.text_offset):
        if token not in special and "\ufffd" not in token:
            assert text[at : at + len(token)] == token, (token, at, text)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_offsets_are_the_same_whole_and_streamed(client, models):
    """Sampled answers of a small random model are full of byte tokens that split characters: their offsets come the
    same whole and streamed (the stream's steps may split a character too)."""
    ask = dict(model=MODEL, prompt=["Hello there", "ab"], max_tokens=12, n=2, seed=9, logprobs=2, temperature=1.0,
               extra_body={"method": "pld"})
    whole = client.completions.create(**ask)
    split = 0
    for choice in whole.choices:
        split += sum("\ufffd" in token for token in choice.logprobs.tokens)
        assert_offsets_point_at_the_tokens(models, choice.text, choice.logprobs)
    assert split  # (the case under test)
    streamed: dict[int, list[int]] = {}
    for chunk in client.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.setdefault(choice.index, []).extend(choice.logprobs.text_offset)
    assert streamed == {choice.index: choice.logprobs.text_offset for choice in whole.choices}


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_chat_logprobs_streamed_and_whole(client, models, method):
    messages = [{"role": "user", "content": PROMPT}]
    want = engine_result(models, models.encode_chat(messages), 12, logprobs=2)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body={"method": method})
    entries = whole.choices[0].logprobs.content
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in want.logprobs], abs=TOLERANCE)
    assert all(len(e.top_logprobs) == 2 for e in entries)
    # a token's bytes: its text's, or where it is part of a character, that part's (the answer's bytes, token by token)
    assert all(e.bytes == list(e.token.encode()) for e in entries if "\ufffd" not in e.token)
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == whole.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"method": method}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # the same entries; the values to rounding: the second request takes the first's prompt from the batch's cache
    # (shared prefixes), and on a float path a forward of another width rounds differently
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=TOLERANCE)
    assert [t.logprob for e in streamed for t in e.top_logprobs] == \
        pytest.approx([t.logprob for e in entries for t in e.top_logprobs], abs=TOLERANCE)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_scores_the_prompt_as_lm_eval_asks(client, models):
    ids = models.tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = models.target.model(torch.tensor([ids])).logits[0].float()
    want = logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    for prompt, max_tokens in ((PROMPT, 0), ([ids], 1), (ids, 0)):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             logprobs=1, echo=True, extra_body={"method": "pld"})
        logprobs = response.choices[0].logprobs
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=TOLERANCE)
        assert len(logprobs.tokens) == len(ids) + max_tokens
        assert response.choices[0].text.startswith(PROMPT)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


@pytest.mark.parametrize("method", ["ar", "pld", "suffix"])
def test_penalties_reach_the_engine(client, models, method):
    ids = models.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(frequency_penalty=1.2, presence_penalty=0.5, repetition_penalty=1.3,
                            logit_bias=((ids[-1], 5.0),))
    want = engine_result(models, ids, 20, params)
    assert want.token_ids != engine_result(models, ids, 20).token_ids
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                         frequency_penalty=1.2, presence_penalty=0.5, logit_bias={str(ids[-1]): 5},
                                         extra_body={"method": method, "repetition_penalty": 1.3, "min_p": 0.05})
    assert response.choices[0].text == want.text


def test_a_tokens_bytes_are_its_part_of_a_character():
    """OpenAI's `bytes` exist for the tokens that hold part of a character, whose text reads "\ufffd": those give the
    bytes they stand for (once answered as the replacement character's own), so that a client can join them."""
    from conftest import tiny_tokenizer
    from specdecode.serve.logprobs import TokenTexts

    tokenizer = tiny_tokenizer()
    texts = TokenTexts(tokenizer)
    text = "naïve café, 😀 and € €"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in texts.text(token) for token in ids)  # (the case under test)
    assert b"".join(bytes(texts.bytes(token)) for token in ids) == text.encode()
