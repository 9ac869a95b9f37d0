"""The verification budget: the cost curve's interpolation, the budget that maximises expected tokens per
unit of time (against a brute-force search), the running calibration, and measuring a curve on a tiny
model (its shape only: timings on a shared machine are too noisy to assert ratios).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random

import pytest
import torch

from specdecode.models import costs
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.tree.budget import Calibration, best_budget

MEASURED = dataclasses.replace(CostCurve.linear(0.25), seconds=0.01, prefill=0.002)  # a measurement, made up

CURVE = CostCurve((1, 2, 4, 8), (1.0, 1.1, 1.3, 2.1))


# --- CostCurve -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, cost", [(1, 1.0), (2, 1.1), (4, 1.3), (8, 2.1)])
def test_curve_at_measured_sizes(n, cost):
    assert CURVE(n) == pytest.approx(cost, abs=1e-12)


@pytest.mark.parametrize("n, cost", [(3, 1.3), (5, 2.1), (6, 2.1), (7, 2.1)])
def test_curve_charges_the_next_measured_size_between_sizes(n, cost):
    assert CURVE(n) == pytest.approx(cost, abs=1e-12)


@pytest.mark.parametrize("n, cost", [(9, 2.3), (12, 2.9), (16, 3.7), (100, 20.5)])
def test_curve_extrapolates_the_last_segment(n, cost):
    # the last segment, 4 -> 8, rises by 0.8 over 4 tokens: 0.2 per token beyond 8
    assert CURVE(n) == pytest.approx(cost, abs=1e-9)


def test_curve_is_never_negative():
    falling = CostCurve((1, 2), (1.0, 0.5))  # nonsense measurements must not give negative or zero costs
    assert falling(2) == pytest.approx(0.5)
    assert falling(10) == pytest.approx(0.5)  # beyond the last size: flat at worst
    plunging = CostCurve((1, 2, 4), (1.0, 0.2, 0.1))
    assert all(plunging(n) > 0 for n in range(1, 100))


@pytest.mark.parametrize("slope", [0.0, 0.05, 1.0])
def test_linear_curve(slope):
    curve = CostCurve.linear(slope)
    assert curve.sizes == costs.SIZES
    for n in (1, 2, 3, 8, 64, 200):  # measured sizes, and beyond them
        assert curve(n) == pytest.approx(1 + slope * (n - 1), abs=1e-9)
    for n, padded in ((7, 8), (50, 64)):  # between sizes: charged as the next measured size
        assert curve(n) == pytest.approx(1 + slope * (padded - 1), abs=1e-9)


def test_linear_curve_with_own_sizes():
    curve = CostCurve.linear(0.5, sizes=(1, 4))
    assert curve.relative == (1.0, 2.5)
    assert curve(10) == pytest.approx(5.5)


def test_curve_never_charges_more_than_a_larger_measured_size():
    """llama.cpp's kernels favour batches of 16 here: a forward over 12 tokens is charged what 16 cost,
    and the cost stays non-decreasing in n."""
    curve = CostCurve((1, 8, 12, 16, 32), (1.0, 5.0, 6.1, 5.3, 9.1))
    assert curve(12) == pytest.approx(5.3) and curve(10) == pytest.approx(5.3) and curve(16) == pytest.approx(5.3)
    assert curve(8) == pytest.approx(5.0) and curve(4) == pytest.approx(5.0)  # charged as padded to 8
    assert curve(17) == pytest.approx(9.1)
    values = [curve(n) for n in range(1, 80)]
    assert values == sorted(values)
    # the budget search fills the cheap batch: with 15 likely nodes and one pending token, all 15 pay
    assert best_budget([0.95] * 15, curve, 0.0, pending=1) == 15


@pytest.mark.parametrize(
    "sizes, relative", [((1,), (1.0,)), ((1, 2), (1.0,)), ((2, 4), (1.0, 1.5)), ((), ())]
)
def test_curve_rejects_bad_measurements(sizes, relative):
    with pytest.raises(ValueError):
        CostCurve(sizes, relative)


# --- best_budget -----------------------------------------------------------------------------------


def test_budget_is_zero_for_worthless_nodes():
    zeros = [0.0] * 10
    assert best_budget(zeros, CostCurve.linear(0.1), sunk_cost=0.5) == 0
    assert best_budget(zeros, CostCurve.linear(0.0), sunk_cost=0.5) == 0  # free but useless: still none
    assert best_budget([], CURVE, sunk_cost=0.0) == 0


def test_budget_takes_every_node_when_width_is_free():
    scores = [0.9, 0.5, 0.2, 0.01, 1e-6]
    assert best_budget(scores, CostCurve.linear(0.0), sunk_cost=0.3) == len(scores)
    assert best_budget(scores, CostCurve.linear(0.0), sunk_cost=0.3, cap=3) == 3
    assert best_budget(scores, CostCurve.linear(0.0), sunk_cost=0.3, cap=0) == 0


def test_budget_by_hand():
    # linear(1): verifying N nodes after 1 pending token costs 1 + N, no sunk cost.
    # rates: N=0: 1/1; N=1: 1.9/2 = 0.95 -> one node at 0.9 does not pay when width costs as much as depth
    assert best_budget([0.9, 0.9], CostCurve.linear(1.0), sunk_cost=0.0) == 0
    # with drafting already paid for (sunk 2): N=0: 1/3, N=1: 1.9/4, N=2: 2.8/5, N=3: 3.0/6
    assert best_budget([0.9, 0.9, 0.2], CostCurve.linear(1.0), sunk_cost=2.0) == 2


def brute_force_rates(scores, curve, sunk, pending, cap):
    limit = len(scores) if cap is None else min(cap, len(scores))
    return [(1 + math.fsum(scores[:n])) / (sunk + curve(pending + n)) for n in range(limit + 1)]


def random_curve(rng: random.Random) -> CostCurve:
    sizes = [1] + sorted(rng.sample(range(2, 80), rng.randint(1, 6)))
    relative = [1.0]
    for _ in sizes[1:]:
        relative.append(relative[-1] + rng.choice([0.0, rng.uniform(0, 0.2), rng.uniform(0, 3)]))
    return CostCurve(tuple(sizes), tuple(relative))


def test_budget_matches_brute_force_on_random_inputs():
    rng = random.Random(0)
    chosen = set()
    for _ in range(2000):
        count = rng.randint(0, 40)
        scores = sorted((rng.random() ** rng.choice([1, 3, 8]) for _ in range(count)), reverse=True)
        curve = random_curve(rng)
        sunk = rng.choice([0.0, rng.uniform(0, 4)])
        pending = rng.randint(1, 3)
        cap = rng.choice([None, rng.randint(0, 50)])
        n = best_budget(scores, curve, sunk, pending=pending, cap=cap)
        rates = brute_force_rates(scores, curve, sunk, pending, cap)
        assert 0 <= n < len(rates)
        best = max(rates)
        assert rates[n] >= best * (1 - 1e-12)  # optimal up to rounding
        runner_up = max((r for i, r in enumerate(rates) if i != rates.index(best)), default=0.0)
        if best - runner_up > 1e-9 * best:  # a clear winner: exactly the brute-force argmax
            assert n == rates.index(best)
        chosen.add(n)
    assert len(chosen) > 10  # the random cases were not all trivial


# --- Calibration -----------------------------------------------------------------------------------


def test_calibration_starts_neutral_and_follows_the_evidence():
    calibration = Calibration()
    assert calibration.factor == 1.0
    calibration.record(predicted=2.0, observed=3)
    up = calibration.factor
    assert up > 1.0  # more accepted than predicted: scores were too pessimistic
    calibration.record(predicted=2.0, observed=3)
    assert calibration.factor > up  # more of the same evidence pushes further
    calibration.reset()
    assert calibration.factor == 1.0
    calibration.record(predicted=3.0, observed=1)
    assert calibration.factor < 1.0


def test_calibration_is_clamped():
    optimistic, pessimistic = Calibration(), Calibration()
    for _ in range(100):
        optimistic.record(predicted=10.0, observed=0)
        pessimistic.record(predicted=0.0, observed=10)
    assert optimistic.factor == 0.25
    assert pessimistic.factor == 1.5
    custom = Calibration(low=0.5, high=1.2)
    for _ in range(100):
        custom.record(predicted=0.0, observed=10)
    assert custom.factor == 1.2


def test_calibration_forgets_old_evidence():
    calibration = Calibration()
    for _ in range(5):
        calibration.record(predicted=10.0, observed=0)
    assert calibration.factor == 0.25
    for _ in range(100):
        calibration.record(predicted=2.0, observed=2)  # now the scores are right
    assert calibration.factor == pytest.approx(1.0, abs=0.01)


# --- Measuring a curve ----------------------------------------------------------------------------


def test_measure_on_a_tiny_model(tiny_target, real_measure):
    lm = HFCausalLM(tiny_target)
    curve = real_measure(lm, sizes=(1, 2, 4), context=16, repeats=2)
    assert curve.sizes == (1, 2, 4)
    assert curve.relative[0] == 1.0
    assert all(math.isfinite(r) and r > 0 for r in curve.relative)
    assert math.isfinite(curve.prefill) and curve.prefill > 0  # seconds per token of a prompt's prefill
    assert lm.cache_length == 0  # the model is left empty
    # and it still decodes like a fresh one
    prompt = torch.tensor([5, 6, 7, 8])
    torch.testing.assert_close(lm.forward(prompt).logits, HFCausalLM(tiny_target).forward(prompt).logits)


def test_cached_curve_is_measured_once(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "cache_root", lambda: tmp_path)
    calls = []

    def fake_measure(model, *args, **kwargs):
        calls.append(model)
        return MEASURED

    monkeypatch.setattr(costs, "measure", fake_measure)
    lm = HFCausalLM(tiny_target)
    first = costs.cached(lm, "tiny|key")
    second = costs.cached(lm, "tiny|key")
    assert first == second == MEASURED
    assert len(calls) == 1
    costs.cached(lm, "another|key")  # a different model or backend is measured separately
    assert len(calls) == 2


@pytest.mark.parametrize("progress", [True, False])
def test_the_first_measurement_says_so_only_where_progress_is_on(tiny_folder, tmp_path, monkeypatch, capsys, progress):
    from specdecode.api import load_models

    monkeypatch.setattr(costs, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(costs, "measure", lambda *args, **kwargs: MEASURED)
    models = load_models(str(tiny_folder), None, dtype="float32", progress=progress)
    capsys.readouterr()
    assert costs.cached(models.target, "tiny|first") == MEASURED
    assert ("Measuring what wider forwards cost" in capsys.readouterr().err) is progress


def test_a_curve_cached_before_prefills_were_timed_gets_its_figure(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(costs, "measure", lambda *args, **kwargs: pytest.fail("the curve is cached"))
    monkeypatch.setattr(costs, "measure_prefill", lambda model: 0.002)
    lm = HFCausalLM(tiny_target)
    costs.store("tiny|old", dataclasses.replace(MEASURED, prefill=0.0))
    path = next(tmp_path.glob("*.json"))
    data = json.loads(path.read_text())
    del data["prefill"]  # as written before the field existed
    path.write_text(json.dumps(data))
    assert costs.cached(lm, "tiny|old") == MEASURED
    assert json.loads(path.read_text())["prefill"] == 0.002  # stored back: measured once




def curve_file(sizes=costs.SIZES, first=1.0, seconds=0.01) -> bytes:
    relative = [first, *MEASURED.relative[1:len(sizes)]]
    return json.dumps({"sizes": list(sizes), "relative": relative, "seconds": seconds, "prefill": 0.002}).encode()


@pytest.mark.parametrize("content", [
    b'{"key": "tiny|bad", "sizes": [1, 2, 4], "rel',  # cut short by a full disk
    b'{"sizes": [], "relative": [], "seconds": 0.01, "prefill": 0.002}',
    b'{"sizes": [1, 2, 4], "relative": [1.0, "1.25", 1.75], "seconds": 0.01, "prefill": 0.002}',
    b'{"sizes": [1, 2, 4], "relative": [1.0, NaN, 1.75], "seconds": 0.01, "prefill": 0.002}',
    b'{"sizes": [2, 4], "relative": [1.0, 1.25], "seconds": 0.01}',
    b'{"sizes": [1, 2, 4], "relative": [1.0, 1.25], "seconds": 0.01}',
    b'[1, 2, 4]',
    b'\xff\xfe not text',
    # well-formed, but what no measurement writes and a LiveCurve cannot correct (edited by hand): sizes it would
    # never learn (no forward wider than the last size is timed), a first size priced as more than itself, no
    # measured time (every untimed width then priced at a second)
    curve_file(sizes=costs.SIZES[:2]),
    curve_file(first=50.0),
    curve_file(seconds=0),
], ids=["cut-short", "no-sizes", "a-string", "nan", "not-from-1", "lengths-differ", "a-list", "not-utf8",
        "missing-sizes", "first-not-one", "no-seconds"])
def test_an_unusable_cached_curve_is_moved_aside_with_a_warning_and_measured_again(tiny_target, tmp_path, monkeypatch,
                                                                                     caplog, content):
    monkeypatch.setattr(costs, "cache_root", lambda: tmp_path)
    calls = []
    monkeypatch.setattr(costs, "measure", lambda model, *args, **kwargs: calls.append(model) or MEASURED)
    costs.store("tiny|bad", MEASURED)
    path = next(tmp_path.glob("*.json"))
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="specdecode.cache"):
        assert costs.cached(HFCausalLM(tiny_target), "tiny|bad") == MEASURED
    assert len(calls) == 1
    aside = path.with_name(path.name + ".broken")
    assert aside.read_bytes() == content  # kept for a look
    assert json.loads(path.read_text())["relative"] == list(MEASURED.relative)  # the new measurement, cached
    [record] = caplog.records
    assert str(path) in record.getMessage() and str(aside) in record.getMessage()


def test_a_folder_where_the_cached_curve_belongs_is_moved_aside(tiny_target, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(costs, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(costs, "measure", lambda model, *args, **kwargs: MEASURED)
    costs.store("tiny|folder", MEASURED)
    path = next(tmp_path.glob("*.json"))
    path.unlink()
    path.mkdir()  # (it was a traceback: IsADirectoryError)
    with caplog.at_level(logging.WARNING, logger="specdecode.cache"):
        assert costs.cached(HFCausalLM(tiny_target), "tiny|folder") == MEASURED
    assert path.with_name(path.name + ".broken").is_dir() and path.is_file()
    assert "cannot be read" in caplog.text
