"""Behaviour of the loop: stopping, streaming, statistics, the gate, seeds, bad input; the fake model the
statistical tests run on (its sampled output: `statistical/test_engine_sampling.py`)."""

from __future__ import annotations

import collections
import copy
import threading

import numpy as np
import pytest
import torch

from conftest import DRAFT_PRICES, VOCAB, LetterTokenizer, random_prompts
import fakes
from fakes import FakeLM
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.base import Drafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine.batch import BatchEngine
from specdecode.errors import UserError
from specdecode.models import costs
from specdecode.models.hf import HFCausalLM
from specdecode.models.static import StaticCausalLM
from specdecode.types import Draft, SamplingParams

PROMPT = random_prompts(1, seed=11)[0]


@pytest.fixture
def spec_engine(tiny_target):
    drafter = DraftModelDrafter(HFCausalLM(copy.deepcopy(tiny_target)), confidence_threshold=0,
                                **DRAFT_PRICES)
    return SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter=drafter)


def plain_ids(tiny_target, n=40):
    return SpeculativeEngine(HFCausalLM(tiny_target)).generate(PROMPT, GenerationConfig(max_new_tokens=n)).token_ids


def test_eos_stops_and_is_kept(tiny_target, spec_engine):
    ids = plain_ids(tiny_target)
    eos = ids[9]
    first = ids.index(eos)
    spec_engine.target.eos_token_ids = frozenset({eos})
    result = spec_engine.generate(PROMPT, GenerationConfig(max_new_tokens=40))
    assert result.token_ids == ids[: first + 1] and result.finish_reason == "eos"
    ignored = spec_engine.generate(PROMPT, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    assert ignored.token_ids == ids and ignored.finish_reason == "length"


def test_stop_token_ids_stop_as_eos_does_ignore_eos_or_not(tiny_target, spec_engine):
    """vLLM's `stop_token_ids`: the first of them ends the output (kept in it), speculation or not, batched or not,
    and under `ignore_eos` too, which passes an end-of-sequence token before it."""
    ids = plain_ids(tiny_target)
    stops = (ids[12], ids[20])
    first = min(ids.index(t) for t in stops)
    eos = next(t for t in ids[:first] if t not in stops)
    target = HFCausalLM(tiny_target)
    target.eos_token_ids = spec_engine.target.eos_token_ids = frozenset({eos})
    # ended by the model's end "eos", by a stop token "stop" (it was "eos": read as the model's end, or a constrained
    # output's completion)
    for ignore_eos, end, reason in ((False, ids.index(eos), "eos"), (True, first, "stop")):
        config = GenerationConfig(max_new_tokens=40, stop_token_ids=stops, ignore_eos=ignore_eos)
        result = spec_engine.generate(PROMPT, config)
        assert result.token_ids == ids[: end + 1] and result.finish_reason == reason
        batch = BatchEngine(target)
        batch.add(PROMPT, config, PromptLookupDrafter())
        assert next(r for _ in range(60) for _, _, r in batch.step() if r is not None).token_ids == ids[: end + 1]
    with pytest.raises(UserError, match="out of the vocabulary"):
        spec_engine.generate(PROMPT, GenerationConfig(stop_token_ids=(VOCAB,)))


def test_stop_string_cuts_text_and_tokens(tiny_target, spec_engine):
    ids = plain_ids(tiny_target)
    text = LetterTokenizer().decode(ids)
    stop = text[12:14]
    cut = text.index(stop)
    result = spec_engine.generate(PROMPT, GenerationConfig(max_new_tokens=40, stop=(stop, "not-there")))
    assert result.finish_reason == "stop"
    assert result.text == text[:cut]
    assert result.token_ids == ids[: cut + len(stop)]  # up to the token completing the stop string


def test_min_tokens_holds_a_stop_string_off(tiny_target, spec_engine):
    """A stop string the output's first min_tokens - 1 tokens complete does not end it (`TextTracker`)."""
    ids = plain_ids(tiny_target)
    text = LetterTokenizer().decode(ids)
    stop = text[12:14]
    tokens = text.index(stop) + len(stop)  # (one letter a token)
    held = spec_engine.generate(PROMPT, GenerationConfig(max_new_tokens=40, stop=(stop,),
                                                         sampling=SamplingParams(min_tokens=tokens + 1)))
    assert held.token_ids == ids[: len(held.token_ids)] and len(held.token_ids) > tokens
    assert held.text.startswith(text[:tokens])


def test_streaming_concatenates_to_result(tiny_target, spec_engine):
    stream = spec_engine.stream(PROMPT, GenerationConfig(max_new_tokens=33))
    events = list(stream)
    result = stream.result
    assert [t for e in events for t in e.token_ids] == result.token_ids == plain_ids(tiny_target, 33)
    assert "".join(e.text for e in events) == result.text == LetterTokenizer().decode(result.token_ids)
    origins = [o for e in events for o in e.origins]
    assert len(origins) == 33 and "accepted" in origins
    assert set(origins) <= {"accepted", "corrected", "bonus", "target"}


def test_statistics_add_up(spec_engine):
    result = spec_engine.generate(PROMPT, GenerationConfig(max_new_tokens=30))
    steps = result.steps
    assert sum(s.new_tokens for s in steps) == result.new_tokens == 30
    assert result.mean_accepted_tokens == pytest.approx(30 / len(steps))
    assert all(s.accepted <= s.drafted for s in steps)
    assert steps[0].forward_tokens == len(PROMPT) + steps[0].drafted  # the prefill is the first forward
    assert result.accepted_per_position[0] == 1.0  # the drafter is the target itself
    summary = result.summary()
    assert summary["target_forwards"] == len(steps) and summary["method"] == "draft"


def test_context_limit_ends_generation(tiny_target):
    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=PromptLookupDrafter())
    long_prompt = (PROMPT * 100)[:500]  # the tiny model holds 512 positions
    result = engine.generate(long_prompt, GenerationConfig(max_new_tokens=100))
    assert result.new_tokens == 12 and result.finish_reason == "length"


