"""Statistical checks with stated power: sampled outcomes against an exact distribution computed without
the code under test.

Every statistical test here asserts a chi-square p-value above ALPHA = 1e-4 (so a correct sampler fails
one in 10,000 seeds; the seeds are fixed, so a run is reproducible) and states its power against a
total-variation error of 5%: for any distribution q at total variation d from the expected p, Cauchy-
Schwarz gives sum((q - p)^2 / p) >= (sum |q - p|)^2 = 4 d^2, so the chi-square statistic over N draws has
noncentrality at least 4 N d^2 whatever the shape of the error, and `power` is the chance that a
noncentral chi-square with that noncentrality exceeds the test's critical value (the worst case over
errors of that size; concentrated errors are caught more easily). Cells expected fewer than 5 times are
pooled into one, so an error that only moves mass among such rare cells goes unseen.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdecode.types import SamplingParams

ALPHA = 1e-4  # a correct sampler fails a test once in 10,000 seeds
ERROR_TV = 0.05  # the error every test must catch ...
POWER = 0.9  # ... at least this often
MIN_EXPECTED = 5.0  # cells expected fewer times are pooled into one (the chi-square approximation)


def power(runs: int, cells: int, alpha: float = ALPHA, tv: float = ERROR_TV) -> float:
    """The chance that a chi-square test over `cells` cells at level `alpha` rejects a distribution at
    total variation `tv` from the expected one after `runs` draws (the worst case over such errors)."""
    from scipy.stats import chi2, ncx2

    df = cells - 1
    return float(ncx2.sf(chi2.isf(alpha, df), df, 4 * runs * tv**2))


def runs_for_power(cells: int, alpha: float = ALPHA, tv: float = ERROR_TV, target: float = POWER) -> int:
    """The fewest runs (to the hundred) with `power` at least `target`."""
    runs = 100
    while power(runs, cells, alpha, tv) < target:
        runs += 100
    return runs


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """(p-value, cells compared) of counts [k] against probabilities [k]. Cells of probability 0 must be
    empty (asserted); cells expected fewer than MIN_EXPECTED times are pooled into one."""
    from scipy.stats import chisquare

    counts, expected = counts.flatten().double(), expected.flatten().double()
    impossible = expected <= 0
    assert not bool(counts[impossible].any()), f"outcomes of probability 0 occurred: {counts[impossible].tolist()}"
    counts, expected = counts[~impossible], expected[~impossible] / expected[~impossible].sum() * counts.sum()
    small = expected < MIN_EXPECTED
    if bool(small.any()):
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue), int(counts.numel())


def assert_follows(counts: torch.Tensor, expected: torch.Tensor, what: str = "", tv: float = ERROR_TV) -> int:
    """Assert that counts follow `expected` at level ALPHA, with power at least POWER against a total
    variation error of `tv`; returns the number of cells compared."""
    p_value, cells = chi_square(counts, expected)
    runs = int(counts.sum())
    assert power(runs, cells, tv=tv) >= POWER, f"{runs} runs over {cells} cells: too few for the stated power"
    distance = 0.5 * float((counts.flatten().double() / runs - expected.flatten().double()).abs().sum())
    assert p_value > ALPHA, (f"{what}: chi-square p-value {p_value:.2e} over {cells} cells,"
                             f" total variation {distance:.4f}")
    return cells


# --- The processed distribution, written plainly (independently of specdecode.sampling) ------------------


def penalised(logits: list[float], params: SamplingParams, prompt: tuple[int, ...],
              generated: tuple[int, ...], ends: tuple[int, ...] = ()) -> list[float]:
    """The logits after the bias and penalties, at a position after `prompt` and the `generated` tokens:
    each biased token's bias added; then every token of the prompt or generated so far divided by the
    repetition penalty if its logit is positive, multiplied by it if not; then minus the frequency penalty
    times the times it was generated, minus the presence penalty if it was at all; then, while fewer than
    min_tokens were generated, the tokens that would end the output (`ends`) at -inf. Plain Python floats."""
    out = list(logits)
    for token, bias in params.logit_bias:
        out[token] += bias
    for token, value in enumerate(out):
        count = generated.count(token)
        if token in prompt or count:
            value = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        out[token] = value - params.frequency_penalty * count - (params.presence_penalty if count else 0.0)
    if len(generated) < params.min_tokens:
        for token in ends:
            out[token] = -math.inf
    return out


def processed(logits: list[float], params: SamplingParams) -> list[float]:
    """Temperature, then the top-k tokens (ties at the k-th value kept), then those at least min-p times
    as likely as the likeliest, then the smallest set of the likeliest tokens whose probability reaches
    top-p, renormalised. Plain Python floats."""
    scaled = [x / params.temperature for x in logits]
    kept = set(range(len(scaled)))
    if 0 < params.top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[params.top_k - 1]
        kept = {i for i in kept if scaled[i] >= kth}
    if params.min_p > 0:
        top = max(scaled[i] for i in kept)
        kept = {i for i in kept if math.exp(scaled[i] - top) >= params.min_p}

    def normalised(tokens: set[int]) -> list[float]:
        weights = [math.exp(scaled[i]) if i in tokens else 0.0 for i in range(len(scaled))]
        total = sum(weights)
        return [w / total for w in weights]

    if params.top_p < 1.0:
        probs = normalised(kept)
        nucleus, mass = set(), 0.0
        for i in sorted(kept, key=lambda i: -probs[i]):
            if mass >= params.top_p:
                break
            nucleus.add(i)
            mass += probs[i]
        kept = nucleus
    return normalised(kept)


def continuations(
    logits: Callable[[tuple[int, ...]], torch.Tensor], prompt: list[int], length: int, params: SamplingParams,
    ends: tuple[int, ...] = (),
) -> torch.Tensor:
    """The exact distribution of the first `length` tokens sampled after `prompt` from a model whose
    logits after a sequence are `logits(sequence)`: [vocab] * length, the product of each token's
    processed probability (`penalised`, then `processed`) after the ones before it."""
    vocab = int(logits(tuple(prompt)).numel())
    table = torch.zeros((vocab,) * length, dtype=torch.float64)
    for tokens in itertools.product(range(vocab), repeat=length):
        probability = 1.0
        for i, token in enumerate(tokens):
            raw = penalised(logits(tuple(prompt) + tokens[:i]).tolist(), params, tuple(prompt), tokens[:i], ends)
            probability *= processed(raw, params)[token]
            if probability == 0.0:
                break
        table[tokens] = probability
    return table


def outcome_index(tokens: list[int], vocab: int) -> int:
    """The cell of a tuple of tokens in a flattened [vocab] * len(tokens) table."""
    index = 0
    for token in tokens:
        index = index * vocab + token
    return index


# --- Outcomes of end-to-end runs ----------------------------------------------------------------------


@dataclass
class Outcomes:
    """How often each continuation of `length` tokens came out of `runs` generations, and how often the
    runs exercised the parts of speculative sampling a test means to cover."""

    vocab: int
    length: int
    counts: torch.Tensor = field(init=False)  # [vocab ** length]
    runs: int = 0
    deep_drafts: int = 0  # runs that verified a draft at least two tokens deep
    deep_bonus: int = 0  # runs with a bonus token after two or more accepted draft tokens
    corrections: int = 0  # runs with a correction token (a draft token rejected)

    def __post_init__(self) -> None:
        self.counts = torch.zeros(self.vocab**self.length, dtype=torch.float64)

    def add(self, token_ids: list[int], events: list) -> None:
        """One run's new tokens and StepEvents."""
        assert len(token_ids) == self.length, token_ids
        self.counts[outcome_index(token_ids, self.vocab)] += 1
        self.runs += 1
        depths = [e.stats.drafted if e.stats.draft_depth is None else e.stats.draft_depth for e in events]
        self.deep_drafts += max(depths, default=0) >= 2
        self.deep_bonus += any("bonus" in e.origins and e.stats.accepted >= 2 for e in events)
        self.corrections += any("corrected" in e.origins for e in events)

    def assert_exercised(self, share: float = 0.1) -> None:
        """Deep drafts, bonus tokens after them and corrections each in at least `share` of the runs."""
        seen = {"deep drafts": self.deep_drafts, "bonus after two accepted": self.deep_bonus,
                "corrections": self.corrections}
        assert all(count >= share * self.runs for count in seen.values()), f"of {self.runs} runs: {seen}"


