"""Jacobi and lookahead decoding: the plain Jacobi iteration reaches greedy decoding's block in at most n
updates; both drafters give plain greedy output through the engine and stay lossless under sampling;
lookahead's window rides in the verification forward without touching the verified logits or the cache.

Tiny randomly initialised Qwen2 models in float32 (exact comparisons are meaningful there); their greedy
outputs fall into loops soon, which gives both drafters something to accept.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TOKENS, greedy_references, greedy_runs, random_prompts, tiny_chat_qwen2, write_tiny_gguf
from fakes import PROMPT, TARGET, FakeLM
from goodness_of_fit import assert_follows, continuations, engine_outcomes
from specdecode.drafters.base import Drafter
from specdecode.drafters.jacobi import JacobiDrafter, build_jacobi, extend_guesses, jacobi_fixed_point
from specdecode.drafters.lookahead import LookaheadDrafter, NgramPool, build_lookahead, window_tokens
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine.loop import with_auxiliary
from specdecode.errors import UserError
from specdecode.models.hf import HFCausalLM
from specdecode.tree.structure import chain_inputs
from specdecode.tree.trie import build_trie, stack
from specdecode.types import AuxiliaryTokens, Draft, SamplingParams

PROMPTS = random_prompts(4, seed=3)
LENGTHS = [1, 7, 40]
KINDS = {  # beyond `jacobi`'s default, which equivalence/test_every_method.py runs (lookahead's runs there
    # with the cost curve, which leaves its window out on the tiny model: here without one, the window rides)
    "jacobi-1": lambda: JacobiDrafter(block_size=1),
    "jacobi-8": lambda: JacobiDrafter(block_size=8),
    "lookahead": lambda: LookaheadDrafter(),
    "lookahead-window-only": lambda: LookaheadDrafter(pool_from_context=False),
    "lookahead-2gram": lambda: LookaheadDrafter(window=2, ngram=2, candidates=1),
    "lookahead-wide": lambda: LookaheadDrafter(window=4, ngram=5, candidates=6),
}


@pytest.fixture(scope="module")
def reference(tiny_target):
    """Plain greedy continuations from transformers' own generate()."""
    return dict(enumerate(greedy_references(tiny_target, PROMPTS, max(LENGTHS))))


# --- Exact cases ------------------------------------------------------------------------------------


def test_extend_guesses_copies_then_repeats():
    context = [5, 6, 7, 8, 5, 6]
    assert extend_guesses(context, [], 3) == [7, 8, 5]  # what followed the earlier "5 6"
    assert extend_guesses(context, [9, 1, 2, 3], 2) == [9, 1]  # already long enough: cut
    assert extend_guesses([1, 2, 3], [], 2) == [3, 3]  # nothing matches: the last token repeated
    assert extend_guesses([4, 4], [], 3) == [4, 4, 4]


def test_ngram_pool_keeps_the_most_recent_distinct_continuations():
    pool = NgramPool(capacity=2)
    for rest in [(1, 2), (3, 4), (1, 2), (5, 6)]:
        pool.add(7, rest)
    assert pool.candidates(7) == [(5, 6), (1, 2)]  # (1, 2) seen again outlived (3, 4)
    assert pool.candidates(8) == [] and len(pool) == 2


def test_trie_merges_shared_prefixes():
    trie = build_trie(stack([(4, 5), (4, 6), (7, 5), (4, 5)]))
    assert trie.tokens.tolist() == [4, 5, 6, 7, 5] and trie.parents.tolist() == [-1, 0, 0, -1, 3]
    assert trie.weights.tolist() == [3, 2, 1, 1, 1]


def test_window_tokens_by_hand():
    """W = 3 columns, 2 levels, after a context of 10 tokens (its last token at position 9 is cell (0, 0))."""
    levels = [[99, 11, 12], [20, 21, 22]]
    aux = window_tokens(levels, context_length=10)
    # cells in order: (0, 1) (0, 2) (1, 0) (1, 1) (1, 2)
    assert aux.tokens.tolist() == [11, 12, 20, 21, 22]
    assert aux.positions.tolist() == [10, 11, 10, 11, 12]
    expected = torch.tensor([
        [1, 0, 0, 0, 0],  # (0, 1): level 0 up to column 1
        [1, 1, 0, 0, 0],  # (0, 2)
        [0, 0, 1, 0, 0],  # (1, 0): column 0 (its level-0 cell is the context's last token)
        [1, 0, 0, 1, 0],  # (1, 1): (0, 1) and itself
        [1, 1, 0, 0, 1],  # (1, 2): (0, 1), (0, 2) and itself
    ], dtype=torch.bool)
    assert torch.equal(aux.mask, expected)


