"""Statistical, end to end: sampled output under penalties, a logit bias and min-p follows the target's
penalised distribution, chains and trees alike.

The exact distribution is enumerated in the test's harness (`goodness_of_fit.penalised` then `processed`:
the bias, the repetition, frequency and presence penalties, then temperature, top-k, min-p and top-p, written
plainly): each token's probability after the prompt and the tokens before it. The drafters draft from
distributions that know nothing of the penalties, so their drafts are turned down often, and verification must
still give each position exactly plain decoding's penalised distribution (`engine.penalties`). Power as in
`test_engine_sampling.py`: each case's figure is in its comment (asserted by `assert_follows`).
"""

from __future__ import annotations

import pytest
import torch

import fakes
from fakes import FakeLM, IndependentTreeDrafter
from goodness_of_fit import assert_engine_follows_target, assert_follows, continuations, penalised, processed
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupTreeDrafter
from specdecode.engine.penalties import TokenHistory
from specdecode.models.costs import CostCurve
from specdecode.sampling import logits_to_probs
from specdecode.types import Draft, SamplingParams

FREE = CostCurve.linear(0.0)
PENALISED = SamplingParams(0.9, repetition_penalty=1.4, frequency_penalty=0.4, presence_penalty=0.3,
                           logit_bias=((2, 0.6),))
