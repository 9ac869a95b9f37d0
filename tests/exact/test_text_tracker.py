"""`engine.stopping.TextTracker` decodes a growing output a step at a time: where the tokenizer's decoding joins (a
byte-level decoder, no clean-up of spaces), only the ids since the last character's end. Its text at every step is the
whole output's decoding, with random ids (incomplete characters, invalid bytes, special tokens among them), for the
tests' tiny byte-level tokenizer and the default target's when it is in the cache."""

from __future__ import annotations

import random

import pytest

from conftest import LetterTokenizer, tiny_tokenizer
from specdecode.engine.stopping import TextTracker, joins


def default_tokenizer():
    from transformers import AutoTokenizer

    from specdecode.models.loading import converted_dir
    from specdecode.models.registry import DEFAULT_TARGET, MODELS

    folder = converted_dir(MODELS[DEFAULT_TARGET])
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"the default target's tokenizer is not in {folder}")
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(params=["tiny", "default"])
def tokenizer(request):
    return tiny_tokenizer() if request.param == "tiny" else default_tokenizer()


@pytest.mark.parametrize("seed", range(3))
def test_every_steps_text_is_the_whole_outputs_decoding(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(600)]
    tracker, whole = TextTracker(tokenizer), TextTracker(tokenizer)
    whole._joins = False  # (decodes the whole output every step, as the tracker did before)
    assert tracker._joins
    output, deltas, expected = [], [], []
    while len(output) < len(ids):
        previous = len(output)
        output.extend(ids[previous : previous + rng.randrange(1, 5)])
        assert tracker._text_of(output) == tokenizer.decode(output, skip_special_tokens=True)
        deltas.append(tracker.update(output, previous)[0])
        expected.append(whole.update(output, previous)[0])
    assert deltas == expected
    assert "".join(deltas) + tracker.finish(output) == tokenizer.decode(output, skip_special_tokens=True)


def test_a_stop_string_cuts_where_it_did(tokenizer):
    """A stop string found in the joined text cuts the output as before (its search reads the whole text)."""
    ids = tokenizer("one two three four five", add_special_tokens=False)["input_ids"]
    tracker, whole = TextTracker(tokenizer, stop=["four"]), TextTracker(tokenizer, stop=["four"])
    whole._joins = False
    said, heard = [], []
    for n in range(1, len(ids) + 1):
        said.append(tracker.update(ids[:n], n - 1))
        heard.append(whole.update(ids[:n], n - 1))
        if said[-1][1] is not None:
            break
    assert said == heard and said[-1][1] is not None and "".join(d for d, _ in said) == "one two three "


def test_only_a_byte_level_decoder_without_clean_up_joins():
    tokenizer = tiny_tokenizer()
    assert joins(tokenizer)
    tokenizer.clean_up_tokenization_spaces = True  # (a clean-up can span the join)
    assert not joins(tokenizer)
    assert not joins(LetterTokenizer()) and not joins(None)


def test_an_end_a_stop_string_begins_with_waits_until_the_text_says():
    """Streamed text never shows the beginning of a stop string that the output then lacks: "fou" waits; "found"
    shows it was not "four"; at the end a held "fou" comes with the tail."""
    tokenizer = tiny_tokenizer()
    ids = tokenizer("we found three fou", add_special_tokens=False)["input_ids"]
    tracker = TextTracker(tokenizer, stop=["four"])
    deltas = [tracker.update(ids[:n], n - 1)[0] for n in range(1, len(ids) + 1)]
    shown = "".join(deltas)
    assert not shown.endswith(("f", "fo", "fou")) and shown == "we found three "
    assert "foun" in deltas  # "fou" of "found" shown once "n" said it was not "four"
    assert tracker.finish(ids) == "fou"


def test_min_tokens_holds_a_stop_string_off_until_a_token_that_late_completes_it():
    """vLLM's `min_tokens` holds stop strings off too: one that the output's first min_tokens - 1 tokens hold whole
    does not count; the next, completed later, does. Whole answers (`finish`) read them the same way."""
    tokenizer = tiny_tokenizer()
    ids = tokenizer("one four two four three", add_special_tokens=False)["input_ids"]
    first_end = next(n for n in range(len(ids) + 1) if "four" in tokenizer.decode(ids[:n]))  # tokens to the first
    second_end = next(n for n in range(first_end + 1, len(ids) + 1)
                      if tokenizer.decode(ids[:n]).count("four") == 2)
    for min_tokens, text, keep in ((0, "one ", first_end), (first_end, "one ", first_end),
                                   (first_end + 1, "one four two ", second_end), (len(ids) + 1, None, None)):
        tracker = TextTracker(tokenizer, stop=["four"], min_tokens=min_tokens)
        said = []
        for n in range(1, len(ids) + 1):
            said.append(tracker.update(ids[:n], n - 1))
            if said[-1][1] is not None:
                break
        shown = "".join(d for d, _ in said)
        if text is None:  # held off to the end: nothing cut
            assert said[-1][1] is None and shown + tracker.finish(ids) == "one four two four three"
        else:
            assert (shown, said[-1][1]) == (text, keep), min_tokens
        late = TextTracker(tokenizer, stop=["four"], min_tokens=min_tokens)
        assert late.finish(ids) == (text if text is not None else "one four two four three")


def test_a_stop_token_id_that_ends_the_output_leaves_its_text_out(tokenizer):
    """vLLM's `stop_token_ids` with its default `include_stop_str_in_output` false: the text stops before the token
    that ended the output, streamed or not; a stop string the token would have completed does not cut earlier."""
    ids = tokenizer(" alpha beta gamma!", add_special_tokens=False)["input_ids"]
    stop = ids[-1]
    assert stop not in ids[:-1] and tokenizer.decode([stop]).strip()  # (a token with a text, once)
    want = tokenizer.decode(ids[:-1], skip_special_tokens=True)
    for stops in ([], [tokenizer.decode([stop]).strip()]):
        tracker = TextTracker(tokenizer, stop=stops, stop_token_ids=[stop])
        deltas = [tracker.update(ids[:n], n - 1) for n in range(1, len(ids) + 1)]
        assert "".join(d for d, _ in deltas) + tracker.finish(ids) == want == tracker.text
        assert all(keep is None for _, keep in deltas)


@pytest.mark.parametrize("step", [1, 2, 3, 4])
def test_a_stop_string_keeps_the_ids_up_to_the_one_that_completes_it_wherever_a_step_begins(tokenizer, step):
    """A speculative step adds several ids at once: the ids kept end with the one that completes the stop string,
    whichever of the step's ids it is (the step's first, last or one between), never one past it."""
    ids = tokenizer("one two three four five six", add_special_tokens=False)["input_ids"]
    end = next(n for n in range(1, len(ids) + 1) if "four" in tokenizer.decode(ids[:n]))  # the completing id's count
    for first in range(max(0, end - step), end):  # each place of the completing id within a step of `step` ids
        tracker = TextTracker(tokenizer, stop=["four"])
        if first:
            assert tracker.update(ids[:first], 0)[1] is None
        text, keep = tracker.update(ids[: first + step], first)
        assert keep == end, (first, step)
        assert tracker.text == tokenizer.decode(ids[:end]).split("four")[0]