def test_with_auxiliary_hides_the_draft_and_the_window_from_each_other():
    aux = AuxiliaryTokens(torch.tensor([7, 8]), torch.tensor([5, 6]), torch.ones(2, 2, dtype=torch.bool).tril())
    positions, mask = chain_inputs(3, num_pending=2, context_length=5)
    fed, positions, mask = with_auxiliary(torch.tensor([1, 2, 3]), positions, mask, aux, num_pending=2)
    # pending tokens at 3, 4; a one-token chain draft at 5; the window after them
    assert fed.tolist() == [1, 2, 3, 7, 8] and positions.tolist() == [3, 4, 5, 5, 6]
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # the draft token: the context, not the window
        [1, 1, 0, 1, 0],  # the window: the context and its own rows, not the draft
        [1, 1, 0, 1, 1],
    ]


# --- The plain Jacobi iteration -------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 4, 9])
def test_jacobi_fixed_point_is_greedy_decoding_within_n_updates(tiny_target, reference, n):
    """From any guesses, the iterate after k updates agrees with greedy decoding on its first k tokens,
    so the fixed point, reached in at most n updates, is the greedy block."""
    lm = HFCausalLM(tiny_target)
    g = torch.Generator().manual_seed(n)
    for i, prompt in enumerate(PROMPTS[:3]):
        greedy = reference[i][:n]
        for guesses in ([0] * n, torch.randint(0, 97, (n,), generator=g).tolist(), extend_guesses(prompt, [], n)):
            solution = jacobi_fixed_point(lm, prompt, guesses)
            assert solution.converged and solution.tokens == greedy
            assert solution.iterations <= n
            for k, iterate in enumerate(solution.trajectory):
                assert iterate[:k] == greedy[:k]
        # starting from the answer: already a fixed point
        assert jacobi_fixed_point(lm, prompt, greedy).iterations == 0


def test_jacobi_fixed_point_takes_several_updates_from_poor_guesses(tiny_target):
    """Not every run is a lucky one-update copy: the iteration does the work the bound allows for."""
    lm = HFCausalLM(tiny_target)
    iterations = [jacobi_fixed_point(lm, p, [0] * 6).iterations for p in PROMPTS]
    assert max(iterations) >= 3


# --- Through the engine ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_speculative_equals_plain(kind, tiny_target, reference):
    drafter = KINDS[kind]()
    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=drafter)
    accepted = 0
    for _, _, result in greedy_runs(engine, PROMPTS, reference, LENGTHS):
        accepted += sum(s.accepted for s in result.steps)
        if kind.startswith("lookahead"):  # the window rode every forward but the last (room for no draft)
            assert all(s.auxiliary_tokens > 0 for s in result.steps[:-1])
    assert accepted > 0  # not vacuous: the drafts were right at times (the loops of a tiny model)
    if kind == "lookahead-window-only":  # n-grams from the Jacobi trajectories alone were accepted
        assert accepted > 20


def test_lookahead_verifies_trees_from_the_pool(tiny_target):
    drafter = LookaheadDrafter(window=3, ngram=3, candidates=4)
    drafter.begin(PROMPTS[0])
    context = [5, 6, 7, 5, 8, 9, 5, 6, 1, 5]  # "5" was followed by 6 7, 8 9 and 6 1
    draft = drafter.propose(context, 10, SamplingParams(), None)
    assert draft.tokens.tolist() == [6, 1, 8, 9, 7] and draft.parents.tolist() == [-1, 0, -1, 2, 0]
    assert len(draft.auxiliary) == 3 - 1  # one level: level 0 past the context's last token
    assert len(drafter.propose(context, 1, SamplingParams(), None)) == 2  # room for one token: depth 1


class _Fixed(Drafter):
    """Proposes one given draft, for comparing the same step with and without a window."""

    def __init__(self, draft: Draft):
        self.draft = draft

    def propose(self, context, max_tokens, params, generator) -> Draft:
        return self.draft


