"""Statistical: speculative sampling of a chain reproduces the target distribution, whatever the draft.

Over a small vocabulary the exact distribution of the first emitted tokens is known, so empirical counts
are compared with it by a chi-square test at 1e-4, with fixed seeds. The verifiers are pure functions and
cheap, so these tests draw enough to catch a total-variation error of 0.02 at least 90% of the time
(`FINE_TV`; goodness_of_fit states the power), and `test_a_planted_bias_of_two_percent_is_caught` plants
such an error in the verifier and sees the same test fail. (The end-to-end tests, each generation an engine
run, carry their power against 0.05: tests/statistical/test_engine_sampling.py.)
"""

import dataclasses
import itertools

import pytest
import torch

from goodness_of_fit import assert_follows, power, processed, runs_for_power
from specdecode.sampling import sample
from specdecode.types import Draft, SamplingParams
from specdecode.verify.chain import verify_chain, verify_speculative_sampling

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: threads only contend

V = 5
FINE_TV = 0.02  # the total-variation error these tests catch with power at least 0.9
DRAWS = runs_for_power(V, tv=FINE_TV)  # the first token, 5 cells


def emitted_first_tokens(target_probs, draft_probs, draft_len, generator, deterministic=False,
                         verify=verify_speculative_sampling):
    """Run verification DRAWS times with fresh drafts; count the first emitted token."""
    counts = torch.zeros(V)
    for _ in range(DRAWS):
        if deterministic:
            draft_tokens = torch.tensor([2] * draft_len)  # a fixed guess, like prompt lookup
            probs = None
        else:
            draft_tokens = sample(draft_probs[:draft_len], generator)
            probs = draft_probs[:draft_len]
        verdict = verify(target_probs[: draft_len + 1], draft_tokens, probs, generator)
        counts[verdict.tokens[0]] += 1
    return counts


def case(draft_len: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """(a generator, target probabilities [6, V], draft probabilities [6, V]), seeded by the draft's length."""
    generator = torch.Generator().manual_seed(1234 + draft_len)
    target_probs = torch.softmax(torch.randn(6, V, generator=generator) * 1.5, -1)  # [positions, vocab]
    draft_probs = torch.softmax(torch.randn(6, V, generator=generator) * 1.5, -1)
    return generator, target_probs, draft_probs


@pytest.mark.parametrize("draft_len", [1, 3, 5])
@pytest.mark.parametrize("deterministic", [False, True])
def test_first_token_follows_target(draft_len, deterministic):
    generator, target_probs, draft_probs = case(draft_len)
    counts = emitted_first_tokens(target_probs, draft_probs, draft_len, generator, deterministic)
    assert_follows(counts, target_probs[0], tv=FINE_TV)


@pytest.mark.parametrize("draft_len", [1, 3])
def test_a_planted_bias_of_two_percent_is_caught(draft_len):
    """A verifier off by a total variation of exactly 0.02 (after a correct verdict, its first token moved from
    the likeliest to the next likeliest with probability 0.02 / p(likeliest): the hardest place for a chi-square
    test to see the mass move, where the expected counts are largest; moved to the rarest token it is seen at a
    tenth of the draws): the test above, with the same draws, rejects it (its power against such an error: at
    least 0.9; with these seeds, every time)."""
    generator, target_probs, draft_probs = case(draft_len)
    likeliest, second = target_probs[0].topk(2).indices.tolist()
    move = FINE_TV / float(target_probs[0, likeliest])

    def biased(*args):
        verdict = verify_speculative_sampling(*args)
        if verdict.tokens[0] == likeliest and float(torch.rand((), generator=generator)) < move:
            return dataclasses.replace(verdict, tokens=(second, *verdict.tokens[1:]))
        return verdict

    assert power(DRAWS, V, tv=FINE_TV) >= 0.9
    counts = emitted_first_tokens(target_probs, draft_probs, draft_len, generator, verify=biased)
    with pytest.raises(AssertionError, match="chi-square p-value"):
        assert_follows(counts, target_probs[0], tv=FINE_TV)


def test_two_token_joint_distribution_with_dependent_positions():
    """A context-dependent target: the second token's distribution depends on the first. Drafts of
    length 2 are sampled from a draft model that is also context-dependent; the joint distribution of
    the first two emitted tokens must equal the target's joint distribution (25 cells, power 0.9 against a
    total variation of 0.02)."""
    g = torch.Generator().manual_seed(7)
    target_first = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    target_second = torch.softmax(torch.randn(V, V, generator=g) * 2, -1)  # [first token, vocab]
    draft_first = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    draft_second = torch.softmax(torch.randn(V, V, generator=g) * 2, -1)
    target_third = torch.full((V,), 1.0 / V)
    counts = torch.zeros(V, V)
    for _ in range(runs_for_power(V * V, tv=FINE_TV)):
        d0 = int(sample(draft_first, g))
        d1 = int(sample(draft_second[d0], g))
        target_probs = torch.stack([target_first, target_second[d0], target_third])
        draft_probs = torch.stack([draft_first, draft_second[d0]])
        verdict = verify_speculative_sampling(target_probs, torch.tensor([d0, d1]), draft_probs, g)
        first = verdict.tokens[0]
        if len(verdict.tokens) >= 2:
            second = verdict.tokens[1]
        else:  # rejected at position 0: the next token comes from the target given the correction
            second = int(sample(target_second[first], g))
        counts[first, second] += 1
    assert_follows(counts, target_first[:, None] * target_second, tv=FINE_TV)


@pytest.mark.parametrize("params", [SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.8)])
def test_processed_distribution_is_reproduced(params):
    """With temperature/top-k/top-p applied to both sides (verify_chain processes the target's logits),
    the first token follows the processed target, computed here plainly: tokens outside it never come."""
    g = torch.Generator().manual_seed(99)
    target_logits = torch.randn(3, V, generator=g) * 2  # [draft_len + 1, vocab]
    draft_logits = torch.randn(2, V, generator=g) * 2
    draft_probs = torch.tensor([processed(row, params) for row in draft_logits.tolist()])  # [2, vocab]
    counts = torch.zeros(V)
    for _ in range(DRAWS):
        draft = Draft(tokens=sample(draft_probs, g), probs=draft_probs)
        counts[verify_chain(target_logits, draft, params, g).tokens[0]] += 1
    expected = torch.tensor(processed(target_logits[0].tolist(), params))
    assert int((expected > 0).sum()) < V  # the processing cut something
    assert_follows(counts, expected, tv=FINE_TV)  # (asserts that the cut tokens never came)