def test_gate_verifies_only_what_pays_on_the_cost_curve(tiny_target):
    """A scored chain is cut to the prefix that pays: all of it where width is free, none of it where a
    forward over k tokens costs k (then no draft token can pay, except beside the prefill, whose own
    width makes a few more tokens relatively cheap), and the output is the same either way."""
    from specdecode.models.costs import CostCurve

    prompt = PROMPT * 4  # repeats: prompt lookup finds matches at every step
    config = GenerationConfig(max_new_tokens=40)
    outputs, drafted = {}, {}
    for name, curve in [("free", CostCurve.linear(0.0)), ("linear", CostCurve.linear(1.0))]:
        engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=PromptLookupDrafter(num_tokens=8))
        engine.curve = curve
        result = engine.generate(prompt, config)
        outputs[name], drafted[name] = result.token_ids, sum(s.drafted for s in result.steps[1:])
    ungated = SpeculativeEngine(HFCausalLM(tiny_target), drafter=PromptLookupDrafter(num_tokens=8), gate=False)
    result = ungated.generate(prompt, config)
    assert drafted["linear"] == 0 and drafted["free"] == sum(s.drafted for s in result.steps[1:]) > 0
    assert outputs["free"] == outputs["linear"] == result.token_ids


@pytest.mark.parametrize(
    "prompt, config_kwargs",
    [([], {}), ([1] * 600, {}), ([VOCAB + 5], {}), (PROMPT, {"max_new_tokens": 0}), (PROMPT, {"max_new_tokens": -3})],
)
def test_bad_input_is_a_user_error(tiny_target, prompt, config_kwargs):
    with pytest.raises(UserError):
        SpeculativeEngine(HFCausalLM(tiny_target)).generate(prompt, GenerationConfig(**config_kwargs))


