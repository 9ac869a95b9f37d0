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