def engine_outcomes(engine, prompt: list[int], length: int, params: SamplingParams, runs: int,
                    max_new_tokens: int | None = None, constraint=None) -> Outcomes:
    """The first `length` tokens of `runs` generations of `max_new_tokens` (default: `length`) tokens
    with a SpeculativeEngine, seeded 0, 1, ... (under `constraint`, a `specdecode.constraints.Constraint`)"""
    from specdecode.engine import GenerationConfig

    outcomes = Outcomes(engine.target.vocab_size, length)
    for seed in range(runs):
        events: list = []
        config = GenerationConfig(max_new_tokens=max_new_tokens or length, sampling=params, seed=seed,
                                  constraint=constraint)
        outcomes.add(engine.generate(prompt, config, on_step=events.append).token_ids[:length], events)
    return outcomes


def model_logits(model) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """A transformers model's logits [vocab] after a sequence, by a plain forward without a cache."""

    @functools.cache
    def logits(sequence: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([sequence], device=model.device)).logits[0, -1].float().cpu()

    return logits


def assert_engine_follows_target(drafter, params: SamplingParams, runs: int, what: str, length: int = 3,
                                 ends: tuple[int, ...] = ()) -> Outcomes:
    """The end-to-end check on the fake models (`fakes`: TARGET after PROMPT, 4 tokens): `runs` generations
    with `drafter`, seeded 0, 1, ...; deep drafts, bonus tokens after two accepted ones and corrections
    must all occur (`Outcomes.assert_exercised`), and the first `length` tokens follow the target's exact
    distribution (`assert_follows`). `ends`: the target's end-of-sequence tokens (none by default)."""
    from fakes import PROMPT, TARGET, FakeLM
    from specdecode.engine import SpeculativeEngine

    target = FakeLM(TARGET)
    target.eos_token_ids = frozenset(ends)
    outcomes = engine_outcomes(SpeculativeEngine(target, drafter=drafter), PROMPT, length, params, runs)
    outcomes.assert_exercised()
    assert_follows(outcomes.counts, continuations(TARGET, PROMPT, length, params, ends), what)
    return outcomes