@pytest.mark.parametrize("settings, words", [
    (lambda: GenerationConfig(max_new_tokens=2.5), "max_new_tokens must be a whole number"),
    (lambda: GenerationConfig(seed="1"), "seed must be a whole number or None"),
    (lambda: GenerationConfig(logprobs=True), "logprobs must be a whole number or None"),
    (lambda: GenerationConfig(sampling={"temperature": 1.0}), "must be a SamplingParams"),
    (lambda: SamplingParams(temperature="0.5"), "temperature must be a number"),
    (lambda: SamplingParams(temperature=1.0, top_k=1.5), "top_k must be a whole number"),
    (lambda: SamplingParams(min_tokens=False), "min_tokens must be a whole number"),
    (lambda: GenerationConfig(stop=("", "x")), "stop string is text that is not empty"),  # (was dropped unsaid)
    (lambda: GenerationConfig(stop=""), "stop string is text that is not empty"),
    (lambda: GenerationConfig(seed=2**64), "a seed lies in"),  # (was torch's overflow, a traceback)
    (lambda: GenerationConfig(seed=2**64 - 1), "a seed lies in"),  # (torch's stream of seed -1)
    (lambda: GenerationConfig(seed=-(2**63) - 1), "a seed lies in"),
    (lambda: GenerationConfig(stop=[5]), "stop must be texts"),  # (was a TypeError in the decoding)
    (lambda: GenerationConfig(stop_token_ids=[-1]), "stop_token_ids must be token ids"),
    (lambda: GenerationConfig(constraint="json"), "a constraint is made by Constraint"),
    (lambda: SamplingParams(logit_bias=[(5, float("nan"))]), "a logit_bias value must be in"),
    (lambda: SamplingParams(logit_bias=[5, 1.0]), "logit_bias must be"),
    (lambda: SamplingParams(logit_bias={5.5: 1.0}), "logit_bias must be"),
])
def test_settings_of_the_wrong_type_are_a_user_error(settings, words):
    """A library caller's settings of the wrong type are refused in words at once (they failed deep in the decoding,
    after the prompt's prefill: a float of tokens in a slice, a float top_k in torch.topk)."""
    with pytest.raises(UserError, match=words):
        settings()


def test_generate_loads_once_for_threads_and_spellings_and_keeps_its_engines(tiny_folder, monkeypatch):
    """Threads making the first call load the models once (they loaded them once each) and take turns on them (the
    kept engine refused a second thread's sequence), a folder with a trailing slash is the same folder, and a method's
    engine is kept (a suffix memory remembers earlier calls; a head is read once), the least recently used going
    first."""
    from specdecode import api

    monkeypatch.setattr(api, "_loaded", {})
    monkeypatch.setattr(api, "_engines", collections.OrderedDict())
    loads = []
    load_models = api.load_models
    monkeypatch.setattr(api, "load_models", lambda *args, **kwargs: loads.append(args) or load_models(*args, **kwargs))
    ids, settings = PROMPT[:12], {"drafter": None, "dtype": "float32", "max_new_tokens": 4}
    answers = []

    def call():
        try:
            answers.append(api.generate(ids, method="ar", target=str(tiny_folder), **settings).token_ids)
        except UserError as error:
            answers.append(str(error))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 4 and len({str(a) for a in answers}) == 1 and isinstance(answers[0], list)
    api.generate(ids, method="suffix", target=str(tiny_folder) + "/", **settings | {"dtype": "fp32"})
    assert len(loads) == 1 and len(api._engines) == 2
    for budget in range(1, api.KEPT_ENGINES + 1):
        api.generate(ids, method="pld-tree", budget=budget, target=str(tiny_folder), **settings)
    assert len(api._engines) == api.KEPT_ENGINES and len(loads) == 1


