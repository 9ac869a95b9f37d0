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
from specdecode.drafters.base import own_verdict
from specdecode.drafters.draft_model import UNSEEN, DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupTreeDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine.forced import with_forced
from specdecode.models.costs import CostCurve
from specdecode.types import Draft, Verdict

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


def test_a_kept_draft_that_begins_with_the_run_has_one_hot_rows_there():
    """A target-reading drafter's draft is kept only where it begins with the forced run: given that, its first
    tokens were fixed, not drawn, so its rows there are one-hot (its own rows would bias speculative sampling);
    the rows after keep the drafter's distribution."""
    probs = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), -1)
    draft = with_forced(Draft(tokens=torch.tensor([3, 4, 7]), probs=probs.clone()), 2)
    assert draft.forced == 2 and draft.probs is not None
    assert draft.probs[0, 3] == 1.0 and draft.probs[1, 4] == 1.0 and draft.probs[:2].sum() == 2.0
    assert torch.equal(draft.probs[2], probs[2])


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


def test_the_verdict_on_a_drafters_own_tokens_leaves_the_forced_run_out():
    # forced 3, 4; drafted 7, 8, 9; the target kept 3, 4, 7 and corrected 8 to 5
    verdict = Verdict(num_drafted=5, num_accepted=3, tokens=(3, 4, 7, 5), rejected=(8, 9))
    own = own_verdict(verdict, 2)
    assert (own.num_drafted, own.num_accepted, own.tokens, own.path, own.bonus, own.rejected) == (
        3, 1, (7, 5), (0,), False, (8, 9))
    whole = own_verdict(Verdict(num_drafted=4, num_accepted=4, tokens=(3, 4, 7, 8, 6)), 2)
    assert (whole.num_drafted, whole.num_accepted, whole.tokens, whole.bonus) == (2, 2, (7, 8, 6), True)
    # the target turned down the run's second token: the drafter's were never judged
    cut = own_verdict(Verdict(num_drafted=5, num_accepted=1, tokens=(3, 1), rejected=(4, 7, 8, 9)), 2)
    assert (cut.num_drafted, cut.num_accepted, cut.tokens, cut.rejected) == (0, 0, (1,), ())
    assert own_verdict(verdict, 0) is verdict


def test_a_draft_model_learns_only_from_what_it_drafted(target):
    """Under a grammar the forced run leads a draft model's draft: the draft model never fed the run's tokens in
    the places of its drafted ones, so after every step the tokens its cache is taken to hold (`SyncedCache.seen`)
    are the ones it holds, and its acceptance counts its own tokens alone."""
    prompt = tiny_tokenizer().encode("the cat")
    draft_model = FakeLM(ContextLogits(VOCAB, seed=9, scale=3.0))
    # no confidence threshold: drafted tokens are fed back unread (`UNSEEN`), as on a GPU
    drafter = DraftModelDrafter(draft_model, num_tokens=3, adaptive=False, confidence_threshold=0.0)
    observe, forced_steps = drafter.observe, []

    def observe_and_check(outcome) -> None:
        observe(outcome)
        held = [entry.token for entry in draft_model.cache]  # what the fake draft model's cache holds
        taken = drafter._cache.seen
        assert len(taken) <= len(held) and all(t in (UNSEEN, held[i]) for i, t in enumerate(taken)), (taken, held)
        forced_steps.append(outcome.draft.forced)

    drafter.observe = observe_and_check  # type: ignore[method-assign]
    result = run(target, drafter, prompt)
    assert result.token_ids == run(target, None, prompt).token_ids
    assert sum(1 for step in result.steps if step.forced) >= 3  # forced runs led its drafts...
    assert not any(forced_steps)  # ...and it heard of its own part of each draft only (`engine.forced.own_part`)


def test_a_draft_model_reads_back_every_token_it_drafted(target):
    """Without a grammar too: after every verdict, each place the draft model fed a drafted token into its cache
    without reading it (`UNSEEN`) holds that token's value, as verification read it, in its own place, so the next
    step's sync keeps the cache exactly as far as it agrees with the context."""
    prompt = tiny_tokenizer().encode("the cat sat")
    draft_model = FakeLM(ContextLogits(VOCAB, seed=9, scale=3.0))
    drafter = DraftModelDrafter(draft_model, num_tokens=3, adaptive=False, confidence_threshold=0.0)
    observe, marks_filled = drafter.observe, []

    def observe_and_check(outcome) -> None:
        marks_filled.append(UNSEEN in drafter._cache.seen)
        observe(outcome)
        held = [entry.token for entry in draft_model.cache]
        assert drafter._cache.seen == held[: len(drafter._cache.seen)], (drafter._cache.seen, held)

    drafter.observe = observe_and_check  # type: ignore[method-assign]
    config = GenerationConfig(max_new_tokens=40)
    result = SpeculativeEngine(target, tiny_tokenizer(), drafter=drafter).generate(prompt, config)
    plain = SpeculativeEngine(target, tiny_tokenizer()).generate(prompt, config)
    assert result.token_ids == plain.token_ids
    assert sum(marks_filled) >= 3  # the draft model did feed unread tokens, and the check above saw them read