def test_deterministic_draft_is_exact_under_repeated_seed():
    """A seed reproduces a run."""
    probs = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(0)), -1)
    runs = [
        [verify_speculative_sampling(probs, torch.tensor([1, 2, 3]), None, g).tokens for _ in range(50)]
        for g in (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))
    ]
    assert runs[0] == runs[1]
    assert len(set(itertools.chain(runs[0]))) > 1


def test_sample_draws_each_row_from_its_own_weights_and_never_a_zero():
    """`sample` (the inverse of the cumulative distribution, summed in float64) over rows of unnormalised
    weights with zeros among them, first, inside and last: each row's counts follow its own distribution,
    and no zero-weight token is ever drawn, even at the largest uniform draw."""
    generator = torch.Generator().manual_seed(7)
    weights = torch.tensor([[0.0, 2.0, 0.0, 5.0, 3.0, 0.0], [1.0, 1.0, 1.0, 0.0, 4.0, 0.0]])  # [2, 6]
    draws = sample(weights.repeat(DRAWS, 1).view(DRAWS, 2, 6), generator)  # [DRAWS, 2]
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=6).float()
        assert counts[weights[row] == 0].sum() == 0
        assert_follows(counts, weights[row] / weights[row].sum(), f"row {row}", tv=FINE_TV)
    with pytest.MonkeyPatch.context() as patch:  # the largest uniform draw float64 has, and one of 1 (never drawn)
        for top in (1.0 - 2.0**-53, 1.0):
            patch.setattr(torch, "rand", lambda *shape, top=top, **kw: torch.full(shape, top, dtype=torch.float64))
            assert sample(torch.tensor([0.1, 0.7, 0.0]), None).item() == 1
            assert sample(torch.tensor([1.0, 3.0, 0.5, 0.0, 0.0]), None).item() == 2


# --- Seeded sequences: one counter-based uniform per output position (specdecode.sampling) ---------------


