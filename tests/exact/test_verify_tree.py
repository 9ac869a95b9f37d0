"""Tree verification: exact cases with peaked logits whose verdict is known by hand, greedy tree
verification against chain verification and against the definition of greedy decoding, and a statistical
test that multi-draft speculative sampling over a tree reproduces the target's joint distribution of the
first three tokens (with a negative control: a deliberately wrong verifier must fail the same test), and
the refusal of a tree's draft probabilities unless its nodes were drawn independently.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from goodness_of_fit import assert_follows, chi_square
from specdecode.sampling import sample
from specdecode.tree import structure
from specdecode.types import Draft, SamplingParams
from specdecode.verify.chain import verify_greedy
from specdecode.verify.tree import verify, verify_tree_greedy, verify_tree_sampling

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: threads only contend

V = 6


def peaked(tokens: list[int], height: float = 20.0) -> torch.Tensor:
    """[len(tokens), V] logits with a sharp peak at each given token."""
    logits = torch.zeros(len(tokens), V)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = height
    return logits


def one_hot(tokens: list[int], vocab: int = V) -> torch.Tensor:
    """[len(tokens), vocab] exact one-hot probabilities: sampling outcomes are certain."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


# Tree T used by the exact cases (node: token):
#
#   context
#   ├── 0: 1
#   │   ├── 2: 3
#   │   └── 3: 4
#   └── 1: 2
#       ├── 4: 3
#       │   └── 6: 0
#       └── 5: 5
T_PARENTS = torch.tensor([-1, -1, 0, 0, 1, 1, 4])
T_TOKENS = torch.tensor([1, 2, 3, 4, 3, 5, 0])


def t_logits(after: dict[int, int]) -> torch.Tensor:
    """Logits for tree T: row 0 after the context (key -1), row i + 1 after node i. Rows not given peak
    at a token that no child offers (that would stop the walk early if a wrong row were read)."""
    return peaked([after.get(node, 5) for node in range(-1, 7)])


# --- Greedy ---------------------------------------------------------------------------------------


def test_greedy_finds_the_deepest_match_in_the_second_branch():
    # context -> 2 (node 1) -> 3 (node 4) -> the target wants 5 but node 4 only offers 0
    logits = t_logits({-1: 2, 0: 3, 1: 3, 4: 5})
    verdict = verify_tree_greedy(logits, T_TOKENS, T_PARENTS)
    assert verdict.path == (1, 4)
    assert verdict.tokens == (2, 3, 5)
    assert (verdict.num_drafted, verdict.num_accepted, verdict.bonus) == (7, 2, False)


def test_greedy_no_child_matches_stops_at_the_root():
    logits = t_logits({-1: 4, 0: 3, 1: 3})  # the context's children offer 1 and 2, the target wants 4
    verdict = verify_tree_greedy(logits, T_TOKENS, T_PARENTS)
    assert (verdict.path, verdict.tokens, verdict.num_accepted, verdict.bonus) == ((), (4,), 0, False)


def test_greedy_reaching_a_leaf_gives_a_bonus_from_the_leaf_row():
    logits = t_logits({-1: 2, 1: 3, 4: 0, 6: 1})
    verdict = verify_tree_greedy(logits, T_TOKENS, T_PARENTS)
    assert verdict.path == (1, 4, 6)
    assert verdict.tokens == (2, 3, 0, 1)  # 1 is the argmax of row 7, after leaf 6
    assert verdict.bonus is True and verdict.num_accepted == 3


def test_greedy_leaf_at_depth_two_in_the_first_branch():
    logits = t_logits({-1: 1, 0: 4, 3: 2})
    verdict = verify_tree_greedy(logits, T_TOKENS, T_PARENTS)
    assert (verdict.path, verdict.tokens, verdict.bonus) == ((0, 3), (1, 4, 2), True)