def test_settings_keep_their_own_copies_and_take_none_and_mappings():
    """A caller's list changed after the checks changes nothing (a NaN bias appended so made every token the same),
    OpenAI's {id: bias} mapping is taken as pairs, and no stop strings may be None."""
    bias, stops = [(5, 1.0)], ["x"]
    sampling, config = SamplingParams(logit_bias=bias), GenerationConfig(stop=stops)
    bias.append((7, float("nan")))
    stops.append(5)
    assert sampling.logit_bias == ((5, 1.0),) and config.stop == ("x",)
    assert SamplingParams(logit_bias={5: 1, 9: -2.5}).logit_bias == ((5, 1.0), (9, -2.5))
    # numpy's numbers (a tokenizer's arrays), kept as Python's
    assert SamplingParams(logit_bias=((np.int64(5), np.float32(2.0)),)).logit_bias == ((5, 2.0),)
    assert GenerationConfig(stop_token_ids=tuple(np.array([50, 7]))).stop_token_ids == (50, 7)
    assert type(GenerationConfig(stop_token_ids=[np.int64(3)]).stop_token_ids[0]) is int
    assert GenerationConfig(stop=None).stop == () and GenerationConfig(stop="x").stop == ("x",)


@pytest.mark.parametrize("prompt, words", [
    ("the cat", "encode a text first"),
    ([[1, 2], [3, 4]], "not several"),
    (["the", "cat"], "not several"),
    ([1.0, 2.0], "token ids are whole numbers, got 1.0"),
    (torch.ones(2, 3, dtype=torch.long), "one row of token ids"),
    (7, "a list of token ids, not int"),
])
def test_a_prompt_that_is_not_token_ids_is_refused_in_words(tiny_target, prompt, words):
    """(Was a TypeError from a comparison, or torch's error from the embedding.)"""
    engine = SpeculativeEngine(HFCausalLM(tiny_target))
    with pytest.raises(UserError, match=words):
        engine.generate(prompt, GenerationConfig(max_new_tokens=2))
    with pytest.raises(UserError, match=words):
        BatchEngine(HFCausalLM(tiny_target)).add(prompt, GenerationConfig(max_new_tokens=2))


def test_a_prompt_may_be_a_tensor_or_numpy_ids(tiny_target):
    engine = SpeculativeEngine(HFCausalLM(tiny_target))
    config = GenerationConfig(max_new_tokens=4)
    want = engine.generate(PROMPT, config).token_ids
    assert engine.generate(torch.tensor([PROMPT]), config).token_ids == want  # (a tokenizer's return_tensors="pt")
    assert engine.generate(np.array(PROMPT), config).token_ids == want


def test_generate_takes_token_ids_as_a_list_a_tuple_a_tensor_or_numpys(tiny_folder):
    from specdecode.api import generate

    ids = PROMPT[:12]
    as_list = generate(ids, method="ar", target=str(tiny_folder), drafter=None, dtype="float32", max_new_tokens=4)
    as_tuple = generate(tuple(ids), method="ar", target=str(tiny_folder), drafter=None, dtype="float32",
                        max_new_tokens=4)
    assert as_tuple.token_ids == as_list.token_ids
    # a stop string given alone is one stop string (each of its characters was one: the answer cut at the first)
    text = generate(ids, method="ar", target=str(tiny_folder), drafter=None, dtype="float32", max_new_tokens=24).text
    at = next(i for i in range(1, len(text) - 1) if text.index(text[i:i + 2]) == i and text[i] in text[:i])
    one, several = (generate(ids, method="ar", target=str(tiny_folder), drafter=None, dtype="float32",
                             max_new_tokens=24, stop=given).text for given in (text[at:at + 2], (text[at:at + 2],)))
    assert one == several == text[:at]
    # the sources the command line takes (a datastore, a reference document, a tree's shape) it takes too
    copied = generate(ids, method="pld", target=str(tiny_folder), drafter=None, dtype="float32", max_new_tokens=24,
                      reference=text)
    assert copied.text == text
    with pytest.raises(UserError, match="no datastore at"):
        generate(ids, method="rest", target=str(tiny_folder), drafter=None, datastore="/no/such/store.npz")
    for neither in (5, {1: "a"}, b"ab"):
        with pytest.raises(UserError, match="a text or a list of token ids"):
            generate(neither, method="ar", target=str(tiny_folder), drafter=None, dtype="float32")
    # a tensor of one row (a tokenizer's return_tensors="pt") and numpy's integers, as the engines take them
    for row in (torch.tensor([ids]), np.array(ids)):
        assert generate(row, method="ar", target=str(tiny_folder), drafter=None, dtype="float32",
                        max_new_tokens=24).text == text
    assert generate(ids, method="ar", target=str(tiny_folder), drafter=None, dtype="float32", max_new_tokens=24,
                    stop=None).text == text
    # the caller's mistakes in words, before a model loads (were an AttributeError or a TypeError deep inside, or
    # nothing: chat=True over token ids, tree="yes", a budget of 3.5 nodes)
    as_lists = generate(ids, method="draft", tree=True, choices=[[0], [0, 0]], target=str(tiny_folder),
                        drafter=str(tiny_folder), dtype="float32", max_new_tokens=4)  # (was unhashable: a TypeError)
    assert as_lists.token_ids == as_list.token_ids
    for mistake, words in [({"method": None}, "a method is named by a string"), ({"tree": "yes"}, "tree is True"),
                           ({"method": "draft", "tree": True, "choices": [[0], ["x"]]}, "paths of whole-number"),
                           ({"method": "pld", "tree": True, "budget": "8"}, "whole number of nodes"),
                           ({"method": "pld", "tree": True, "budget": 3.5}, "whole number of nodes"),
                           ({"chat": True}, "drop chat=True")]:
        with pytest.raises(UserError, match=words):
            generate(ids, **{"method": "ar", "target": "/no/such/model", "drafter": None} | mistake)