def splitmix64_uniform(seed: int, position: int) -> float:
    """The uniform `sampling.position_uniforms` gives a seed's position, written plainly with Python's integers:
    splitmix64's output for the seed as the key, then the key's (position + 1)-th state, its top 53 bits."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
        return z ^ (z >> 31)

    key = mix((seed + 0x9E3779B97F4A7C15) & mask)
    return (mix((key + (position + 1) * 0x9E3779B97F4A7C15) & mask) >> 11) * 2.0**-53


def test_position_uniforms_are_splitmix64_of_the_seed_and_position():
    """int64 tensor arithmetic (products that wrap, shifts made unsigned) gives splitmix64's numbers exactly, for
    seeds small, large and negative, at positions far apart."""
    from specdecode.sampling import position_uniforms, seed_key

    positions = torch.tensor([0, 1, 2, 3, 1000, 2**20, 2**31 + 5])
    for seed in (0, 1, 42, 2**62 - 1, 2**63 + 17, -5):
        assert position_uniforms(seed_key(seed), positions).tolist() == [
            splitmix64_uniform(seed, p) for p in positions.tolist()]


def test_position_uniforms_are_uniform_and_independent():
    """Over positions of one seed and over seeds at one position the uniforms fall evenly into ten bins, and two
    neighbouring positions' fall evenly into the hundred pairs of bins (a neighbour's does not follow from its
    own); with enough draws to catch a total variation of 0.02 (a pair's: 0.05)."""
    from specdecode.sampling import position_uniforms, seed_key

    bins = 10
    runs = runs_for_power(bins, tv=FINE_TV)
    along = position_uniforms(seed_key(3), torch.arange(runs))
    across = torch.stack([position_uniforms(seed_key(seed), torch.tensor(7)) for seed in range(runs)])
    for what, u in (("positions", along), ("seeds", across)):
        assert_follows(torch.bincount((u * bins).long(), minlength=bins).float(), torch.full((bins,), 1 / bins),
                       what, tv=FINE_TV)
    pairs = runs_for_power(bins * bins)
    u = position_uniforms(seed_key(11), torch.arange(pairs + 1))
    cells = (u[:-1] * bins).long() * bins + (u[1:] * bins).long()
    assert_follows(torch.bincount(cells, minlength=bins * bins).float(), torch.full((bins * bins,), 1 / bins**2),
                   "neighbours")


def test_a_seeded_draft_without_distributions_is_matched_against_the_tokens_plain_decoding_samples():
    """A seeded generator at position P: the verdict's tokens are, row after row along the accepted path, the
    tokens `sample` draws with the uniforms of positions P, P + 1, ... (plain decoding's under the seed), for a
    chain and for a tree; a chain whose drafts carry distributions is verified by speculative sampling instead,
    drawing from the generator's stream."""
    from specdecode.sampling import position_uniforms, seeded
    from specdecode.verify.tree import verify

    params = SamplingParams(temperature=1.0)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 2
    probs = logits.softmax(-1)
    matched = 0
    for seed in range(200):
        generator = seeded("cpu", seed)
        generator.position = 40 + seed % 3
        u = position_uniforms(generator.key, torch.arange(generator.position, generator.position + 4))
        plain = sample(probs, None, u).tolist()  # each row's token under its position's uniform
        chain = verify(logits, Draft(tokens=torch.tensor([plain[0], 1, 2])), params, generator)
        accepted = 1 + (plain[1] == 1) * (1 + (plain[2] == 2))
        assert chain.num_accepted == accepted and list(chain.tokens) == plain[: accepted + 1]
        # a tree: the context -> node 0 (its token plain[0]) -> node 1 (token 4), node 2 (token 3) beside it
        tree = Draft(tokens=torch.tensor([plain[0], 4, 3]), parents=torch.tensor([-1, 0, -1]))
        rows = torch.tensor([0, 1, 2, 1])  # each row's depth: the context's, then the nodes'
        tokens = sample(probs, None, position_uniforms(generator.key, generator.position + rows)).tolist()
        verdict = verify(logits, tree, params, generator)
        assert verdict.tokens[0] == plain[0] and verdict.tokens[1] == tokens[1]
        matched += verdict.num_accepted == 2
        stream = seeded("cpu", seed)
        stream.position = 40
        draft = Draft(tokens=torch.tensor([0, 1]), probs=probs[:2])
        assert verify(logits, draft, params, stream).tokens == verify_speculative_sampling(
            probs, draft.tokens, draft.probs, torch.Generator().manual_seed(seed)).tokens
    assert matched > 0  # the tree's second node was reached and accepted now and then
