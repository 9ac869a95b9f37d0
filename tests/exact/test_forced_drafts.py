"""The grammar as a drafter (`engine.forced`): the forced run leads the draft, the method's draft hangs after
it (a chain, a tree reparented under the run's last token, probabilities with one-hot rows for the run), plain
decoding stays plain; and the share of forced tokens is counted."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TOKENS, tiny_tokenizer
from fakes import ContextLogits, FakeLM
from specdecode import metrics
from specdecode.constraints import Constraint, Matcher
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine.forced import with_forced
from specdecode.types import Draft

VOCAB = len(TOKENS) + 10
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "size": {"type": "integer",
                                                                                        "maximum": 9}},
          "required": ["colour", "size"], "additionalProperties": False}


def test_a_chain_follows_the_forced_run():
    draft = with_forced(Draft(tokens=torch.tensor([7, 8]), probs=torch.full((2, 10), 0.1)), 0, [3, 4])
    assert draft.tokens.tolist() == [3, 4, 7, 8] and draft.parents is None and draft.forced == 2
    assert draft.probs is not None and draft.probs[0, 3] == 1.0 and draft.probs[1].sum() == 1.0
    assert torch.equal(draft.probs[2], torch.full((10,), 0.1))
    assert draft.prefix(1).forced == 1  # a cut (the gate) keeps the count within the draft


def test_a_tree_hangs_from_the_runs_last_token():
    tree = Draft(tokens=torch.tensor([5, 6, 7]), parents=torch.tensor([-1, -1, 0]))
    draft = with_forced(tree, 0, [1, 2])
    assert draft.tokens.tolist() == [1, 2, 5, 6, 7]
    assert draft.parents is not None and draft.parents.tolist() == [-1, 0, 1, 1, 2]
    assert with_forced(Draft.empty(), 0, [9]).tokens.tolist() == [9]


@pytest.fixture(scope="module")
def target():
    return FakeLM(ContextLogits(VOCAB, seed=5, scale=3.0))


def run(target, drafter, prompt: list[int]):
    config = GenerationConfig(max_new_tokens=60, constraint=Constraint.json_schema(SCHEMA))
    return SpeculativeEngine(target, tiny_tokenizer(), drafter=drafter).generate(prompt, config)


def test_forced_tokens_are_drafted_and_counted(target):
    tokenizer = tiny_tokenizer()
    prompt = tokenizer.encode("the cat")
    plain = run(target, None, prompt)
    speculative = run(target, PromptLookupDrafter(num_tokens=4), prompt)
    assert speculative.token_ids == plain.token_ids and plain.finish_reason == "eos"
    assert json.loads(plain.text)["colour"] in ("red", "green")
    assert all(step.forced == 0 for step in plain.steps) and plain.target_forwards == plain.new_tokens
    # `{"colour": "`, the enum's rest, `", "size": ` and `}` are forced: most of the answer
    share = metrics.forced_share(speculative.steps)
    assert share > 0.5 and speculative.summary()["forced_share"] == share
    assert speculative.target_forwards < plain.target_forwards / 2


def test_forced_is_the_canonical_run(target):
    tokenizer = tiny_tokenizer()
    matcher = Matcher(Constraint.json_schema(SCHEMA), tokenizer, VOCAB)
    assert tokenizer.decode(matcher.forced()) == '{"colour": "'
    matcher.consume(tokenizer.encode('{"colour": "g'))
    assert tokenizer.decode(matcher.forced()) == 'reen", "size": '