def test_a_draft_model_as_dear_as_its_target_is_named_at_load(tiny_folder, three_layers, caplog):
    """Its drafts cost what they could save, so the gate keeps its methods plain: without a word that looked like a
    drafter that never agrees."""
    import logging

    from specdecode.api import load_models

    with caplog.at_level(logging.WARNING, logger="specdecode"):
        load_models(str(three_layers), str(tiny_folder), dtype="float32", draft_dtype="float32", progress=False)
    assert not caplog.records  # a smaller drafter: nothing to say
    with caplog.at_level(logging.WARNING, logger="specdecode"):
        load_models(str(tiny_folder), str(three_layers), dtype="float32", draft_dtype="float32", progress=False)
    assert "the draft model reads as many weights a token as the target, or more" in caplog.text


def test_a_config_that_is_not_one_is_a_user_error(tiny_target):
    with pytest.raises(UserError, match="config must be a GenerationConfig"):
        SpeculativeEngine(HFCausalLM(tiny_target)).generate(PROMPT, {"max_new_tokens": 4})


def test_a_seed_reproduces_what_the_docs_say(tiny_target, tiny_drafter):
    """docs/verification.md, "Randomness": a seed reproduces plain decoding's sampled answer, and a method whose
    drafts carry no distributions (here prompt lookup) gives that very answer whatever its drafts' lengths: the
    same drafter under two cost curves (as a live curve changes them) verifies other drafts and outputs the same
    tokens. A method that samples its drafts (the draft model) reproduces its own answer where its drafts do not
    follow timings, and with drafts of other lengths it gives other tokens: should that last part ever fail, the
    docs' caveat has become stale."""
    from specdecode.models.costs import CostCurve

    config = GenerationConfig(max_new_tokens=25, sampling=SamplingParams(temperature=1.0), seed=42)
    plain = SpeculativeEngine(HFCausalLM(tiny_target))
    answer = plain.generate(PROMPT * 4, config).token_ids
    assert plain.generate(PROMPT * 4, config).token_ids == answer
    other = GenerationConfig(max_new_tokens=25, sampling=SamplingParams(temperature=1.0), seed=43)
    assert plain.generate(PROMPT * 4, other).token_ids != answer
    sampled, drafted = [], []
    for slope in (0.0, 1.0):  # width free: long drafts verified; width as dear as depth: none
        engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=PromptLookupDrafter(num_tokens=8))
        engine.curve = CostCurve.linear(slope)
        result = engine.generate(PROMPT * 4, config)
        sampled.append(result.token_ids)
        drafted.append(sum(step.drafted for step in result.steps))
    assert sampled == [answer, answer] and drafted[0] > drafted[1]
    outputs = []
    for length in (2, 5):
        drafter = DraftModelDrafter(HFCausalLM(tiny_drafter), length, adaptive=False, confidence_threshold=0)
        engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=drafter, gate=False)
        outputs.append(engine.generate(PROMPT * 4, config).token_ids)
        assert engine.generate(PROMPT * 4, config).token_ids == outputs[-1]
    assert outputs[0] != outputs[1]


