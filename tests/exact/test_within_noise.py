"""benchmarks/within_noise.py: the verdict against the strongest rival, from records whose rates are known."""

from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import benchmark_script


def script():
    return benchmark_script("within_noise")


def write(path: Path, seconds: dict[tuple[str, str, str, int], float]) -> Path:
    """Records of 10 tokens each: (method, category, task, repeat) -> seconds."""
    lines = [json.dumps({"method": m, "category": c, "task_id": t, "repeat": r, "turn_lengths": [10],
                         "seconds": s, "error": None}) for (m, c, t, r), s in seconds.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_verdicts_against_the_strongest_rival(tmp_path):
    noise = [1.0, 1.02, 0.98, 1.01]  # the same small wobble in every pair
    seconds = {}
    for i, wobble in enumerate(noise):
        task, repeat = f"t{i // 2}", i % 2
        seconds |= {("ar", category, task, repeat): 2.0 for category in ("code", "rag", "qa")}
        seconds |= {("auto", "code", task, repeat): 1.0 * wobble, ("pld", "code", task, repeat): 1.5,
                    ("suffix", "code", task, repeat): 1.2}  # auto 1.2x the best rival
        seconds |= {("auto", "rag", task, repeat): 1.0 * wobble, ("pld", "rag", task, repeat): 0.8}  # 0.8x
        seconds |= {("auto", "qa", task, repeat): 1.0 * wobble * noise[-1 - i], ("pld", "qa", task, repeat): 1.0}
    module = script()
    lines = module.table(module.load([write(tmp_path / "r.jsonl", seconds)]), "auto", None)
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:]
                                          if line.startswith("| "))}
    assert rows["code"][1] == "suffix" and rows["code"][5] == "ahead"  # suffix, not pld: the strongest rival
    assert rows["code"][7] == "suffix 1.20, pld 1.50"  # and ar is no rival
    assert rows["code"][6].endswith("%")  # the smallest gap the run would find
    assert rows["rag"][1:3] == ["pld", "0.798"] and rows["rag"][5] == "behind"
    assert rows["qa"][5] == "level"  # a wobble of about 2% around 1: its interval within MARGIN


def test_interval_is_students_t():
    mean, low, high = script().interval([0.0, 0.1])
    assert math.isclose(mean, 0.05)
    assert math.isclose(high - mean, 6.314 * math.sqrt(0.005) / math.sqrt(2))  # t(1) 95th percentile
    assert script().interval([0.3])[1:] == (-math.inf, math.inf)  # one pair tells nothing of noise


def test_t_tail_is_students_t():
    """The closed forms for whole degrees equal scipy's Student's t on both sides of 0, odd and even degrees."""
    from scipy import stats

    from specdecode.bench.noise import t_tail

    for degrees in (1, 2, 3, 4, 7, 10, 29, 60):
        for t in (-6.0, -1.3, -0.2, 0.0, 0.4, 1.833, 3.5, 20.0):
            assert math.isclose(t_tail(t, degrees), stats.t.sf(t, degrees), rel_tol=1e-12, abs_tol=1e-15)


def test_holm_steps_down_and_stays_monotone():
    from specdecode.bench.noise import holm, p_behind

    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1; the last held up to the one before it
    assert holm([0.01, 0.04, 0.03, 0.005]) == [0.03, 0.06, 0.06, 0.02]
    assert holm([0.5, 0.9]) == [1.0, 1.0] and holm([]) == []
    assert p_behind([0.1]) == 1.0 and p_behind([-0.1, -0.1]) == 0.0 and p_behind([0.1, 0.1]) == 1.0
    assert math.isclose(p_behind([-0.1, -0.05, -0.12, 0.01]), 0.0554555048, rel_tol=1e-8)  # scipy's ttest_1samp


def test_holm_pays_for_picking_the_slowest_looking_rival(tmp_path):
    """Twelve rivals as fast as `auto` (each pair's log ratio noise): the slowest-looking one may read *behind*
    unadjusted, but after Holm's step-down over the twelve its p stays far from 0.05; a rival that really is
    faster stands."""
    import random

    rng = random.Random(7)
    seconds = {}
    for task in range(6):
        seconds[("auto", "code", f"t{task}", 0)] = 1.0
        seconds |= {(f"r{k}", "code", f"t{task}", 0): math.exp(rng.gauss(0, 0.1)) for k in range(12)}
        seconds[("auto", "rag", f"t{task}", 0)] = 1.0
        seconds[("fast", "rag", f"t{task}", 0)] = 0.5 * math.exp(rng.gauss(0, 0.02))
    module = script()
    lines = module.table(module.load([write(tmp_path / "r.jsonl", seconds)]), "auto", None)
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:]
                                          if line.startswith("| "))}
    assert float(rows["code"][8]) > 0.2 and float(rows["rag"][8]) < 0.001
    assert rows["rag"][5] == "behind" and "13 (every rival in every category)" in lines[-2]
    assert "1 of them *behind* at that level" in lines[-2]


def test_detectable_gap_and_the_chance_of_a_false_behind_by_hand():
    import statistics

    from specdecode.bench import noise

    pair = [0.0, 0.1]  # one degree of freedom: t95 6.314, t80 1.376
    assert math.isclose(noise.detectable(pair), (6.314 + 1.376) * statistics.stdev(pair) / math.sqrt(2))
    assert math.isclose(noise.chance_of_a_false_behind(1), 0.05)  # one comparison: its own 5%
    assert math.isclose(noise.chance_of_a_false_behind(3), 1 - 0.95 ** 3)  # independent one-sided 5% tests