def test_every_drafter_hears_of_what_it_proposed_and_nothing_else(target):
    """Under a grammar the engine puts the forced run ahead of a token-only drafter's draft; `observe` then gets
    the drafter's own draft (what it proposed, as the gate kept it) and the verdict on it, never the run: what a
    composite scores its sources by and what prompt lookup's acceptance counts. Trees too."""
    from specdecode.engine.forced import own_part

    prompt = tiny_tokenizer().encode('{"colour": "red", "size": 3} {"colour": "red"')
    for tree in (False, True):
        drafter = PromptLookupTreeDrafter(CostCurve.linear(0.01)) if tree else PromptLookupDrafter()
        proposed, heard = [], []
        propose, observe = drafter.propose, drafter.observe

        def recording_propose(*args, propose=propose, proposed=proposed):
            draft = propose(*args)
            proposed.append(draft.tokens.tolist())
            return draft

        def recording_observe(outcome, observe=observe, heard=heard):
            heard.append((outcome.draft.tokens.tolist(), outcome.draft.forced, outcome.verdict.num_drafted))
            observe(outcome)

        drafter.propose, drafter.observe = recording_propose, recording_observe  # type: ignore[method-assign]
        result = run(target, drafter, prompt)
        assert any(step.forced for step in result.steps)
        for (tokens, forced, drafted), mine in zip(heard, proposed):
            assert forced == 0 and drafted == len(tokens)
            assert tokens == mine[: len(tokens)] or tree  # a chain: what it proposed, as the gate kept it
    # a tree hung under a run of two: its nodes hang from the context again, the verdict's path shifted
    hung = with_forced(Draft(tokens=torch.tensor([5, 6, 7]), parents=torch.tensor([-1, -1, 0])), 0, [1, 2])
    own, verdict = own_part(hung, Verdict(num_drafted=5, num_accepted=3, tokens=(1, 2, 5, 9), path=(0, 1, 2)))
    assert own.tokens.tolist() == [5, 6, 7] and own.parents is not None and own.parents.tolist() == [-1, -1, 0]
    assert (verdict.num_drafted, verdict.num_accepted, verdict.tokens, verdict.path) == (3, 1, (5, 9), (0,))


def test_what_the_grammar_forbids_is_cut_from_a_draft_before_the_target_sees_it():
    """Greedy: a forbidden token goes with everything after it (its subtree in a tree). Sampling a draft with its
    distributions: the first forbidden token of each path stays (the verifier rejects it and draws from the
    residual), what hangs under it goes. Either way nothing the grammar allows is cut."""
    tokenizer = tiny_tokenizer()
    a, b, c = (tokenizer.convert_tokens_to_ids(letter) for letter in "abc")
    matcher = Matcher(Constraint.regex("[ab]+"), tokenizer, VOCAB, frozenset({tokenizer.eos_token_id}))
    chain = Draft(tokens=torch.tensor([a, b, c, a]))
    assert matcher.legal_draft(chain, sampled=False).tokens.tolist() == [a, b]
    assert matcher.legal_draft(chain, sampled=True).tokens.tolist() == [a, b, c]
    allowed = Draft(tokens=torch.tensor([b, a, a]))
    assert matcher.legal_draft(allowed, sampled=False) is allowed
    # a tree: a, c under the context; b and c under a; a under c (nodes 0..4)
    tree = Draft(tokens=torch.tensor([a, c, b, c, a]), parents=torch.tensor([-1, -1, 0, 0, 1]))
    greedy, sampled = matcher.legal_draft(tree, sampled=False), matcher.legal_draft(tree, sampled=True)
    assert greedy.tokens.tolist() == [a, b] and greedy.parents.tolist() == [-1, 0]
    assert sampled.tokens.tolist() == [a, c, b, c] and sampled.parents.tolist() == [-1, -1, 0, 0]