# --- The fake model the statistical tests run on (fakes.py) --------------------------------------------


def test_fake_model_is_a_causal_lm_that_catches_misuse():
    """The fake's logits after a tree node are its logits after the node's path; compacted to a path, it
    continues as if only that path had been fed; a position that does not follow what a token sees, or
    a rejected node left in the cache, raises."""
    from specdecode.tree import structure

    context = tuple(fakes.PROMPT)
    lm = FakeLM(fakes.TARGET)
    lm.forward(torch.tensor(context[:-1]))
    parents = torch.tensor([-1, -1, 0, 1])  # context -> 3 -> 1, context -> 0 -> 2
    positions, mask = structure.verification_inputs(parents, 1, len(context))
    logits = lm.forward(torch.tensor([context[-1], 3, 0, 1, 2]), positions=positions, tree_mask=mask).logits
    for row, path in [(0, ()), (1, (3,)), (3, (3, 1)), (4, (0, 2))]:
        assert torch.equal(logits[row], fakes.TARGET(context + path))
    lm.compact(len(context), [1, 3])  # the path context -> 0 -> 2
    assert torch.equal(lm.forward(torch.tensor([1])).logits[0], fakes.TARGET(context + (0, 2, 1)))
    with pytest.raises(ValueError, match="position"):
        lm.forward(torch.tensor([1]), positions=torch.tensor([lm.cache_length + 1]))
    lm.crop(len(context))
    siblings = torch.eye(2, dtype=torch.bool)  # two nodes after the context
    lm.forward(torch.tensor([3, 0]), positions=torch.tensor([len(context)] * 2), tree_mask=siblings)
    with pytest.raises(ValueError, match="does not follow"):  # two siblings, neither rolled back
        lm.forward(torch.tensor([1]))


def test_a_stream_left_early_goes_on_where_it_was(tiny_target):
    """A loop over a stream that breaks, then another over it, gets the rest of the events (before, the first loop's
    end closed the generation: no more events and no result); `close` still stops it."""
    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=PromptLookupDrafter())
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    stream = engine.stream(PROMPT, config)
    first = next(iter(stream))
    rest = list(stream)
    assert stream.result is not None and rest
    assert [t for e in [first, *rest] for t in e.token_ids] == stream.result.token_ids
    assert stream.result.token_ids == engine.generate(PROMPT, config).token_ids
    stopped = engine.stream(PROMPT, config)
    next(iter(stopped))
    stopped.close()
    assert list(stopped) == [] and stopped.result is None


@pytest.mark.parametrize("second, words", [("the same engine", "decodes one at a time"),
                                            ("another engine on the model", "this model is decoding another sequence")])
def test_an_engine_decodes_one_stream_at_a_time(tiny_target, second, words):
    """A second stream begun on an engine, or on another engine made from the same models (they share the target
    and its cache), while another is under way is refused in words (it shared the target's cache and the drafter's
    state: another sequence's tokens, or a failure deep in the model); the first goes on unharmed, and once it
    ends (or is closed) the next is taken."""
    target = HFCausalLM(tiny_target)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter())
    other = engine if second == "the same engine" else SpeculativeEngine(target)
    want = engine.generate(PROMPT, config).token_ids
    first = engine.stream(PROMPT, config)
    next(iter(first))
    with pytest.raises(UserError, match=words):
        next(iter(other.stream(PROMPT, config)))
    list(first)
    assert first.result is not None and first.result.token_ids == want
    closed = engine.stream(PROMPT, config)
    next(iter(closed))
    closed.close()
    assert other.generate(PROMPT, config).token_ids == want