def test_auxiliary_tokens_leave_verification_and_cache_as_they_were(tiny_target):
    """The same tree draft verified with and without a lookahead window: the same draft logits (to
    float rounding), verdict and cache length, and a next forward that sees the same cache."""
    context = PROMPTS[1] + [3, 9, 3, 9]
    tree = Draft(tokens=torch.tensor([3, 9, 4, 9]), parents=torch.tensor([-1, 0, -1, 2]))
    levels = [[context[-1], 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    window = window_tokens(levels, len(context))
    outcomes = []
    for auxiliary in (None, window):
        draft = Draft(tokens=tree.tokens, parents=tree.parents, auxiliary=auxiliary)
        lm = HFCausalLM(tiny_target)
        lm.forward(torch.tensor(context[:-3]))  # three context tokens pending
        engine = SpeculativeEngine(lm, drafter=_Fixed(draft))
        step = engine.step(context, 10, SamplingParams(), None)
        verdict = step.verdict
        assert lm.cache_length == len(context) + verdict.num_accepted
        following = lm.forward(torch.tensor([verdict.tokens[-1]])).logits  # [1, vocab]
        outcomes.append((step.logits, verdict, following))
    (plain, plain_verdict, plain_next), (rode, rode_verdict, rode_next) = outcomes
    assert rode.shape[0] == plain.shape[0] + len(window)
    torch.testing.assert_close(rode[: plain.shape[0]], plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(rode[: plain.shape[0]].argmax(-1), plain.argmax(-1))
    assert rode_verdict == plain_verdict
    torch.testing.assert_close(rode_next, plain_next, atol=1e-5, rtol=1e-5)


def test_window_rows_are_the_chains_they_stand_for(tiny_target):
    """Reference vs fast: the logits of window cell (l, c) equal a plain causal forward over the context
    and the chain of cells it attends to (level 0 up to column c, then column c up to level l)."""
    context = PROMPTS[2]
    levels = [[context[-1], 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    window = window_tokens(levels, len(context))
    lm = HFCausalLM(tiny_target)
    lm.forward(torch.tensor(context[:-1]))
    fed, positions, mask = with_auxiliary(torch.tensor(context[-1:]), *chain_inputs(1, 1, len(context)), window, 1)
    rows = lm.forward(fed, positions=positions, tree_mask=mask).logits[1:]  # [m, vocab]
    cells = [(depth, c) for depth in range(3) for c in range(4) if (depth, c) != (0, 0)]
    for row, (depth, c) in zip(rows, cells):
        chain = levels[0][1 : c + 1] + [levels[k][c] for k in range(1, depth + 1)]
        with torch.no_grad():
            expected = tiny_target(torch.tensor([context + chain])).logits[0, -1].float()
        torch.testing.assert_close(row, expected, atol=1e-4, rtol=1e-4)


def test_window_is_left_out_near_the_end_of_the_context(tiny_target):
    drafter = LookaheadDrafter(window=5, ngram=3, max_context=30)
    drafter.begin([])
    assert drafter.propose(list(range(10)), 5, SamplingParams(), None).auxiliary is not None
    assert drafter.propose(list(range(26)), 3, SamplingParams(), None).auxiliary is None


# kind: (drafter, sampling, runs); fake models of 4 tokens (fakes.py: TARGET after PROMPT, in which "2"
# was followed by 1, 0 and 3, so lookahead's pool has 3 n-grams), chi-square at 1e-4 with power against
# any 5% total-variation error in the first three tokens (goodness_of_fit): jacobi 58 cells, power 0.90
# (no top-k: it would cut the first guess); lookahead (its window's logits ride in the forward) 45 cells,
# power 0.91
SAMPLED = {
    "jacobi": (lambda: JacobiDrafter(block_size=2), SamplingParams(0.8, top_p=0.95), 7400),
    "lookahead": (lambda: LookaheadDrafter(window=3, ngram=3, candidates=3), SamplingParams(1.0, top_p=0.9), 6800),
}


@pytest.mark.parametrize("kind", list(SAMPLED))
def test_sampled_output_follows_target_distribution(kind, one_thread):
    """Under sampling both still draft (deterministic guesses, verified as one-hot): the first three
    sampled tokens follow the target's exact distribution, with two-token drafts verified, bonus tokens
    after them and corrections all exercised."""
    make, params, runs = SAMPLED[kind]
    drafter = make()
    drafter.begin(PROMPT)
    probe = drafter.propose(PROMPT, 2, params, None)
    assert len(probe) >= 2 and probe.probs is None  # it drafts, deterministically
    outcomes = engine_outcomes(SpeculativeEngine(FakeLM(TARGET), drafter=drafter), PROMPT, 3, params, runs)
    outcomes.assert_exercised(share=0.02)  # Jacobi's guesses are right less often than a draft model's
    assert_follows(outcomes.counts, continuations(TARGET, PROMPT, 3, params), kind)


def test_builders(tiny_target):
    target = HFCausalLM(tiny_target)
    jacobi, lookahead = build_jacobi(target, None, None), build_lookahead(target, None, None)
    assert isinstance(jacobi, JacobiDrafter) and jacobi.name == "jacobi" and jacobi.needs.logits
    assert isinstance(lookahead, LookaheadDrafter) and lookahead.name == "lookahead"
    assert lookahead.max_context == target.max_context
    with pytest.raises(UserError):
        LookaheadDrafter(ngram=1)
    with pytest.raises(UserError):
        JacobiDrafter(block_size=0)


# --- llama.cpp: the window as sequence ids ---------------------------------------------------------


def test_lookahead_on_llamacpp_equals_plain_and_torch(tmp_path):
    """llama.cpp expresses the window with one sequence per column: greedy output as plain decoding's,
    and step for step the same acceptances as on torch (the window's logits agree too)."""
    pytest.importorskip("llama_cpp")
    from specdecode.models.llamacpp import LlamaCppLM

    model = tiny_chat_qwen2(vocab_size=len(TOKENS), seed=5)
    write_tiny_gguf(model, tmp_path / "target.gguf")
    lm = LlamaCppLM(tmp_path / "target.gguf", n_ctx=128)
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    accepted = 0
    for prompt in random_prompts(2, seed=3, vocab=len(TOKENS)):
        plain = SpeculativeEngine(lm).generate(prompt, config).token_ids
        ours = SpeculativeEngine(lm, drafter=LookaheadDrafter()).generate(prompt, config)
        on_torch = SpeculativeEngine(HFCausalLM(model), drafter=LookaheadDrafter()).generate(prompt, config)
        assert ours.token_ids == plain
        assert [s.accepted for s in ours.steps] == [s.accepted for s in on_torch.steps]
        accepted += sum(s.accepted for s in ours.steps)
    assert accepted > 0
    # a mask without the sequence form (the third token sees two that do not see each other's side)
    bad = AuxiliaryTokens(torch.tensor([1, 2, 3]), torch.tensor([5, 5, 6]),
                          torch.tensor([[1, 0, 0], [0, 1, 0], [1, 1, 1]], dtype=torch.bool))
    engine = SpeculativeEngine(lm, drafter=_Fixed(Draft(tokens=torch.empty(0, dtype=torch.long), auxiliary=bad)))
    with pytest.raises(UserError, match="torch backend"):
        engine.generate([1, 2, 3, 4], GenerationConfig(max_new_tokens=4))


def test_window_and_guesses_follow_the_cost_curve(tiny_target, reference):
    """Where width is dear (each token a forward costs a full forward), lookahead leaves its window out
    and keeps only the trie nodes that pay, and Jacobi's guesses are cut by the gate; where it is nearly
    free, both run whole. The output is plain decoding's either way."""
    from specdecode.models.costs import CostCurve

    dear, free = CostCurve.linear(1.0), CostCurve.linear(0.0)
    config = GenerationConfig(max_new_tokens=24)
    for curve, wide in ((dear, False), (free, True)):
        lookahead = SpeculativeEngine(HFCausalLM(tiny_target), drafter=LookaheadDrafter(curve=curve))
        jacobi = SpeculativeEngine(HFCausalLM(tiny_target), drafter=JacobiDrafter())
        jacobi.curve = curve
        for i, prompt in enumerate(PROMPTS[:3]):
            windowed = lookahead.generate(prompt, config)
            guessed = jacobi.generate(prompt, config)
            assert windowed.token_ids == guessed.token_ids == reference[i][:24]
            steps = windowed.steps[:-1]
            assert all(s.auxiliary_tokens > 0 for s in steps) if wide else not any(s.auxiliary_tokens for s in steps)
            assert (sum(s.drafted for s in guessed.steps[1:]) > 0) == wide