def test_greedy_duplicate_siblings_take_the_first():
    #   context
    #   ├── 0: 2
    #   │   └── 2: 1
    #   └── 1: 2   (same token as node 0)
    #       └── 3: 3
    parents = torch.tensor([-1, -1, 0, 1])
    tokens = torch.tensor([2, 2, 1, 3])
    # after node 0 the target wants 1 (node 2 matches); after node 1 it would want 3 (node 3 matches)
    logits = peaked([2, 1, 3, 4, 0])
    verdict = verify_tree_greedy(logits, tokens, parents)
    assert (verdict.path, verdict.tokens, verdict.bonus) == ((0, 2), (2, 1, 4), True)


def test_greedy_empty_tree_is_plain_decoding():
    verdict = verify_tree_greedy(peaked([3]), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    assert (verdict.num_drafted, verdict.num_accepted, verdict.tokens, verdict.path) == (0, 0, (3,), ())


def test_greedy_chain_as_a_tree_equals_chain_verification():
    g = torch.Generator().manual_seed(0)
    accepted_lengths = set()
    for _ in range(400):
        k = int(torch.randint(0, 7, (), generator=g))
        logits = torch.randn(k + 1, V, generator=g)
        # draft the target's argmax for a random prefix, then random tokens (which may match by chance)
        tokens = logits[:k].argmax(-1)
        cut = int(torch.randint(0, k + 1, (), generator=g))
        tokens[cut:] = torch.randint(0, V, (k - cut,), generator=g)
        chain = verify_greedy(logits, tokens)
        tree = verify_tree_greedy(logits, tokens, structure.chain(k))
        assert (tree.tokens, tree.num_accepted, tree.num_drafted) == (
            chain.tokens, chain.num_accepted, chain.num_drafted
        )
        assert (tree.path, tree.bonus) == (chain.path, chain.bonus)
        # and through the dispatcher, as a chain draft and as a tree draft
        via_chain = verify(logits, Draft(tokens=tokens), SamplingParams(), None)
        via_tree = verify(logits, Draft(tokens=tokens, parents=structure.chain(k)), SamplingParams(), None)
        assert via_chain == chain and via_tree == tree
        accepted_lengths.add(chain.num_accepted)
    assert len(accepted_lengths) >= 5  # the loop covered short and long acceptances


@st.composite
def greedy_cases(draw):
    n = draw(st.integers(0, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = [draw(st.integers(0, 2)) for _ in range(n)]  # 3 tokens: matches and duplicates are common
    rows = [draw(st.integers(0, 2)) for _ in range(n + 1)]  # the target's argmax at each row
    return torch.tensor(parents, dtype=torch.long), torch.tensor(tokens, dtype=torch.long), rows


@settings(max_examples=300, deadline=None)
@given(greedy_cases())
def test_greedy_tree_verdict_is_greedy_decoding_down_the_tree(case):
    """The definition, checked node by node: the path is a root-to-node path, every accepted token is the
    target's argmax after its prefix, the walk cannot go deeper, and the last token is the argmax after
    the path."""
    parents, tokens, rows = case
    logits = torch.zeros(len(rows), 3)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 1.0
    verdict = verify_tree_greedy(logits, tokens, parents)
    p, t = parents.tolist(), tokens.tolist()
    node = -1
    for child in verdict.path:
        assert p[child] == node
        assert t[child] == rows[node + 1]
        # the first such child: no earlier sibling offered the same token
        assert all(t[s] != rows[node + 1] for s in range(child) if p[s] == node)
        node = child
    assert all(not (p[s] == node and t[s] == rows[node + 1]) for s in range(len(p)))  # nowhere deeper to go
    assert verdict.tokens == tuple(t[c] for c in verdict.path) + (rows[node + 1],)
    assert verdict.bonus == (node not in p)
    assert verdict.num_accepted == len(verdict.path) and verdict.num_drafted == len(p)


# --- Sampling, certain outcomes -------------------------------------------------------------------


def t_probs(after: dict[int, int]) -> torch.Tensor:
    """Exact one-hot target probabilities for tree T (rows as in t_logits)."""
    return one_hot([after.get(node, 5) for node in range(-1, 7)])


@pytest.mark.parametrize("draft_probs", [None, "uniform"])
def test_sampling_with_certain_target_follows_the_only_possible_path(draft_probs):
    probs = None if draft_probs is None else torch.full((7, V), 1.0 / V)
    target = t_probs({-1: 2, 1: 3, 4: 5})
    for seed in range(30):
        verdict = verify_tree_sampling(target, T_TOKENS, T_PARENTS, probs, torch.Generator().manual_seed(seed))
        assert (verdict.path, verdict.tokens, verdict.bonus) == ((1, 4), (2, 3, 5), False)


def test_sampling_with_certain_target_reaches_a_leaf():
    target = t_probs({-1: 1, 0: 3, 2: 4})
    for seed in range(30):
        verdict = verify_tree_sampling(target, T_TOKENS, T_PARENTS, None, torch.Generator().manual_seed(seed))
        assert (verdict.path, verdict.tokens, verdict.bonus) == ((0, 2), (1, 3, 4), True)


def test_sampling_rejects_every_child_and_corrects_from_the_residual():
    # the target splits its mass between 1 (offered by node 0) and 4 (offered by nobody); the
    # deterministic draft's node 0 is rejected half of the time, and then the residual is exactly 4
    target = t_probs({})
    target[0] = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5, 0.0])
    target[1] = one_hot([3])[0]  # after node 0
    outcomes = set()
    for seed in range(60):
        verdict = verify_tree_sampling(target, T_TOKENS, T_PARENTS, None, torch.Generator().manual_seed(seed))
        outcomes.add((verdict.path, verdict.tokens, verdict.bonus))
    assert outcomes == {((), (4,), False), ((0, 2), (1, 3, 5), True)}


def test_verify_dispatches_trees_on_temperature():
    logits = t_logits({-1: 2, 1: 3, 4: 5}) * 5  # peaks of 100: sampling at temperature 1 is certain
    draft = Draft(tokens=T_TOKENS, parents=T_PARENTS)
    assert verify(logits, draft, SamplingParams(), None).tokens == (2, 3, 5)
    sampled = verify(logits, draft, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert (sampled.path, sampled.tokens) == ((1, 4), (2, 3, 5))


def test_tree_probs_are_refused_unless_drawn_independently():
    """Probs on a tree promise siblings drawn independently (Draft.drawn_independently): without the
    promise verification refuses them, greedy too (the drafter is wrong either way); a tree without probs
    and a chain with them need no promise."""
    logits = t_logits({-1: 2, 1: 3, 4: 5})
    probs = torch.full((7, V), 1.0 / V)  # [nodes, vocab]
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        g = torch.Generator().manual_seed(0)
        with pytest.raises(ValueError, match="drawn_independently"):
            verify(logits, Draft(tokens=T_TOKENS, parents=T_PARENTS, probs=probs), params, g)
        promised = Draft(tokens=T_TOKENS, parents=T_PARENTS, probs=probs, drawn_independently=True)
        assert verify(logits, promised, params, g).tokens == (2, 3, 5)
        assert verify(logits, Draft(tokens=T_TOKENS, parents=T_PARENTS), params, g).tokens == (2, 3, 5)
        assert verify(logits[:3], Draft(tokens=torch.tensor([2, 3]), probs=probs[:2]), params, g).tokens[0] == 2


# --- Sampling, statistical ------------------------------------------------------------------------
#
# A vocabulary of SV tokens and a target whose every token depends on the one before: target_first [SV],
# target_second[first] [SV], then target_later[previous token] [SV] for the third token and beyond (the
# rows of nodes deeper than 1). Each trial builds a depth-2 (or deeper) tree, verifies it, and records the
# first three tokens (completing a short verdict from the target, as the engine's next steps would):
# the third is the bonus after a wholly accepted depth-2 path. Their counts must follow
# target_first[a] * target_second[a, b] * target_later[b, c]: 8,000 trials over 64 cells, chi-square
# at 1e-4, power 0.93 against any 5% total-variation error (goodness_of_fit).

SV = 4
TRIALS = 8_000

_g = torch.Generator().manual_seed(2024)
TARGET_FIRST = torch.softmax(torch.randn(SV, generator=_g) * 0.8, -1)
TARGET_SECOND = torch.softmax(torch.randn(SV, SV, generator=_g) * 0.8, -1)  # [first token, vocab]
TARGET_LATER = torch.softmax(torch.randn(SV, SV, generator=_g), -1)  # [node token, vocab]
Q_FIRST = torch.softmax(torch.randn(SV, generator=_g) * 1.5, -1)  # the drafter, deliberately different
Q_SECOND = torch.softmax(torch.randn(SV, SV, generator=_g) * 1.5, -1)  # [parent token, vocab]
# [SV, SV, SV] the exact joint distribution of the first three tokens
EXPECTED = TARGET_FIRST[:, None, None] * TARGET_SECOND[:, :, None] * TARGET_LATER[None, :, :]


def target_rows(tokens: list[int], parents: list[int]) -> torch.Tensor:
    """The target's distributions for a tree: row 0 after the context, row i + 1 after node i."""
    depth = structure.depths(torch.tensor(parents, dtype=torch.long)).tolist()
    rows = [TARGET_FIRST]
    for token, d in zip(tokens, depth):
        rows.append(TARGET_SECOND[token] if d == 1 else TARGET_LATER[token])
    return torch.stack(rows)


def draw(q: torch.Tensor, count: int, g: torch.Generator) -> list[int]:
    """count i.i.d. tokens from q (with replacement: repeats allowed)."""
    return torch.multinomial(q, count, replacement=True, generator=g).tolist()


def case_distinct_deterministic(g):
    """(a) A fixed tree, no draft probabilities (every node one-hot), distinct siblings.

        context
        ├── 0: 0 ── 3: 1, 4: 3
        ├── 1: 1 ── 5: 0
        └── 2: 2 ── 6: 2, 7: 1, 8: 0
    """
    parents = [-1, -1, -1, 0, 0, 1, 2, 2, 2]
    tokens = [0, 1, 2, 1, 3, 0, 2, 1, 0]
    return tokens, parents, None


def case_iid_sampled(g):
    """(b) Three children of the context i.i.d. from Q_FIRST, and under each two children i.i.d. from
    Q_SECOND[its token]; repeated siblings are allowed and common.

        context
        ├── 0 ── 3, 4
        ├── 1 ── 5, 6
        └── 2 ── 7, 8
    """
    parents = [-1, -1, -1, 0, 0, 1, 1, 2, 2]
    roots = draw(Q_FIRST, 3, g)
    tokens = roots + [t for r in roots for t in draw(Q_SECOND[r], 2, g)]
    probs = torch.stack([Q_FIRST] * 3 + [Q_SECOND[r] for r in roots for _ in range(2)])
    return tokens, parents, probs


def case_chain_and_wide_root(g):
    """(c) A sampled chain of depth 3 (node 0 from Q_FIRST, node 1 from Q_SECOND[node 0], node 2 from
    Q_SECOND[node 1]) next to fixed siblings at the root (one-hot rows), one with a fixed child, and a
    last root sibling sampled from Q_FIRST again.

        context
        ├── 0 (q) ── 1 (q) ── 2 (q)
        ├── 3: 1 (fixed) ── 6: 2 (fixed)
        ├── 4: 3 (fixed)
        └── 5 (q)
    """
    parents = [-1, 0, 1, -1, -1, -1, 3]
    t0 = draw(Q_FIRST, 1, g)[0]
    t1 = draw(Q_SECOND[t0], 1, g)[0]
    t2 = draw(Q_SECOND[t1], 1, g)[0]
    t5 = draw(Q_FIRST, 1, g)[0]
    tokens = [t0, t1, t2, 1, 3, t5, 2]
    fixed = one_hot([1, 3, 2], SV)
    probs = torch.stack([Q_FIRST, Q_SECOND[t0], Q_SECOND[t1], fixed[0], fixed[1], Q_FIRST, fixed[2]])
    return tokens, parents, probs


CASES = {
    "distinct": case_distinct_deterministic,
    "iid": case_iid_sampled,
    "chain_and_wide": case_chain_and_wide_root,
}
SEEDS = {"distinct": 11, "iid": 12, "chain_and_wide": 13}  # fixed: the test is reproducible


def target_after(tokens: list[int]) -> torch.Tensor:
    """[SV] the target's distribution of the token after the emitted `tokens`."""
    if not tokens:
        return TARGET_FIRST
    return TARGET_SECOND[tokens[0]] if len(tokens) == 1 else TARGET_LATER[tokens[-1]]


def first_three_counts(
    case, verifier, seed: int, trials: int = TRIALS, verdicts: list | None = None
) -> torch.Tensor:
    """[SV, SV, SV] counts of the first three emitted tokens; `verdicts`, if given, collects each trial's."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(SV, SV, SV)
    for _ in range(trials):
        tokens, parents, probs = case(g)
        verdict = verifier(target_rows(tokens, parents), torch.tensor(tokens), torch.tensor(parents), probs, g)
        if verdicts is not None:
            verdicts.append(verdict)
        emitted = list(verdict.tokens[:3])
        while len(emitted) < 3:  # what the engine's next steps would sample, given the tokens so far
            emitted.append(int(sample(target_after(emitted), g)))
        counts[tuple(emitted)] += 1
    return counts


def test_statistical_setup_is_informative():
    # the drafter disagrees with the target
    assert 0.5 * float((Q_FIRST - TARGET_FIRST).abs().sum()) > 0.2


@pytest.mark.parametrize("name", list(CASES))
def test_tree_sampling_reproduces_the_target_joint_distribution(name):
    verdicts: list = []
    counts = first_three_counts(CASES[name], verify_tree_sampling, seed=SEEDS[name], verdicts=verdicts)
    # the trials exercised every part of the tree: rejection at the root, at depth 1, and beyond, and
    # bonus tokens after two accepted ones
    accepted = torch.tensor([v.num_accepted for v in verdicts])
    histogram = torch.bincount(accepted.clamp(max=2), minlength=3) / TRIALS
    assert bool((histogram > 0.05).all()), f"accepted 0 / 1 / 2+ tokens: {histogram.tolist()}"
    assert sum(v.bonus and v.num_accepted >= 2 for v in verdicts) > 0.05 * TRIALS
    assert_follows(counts, EXPECTED, name)


class _Verdict:
    """Just the emitted tokens, which is all the statistical test reads."""

    def __init__(self, tokens):
        self.tokens = tokens


def verify_without_residual(target_probs, draft_tokens, parents, draft_probs, generator):
    """A WRONG verifier for the negative control: recursive rejection sampling that forgets to replace the
    target distribution by the residual after a rejection (both for the next sibling and for the
    correction token). Otherwise identical to the real one."""
    tokens = draft_tokens.tolist()
    kids = structure.children(parents)
    node, path = -1, []
    while True:
        probs = target_probs[node + 1]
        accepted = None
        for child in kids[node + 1]:
            token = tokens[child]
            q = float(draft_probs[child, token]) if draft_probs is not None else 1.0
            if float(torch.rand((), generator=generator)) * q < float(probs[token]):
                accepted = child
                break
            # BUG (deliberate): no `probs = residual_distribution(probs, draft_row)` here
        if accepted is None:
            last = int(sample(probs, generator))
            tokens_out = [tokens[i] for i in path] + [last]
            return _Verdict(tuple(tokens_out))
        path.append(accepted)
        node = accepted


@pytest.mark.parametrize("name", list(CASES))
def test_negative_control_a_verifier_without_residual_fails(name):
    """The statistical check has power: the same check, run on a verifier that skips the residual
    update, must fail clearly (1,500 trials are plenty: p-values below 1e-40)."""
    counts = first_three_counts(CASES[name], verify_without_residual, seed=SEEDS[name], trials=1_500)
    p_value, _ = chi_square(counts, EXPECTED)
    assert p_value < 1e-12, f"the wrong verifier went undetected: p {p_value:.2e}"