def test_an_exception_out_of_on_step_frees_the_engine_while_its_traceback_lives(tiny_target):
    """A callback that raises (or Ctrl-C between steps): the engine and its model take the next generation at once,
    though the traceback (which holds the generation's frames) is kept, as a notebook keeps the last one."""
    target = HFCausalLM(tiny_target)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter())
    want = engine.generate(PROMPT, config).token_ids

    def interrupt(event):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as interrupted:
        engine.generate(PROMPT, config, on_step=interrupt)
    assert interrupted.value.__traceback__ is not None  # (kept alive here)
    assert engine.generate(PROMPT, config).token_ids == want
    assert SpeculativeEngine(target).generate(PROMPT, config).token_ids == want


def test_a_batch_on_a_model_takes_turns_with_its_engines(tiny_target):
    """A BatchEngine holds its target's cache from its first sequence to its last: an engine on the same model is
    refused meanwhile (it wrote into the batch's context: wrong tokens for both), a batch is refused while an engine
    decodes, and either takes the model once the other is done."""
    target = HFCausalLM(tiny_target)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    engine = SpeculativeEngine(target)
    want = engine.generate(PROMPT, config).token_ids
    batch = BatchEngine(target, gate=False)
    ident = batch.add(PROMPT, config)
    ids = [t for _, event, _ in batch.step() for t in event.token_ids]
    with pytest.raises(UserError, match="this model is decoding another sequence"):
        engine.generate(PROMPT, config)
    while batch.members:
        ids += [t for i, event, _ in batch.step() if i == ident for t in event.token_ids]
    assert ids == want
    stream = engine.stream(PROMPT, config)
    next(iter(stream))
    with pytest.raises(UserError, match="sibling"):
        batch.add(PROMPT, config)
    stream.close()
    batch.add(PROMPT, config)
    batch.remove(ident + 1)
    assert engine.generate(PROMPT, config).token_ids == want
    with pytest.raises(UserError, match="out of the vocabulary"):  # (a sequence refused lets go of the model)
        batch.add(PROMPT, GenerationConfig(stop_token_ids=(10**6,)))
    assert engine.generate(PROMPT, config).token_ids == want


def test_a_cost_curve_measured_while_a_sequence_holds_the_model_leaves_it_alone(tiny_target, real_measure, tmp_path,
                                                                                monkeypatch):
    """The first measurement of a model's cost curve (asked for as an engine's drafter is built) empties the cache it
    runs on: made on the model's while a sequence decoded there (another thread's, or a paused stream), it ended that
    generation in an error or changed its tokens. It runs on a sibling then (a cache of its own), never waiting for
    the sequence (a stream paused on another thread would wait for the waiting one); a static-path model, whose
    sibling allocates a whole cache, is refused in words."""
    target = HFCausalLM(tiny_target)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    want = SpeculativeEngine(target).generate(PROMPT, config).token_ids
    for where in ("this thread", "another thread"):
        stream = SpeculativeEngine(target).stream(PROMPT, config)
        events = [next(iter(stream))]
        monkeypatch.setattr(costs, "cache_root", lambda folder=tmp_path / where: folder)  # (a curve not measured yet)
        if where == "this thread":
            target.cost_curve()
        else:
            measuring = threading.Thread(target=target.cost_curve)
            measuring.start()
            measuring.join()
        events += list(stream)
        assert [t for event in events for t in event.token_ids] == want
        assert len(list((tmp_path / where).glob("*.json"))) == 1  # measured
    static = StaticCausalLM(tiny_target)
    stream = SpeculativeEngine(static).stream(PROMPT, config)
    next(iter(stream))
    monkeypatch.setattr(costs, "cache_root", lambda: tmp_path / "static")
    with pytest.raises(UserError, match="measured once, on first use"):
        static.cost_curve()