CASES = {  # kind: (drafter, sampling, runs); fakes.TARGET after fakes.PROMPT, fakes.DRAFT to draft from
    # a draft model's sampled chain, verified with its probs, every penalty and a bias: 61 cells, power 0.90
    "chain": (lambda: DraftModelDrafter(FakeLM(fakes.DRAFT), num_tokens=2, adaptive=False, confidence_threshold=0),
              PENALISED, 7600),
    # the same chain on the draft model's default CPU path (a confidence threshold: `DraftModelDrafter._draft`, which
    # may stop early): 61 cells, power 0.91
    "chain-stops-early": (lambda: DraftModelDrafter(FakeLM(fakes.DRAFT), num_tokens=2, adaptive=False,
                                                    confidence_threshold=0.05), PENALISED, 7600),
    # two children of the context and two of each drawn i.i.d., with probs, min-p too: 53 cells, power 0.90
    "iid-tree": (lambda: IndependentTreeDrafter(fakes.DRAFT, widths=(2, 2)),
                 SamplingParams(1.0, min_p=0.12, frequency_penalty=0.8, logit_bias=((0, -0.5),)), 7200),
    # a prompt-lookup trie (fixed branches), a repetition penalty below 1 (favouring the copies it drafts) and
    # a frequency penalty: 64 cells, power 0.90
    "pld-tree": (lambda: PromptLookupTreeDrafter(FREE, max_ngram=1, num_tokens=2),
                 SamplingParams(1.0, repetition_penalty=0.7, frequency_penalty=0.5), 7700),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_penalised_sampled_output_follows_target_distribution(kind, one_thread):
    make, params, runs = CASES[kind]
    assert_engine_follows_target(make(), params, runs, kind)


def test_the_penalties_move_the_distribution():
    """Else the cases above would test what test_engine_sampling.py does: each case's exact distribution is
    far from the unpenalised one."""
    for kind, (_, params, _) in CASES.items():
        plain = SamplingParams(params.temperature, params.top_k, params.top_p)
        moved = continuations(fakes.TARGET, fakes.PROMPT, 3, params)
        free = continuations(fakes.TARGET, fakes.PROMPT, 3, plain)
        assert 0.5 * float((moved - free).abs().sum()) > 0.1, kind


def path_to(row: int, tokens: torch.Tensor, parents: torch.Tensor | None) -> list[int]:
    """The draft tokens before a row's position: its node's path (row 0: none; a chain: the nodes before)."""
    path, node = [], row - 1
    while node >= 0:
        path.insert(0, int(tokens[node]))
        node = int(parents[node]) if parents is not None else node - 1
    return path


def test_every_row_of_a_tree_is_penalised_by_its_own_path():
    """Reference against fast: `TokenHistory.penalise` over a tree's rows equals the harness's plain penalties
    applied to each row's logits after the prompt, the generated tokens and the row's path."""
    torch.manual_seed(0)
    vocab, prompt, generated = 9, [1, 4, 4, 7], [2, 4, 2]
    params = SamplingParams(1.0, repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4,
                            logit_bias=((3, 1.5), (2, -2.0)))
    history = TokenHistory(prompt, params, vocab, "cpu")
    history.add(generated[:1])
    history.add(generated[1:])
    tokens = torch.tensor([2, 5, 2, 8, 2, 5])
    parents = torch.tensor([-1, -1, 0, 2, 3, 1])
    rows = torch.randn(len(tokens) + 1, vocab) * 3
    fast = history.penalise(rows, Draft(tokens=tokens, parents=parents))
    for row in range(len(tokens) + 1):
        path = path_to(row, tokens, parents)
        expected = penalised(rows[row].tolist(), params, tuple(prompt), tuple(generated + path))
        assert fast[row].tolist() == pytest.approx(expected, abs=1e-5), row
    chain = Draft(tokens=torch.tensor([4, 4, 6]))
    fast = history.penalise(rows[:4], chain)
    for row in range(4):
        expected = penalised(rows[row].tolist(), params, tuple(prompt), tuple(generated + [4, 4, 6][:row]))
        assert fast[row].tolist() == pytest.approx(expected, abs=1e-5), row


def test_min_p_keeps_the_tokens_near_the_likeliest():
    """Known by hand: probabilities 0.5, 0.3, 0.15, 0.05 under min-p 0.25 keep those at least 0.125."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = logits_to_probs(logits, SamplingParams(1.0, min_p=0.25))
    assert probs.tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert processed(logits.tolist(), SamplingParams(1.0, min_p=0.25)) == pytest.approx(probs.tolist())
    draws = torch.multinomial(probs, 20000, replacement=True, generator=torch.Generator().manual_seed(0))
    assert_follows(torch.bincount(draws, minlength=4).double(), probs.double(), "min-p")


# a draft model's sampled chain, which drafts token 3 (made the target's end-of-sequence token) anywhere, under
# min_tokens 2: the end may come third at the earliest. 36 cells, power 0.98 (asserted)
MIN_TOKENS = SamplingParams(0.9, min_tokens=2, frequency_penalty=0.3)


def test_min_tokens_sampled_output_follows_target_distribution(one_thread):
    drafter = DraftModelDrafter(FakeLM(fakes.DRAFT), num_tokens=2, adaptive=False, confidence_threshold=0)
    assert_engine_follows_target(drafter, MIN_TOKENS, 7600, "min-tokens", ends=(3,))
    held = continuations(fakes.TARGET, fakes.PROMPT, 3, MIN_TOKENS, ends=(3,))
    free = continuations(fakes.TARGET, fakes.PROMPT, 3, MIN_TOKENS, ends=())
    assert held[3].sum() == held[:, 3].sum() == 0 and 0.5 * float((held - free).abs().sum()) > 0.1


def test_min_tokens_holds_the_end_off_each_row_by_its_own_position():
    """Reference against fast: under min_tokens each row of a tree or chain has the end tokens at -inf exactly where
    its position (the generated tokens, then its path's) comes before min_tokens, as the harness says."""
    torch.manual_seed(1)
    vocab, prompt, generated = 9, [1, 4], [2]
    params = SamplingParams(1.0, min_tokens=4, logit_bias=((3, 1.0),))
    history = TokenHistory(prompt, params, vocab, "cpu", ends=frozenset({3, 6}))
    history.add(generated)
    tokens = torch.tensor([2, 5, 2, 8, 2, 5])
    for parents in (torch.tensor([-1, -1, 0, 2, 3, 1]), None):
        rows = torch.randn(len(tokens) + 1, vocab) * 3
        fast = history.penalise(rows, Draft(tokens=tokens, parents=parents))
        for row in range(len(tokens) + 1):
            path = path_to(row, tokens, parents)
            expected = penalised(rows[row].tolist(), params, tuple(prompt), tuple(generated + path), ends=(3, 6))
            assert fast[row].tolist() == pytest.approx(expected, abs=1e-5), (parents is None, row)
        assert torch.isinf(fast[:, 3]).any() and not torch.isinf(fast[:, 3]).all()  # both kinds of row