def test_engines_that_share_a_model_take_turns_across_threads(tiny_target):
    target = HFCausalLM(tiny_target)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    plain, drafted = SpeculativeEngine(target), SpeculativeEngine(target, drafter=PromptLookupDrafter())
    want = plain.generate(PROMPT, config).token_ids
    answers: list = []
    threads = [threading.Thread(target=lambda engine=engine: answers.append(run(engine, config)))
               for engine in (plain, drafted) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(answer in (want, "refused") for answer in answers) and want in answers


def run(engine: SpeculativeEngine, config: GenerationConfig) -> list[int] | str:
    try:
        return engine.generate(PROMPT, config).token_ids
    except UserError as error:
        return "refused" if "another sequence" in str(error) else str(error)


def test_a_temperature_too_small_to_divide_by_decodes_greedily(tiny_target, spec_engine):
    """Logits divided by a temperature of 1e-39 overflow float32: the row was NaN and the drawn id one past the
    vocabulary (an IndexError in the embedding). Under `GREEDY_BELOW` (1e-5, vLLM's) decoding is greedy, the limit
    sampling tends to; just above it, sampling still divides."""
    greedy = plain_ids(tiny_target, 12)
    for temperature in (1e-39, 5e-324, 9.9e-6):
        config = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=temperature), seed=1)
        assert config.sampling.greedy
        assert SpeculativeEngine(HFCausalLM(tiny_target)).generate(PROMPT, config).token_ids == greedy
        assert spec_engine.generate(PROMPT, config).token_ids == greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_a_repetition_penalty_that_would_overflow_is_refused():
    """A penalty of 1e-300 (float32's 0) divided a logit into inf: a NaN row, an id past the vocabulary, and in a
    served batch every request beside it failed. The range is [0.01, 100]."""
    for penalty in (1e-300, 1e-30, 0.009):
        with pytest.raises(UserError, match=r"repetition_penalty must be in \[0.01, 100\]"):
            SamplingParams(temperature=1.0, repetition_penalty=penalty)
    SamplingParams(temperature=1.0, repetition_penalty=0.01)


def test_a_drafter_named_none_is_no_draft_model(tiny_folder):
    """`--drafter none` loads no draft model (it was looked up as a hub id: half a minute of retries offline)."""
    from specdecode.api import load_models

    for name in ("none", "None"):
        assert load_models(str(tiny_folder), name, dtype="float32", progress=False).draft is None


class Overdrafter(Drafter):
    """Drafts the next `width` tokens of a known greedy output, however few it is asked for: a drafter that ignores
    `max_tokens` must not carry the output past `max_new_tokens` (the engine's own cut is the guard)."""

    name = "overdrafter"
    batchable = True

    def __init__(self, prompt: list[int], output: list[int], width: int = 5):
        self.prompt, self.output, self.width = prompt, output, width

    def propose(self, context, max_tokens, params, generator) -> Draft:
        done = len(context) - len(self.prompt)
        return Draft(tokens=torch.tensor(self.output[done : done + self.width]))


@pytest.mark.parametrize("limit", [1, 2, 3, 7])
def test_a_draft_longer_than_asked_never_carries_the_output_past_max_new_tokens(tiny_target, limit):
    want = plain_ids(tiny_target, 20)
    config = GenerationConfig(max_new_tokens=limit, ignore_eos=True)
    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=Overdrafter(PROMPT, want))
    result = engine.generate(PROMPT, config)
    assert result.token_ids == want[:limit] and result.finish_reason == "length"
    assert result.target_forwards < limit or limit == 1  # (drafts were taken: the cut is what held the length)
    batch = BatchEngine(HFCausalLM(tiny_target), gate=False)
    batch.add(PROMPT, config, Overdrafter(PROMPT, want))
    assert next(r for _ in range(20) for _, _, r in batch.step() if r is not None).token_ids == want[:limit]
