"""scripts/gpu-check on the CPU with tiny shapes (`--device cpu --small`), so the GPU check never rots: every
part runs, the report has its structure, and speculative greedy output equals plain greedy output (the
check's exactness part). No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = ["versions", "exactness", "syncs", "pytest", "cost", "drafting", "replay", "decode", "overhead", "jitter",
         "throughput"]
METHODS = ["ar", "pld", "draft", "eagle3"]
SYNC_METHODS = [*METHODS, "draft-tree", "eagle3-tree", "medusa-tree", "auto"]


def test_gpu_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu-check"), "--device", "cpu", "--small", "--no-pytest",
         "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = json.loads((out / "gpu-check.json").read_text())
    parts = report["parts"]
    assert list(parts) == PARTS
    assert {name: part["error"] for name, part in parts.items() if part["status"] == "error"} == {}
    assert parts["pytest"] == {"correctness": True, "status": "skipped", "reason": "--no-pytest",
                               "seconds": parts["pytest"]["seconds"]}

    exactness = parts["exactness"]
    assert exactness["status"] == "passed", json.dumps(exactness["result"]["rows"], indent=1)
    rows = exactness["result"]["rows"]
    assert [(r["dtype"], r["method"]) for r in rows] == [(d, m) for d in ("float32", "bfloat16") for m in METHODS]
    assert all(r["equal"] == r["outputs"] for r in rows if r["dtype"] == "float32")
    assert all(r["drafted"] > 0 for r in rows if r["method"] != "ar")  # it did speculate
    assert any(r["accepted"] > 0 for r in rows)

    syncs = parts["syncs"]["result"]["rows"]
    assert [(r["decoding"], r["path"], r["method"]) for r in syncs] == [
        (d, p, m) for d in ("greedy", "sampled") for p in ("dynamic", "static") for m in SYNC_METHODS]
    assert all(r["steps"] > 0 and r["per_step"] == r["counted"] / r["steps"] for r in syncs), syncs

    plan = report["plan"]
    cost = parts["cost"]["result"]["rows"]
    assert len(cost) == 2 * len(plan["targets"]) * len(plan["contexts"]) * len(plan["widths"])
    assert {r["path"] for r in cost} == {"dynamic", "static"}
    assert all(r["relative"] == 1.0 for r in cost if r["n"] == 1) and all(r["seconds"] > 0 for r in cost)

    check_static_parts(parts, plan)

    overhead = parts["overhead"]["result"]["rows"]
    assert [(r["k"], r["outcome"]) for r in overhead] == [
        (0, "plain"), (4, "accepted"), (4, "rejected"), (8, "accepted"), (8, "rejected")] * len(plan["targets"])
    assert all(r["steps_timed"] > 0 for r in overhead)

    jitter = parts["jitter"]["result"]
    assert jitter["samples"] and all(s["step_ms"] > 0 and s["forward_ms"] > 0 for s in jitter["samples"])
    assert jitter["profile_steps"]["self_cpu_ms"] > 0 and "aten::" in jitter["profile_steps"]["table"]
    assert [r["attention"] for r in jitter["new_lengths"]] == ["ours", "torch default"] * 2
    assert len({r["prompt"] for r in jitter["new_lengths"]}) == 4  # each run from a length met nowhere before

    throughput = parts["throughput"]["result"]["rows"]
    assert {(r["shape"], r["method"]) for r in throughput} == {(s, m) for s in plan["targets"] for m in METHODS}
    assert all(r["new_tokens"] == plan["new_tokens"] and r["tokens_per_s"] > 0 for r in throughput)

    assert report["passed"] and done.returncode == 0, done.stderr[-3000:]
    summary = done.stdout.strip().splitlines()
    assert summary[0].endswith("PASSED") and summary[-1].startswith("report: ")
    assert "\n".join(summary[:-1]) in (out / "gpu-check.md").read_text()  # the Markdown's summary, printed last


def check_static_parts(parts: dict, plan: dict) -> None:
    """Issue 52's parts: plain decoding by the three paths, drafting's cost, the replayed acceptance."""
    decode = parts["decode"]["result"]["rows"]
    assert [(r["shape"], r["path"]) for r in decode] == [(s, p) for s in plan["targets"]
                                                         for p in ("eager", "graphed", "hf-static")]
    assert all(r["ms_per_token"] > 0 and r["tokens"] == plan["new_tokens"] - 1 for r in decode)
    assert all(r["capture_seconds"] > 0 for r in decode if r["path"] == "graphed")
    assert all(r["compiled"] is False for r in decode if r["path"] == "hf-static")  # transformers compiles on CUDA

    drafting = parts["drafting"]["result"]
    assert [r["drafter"].split(",")[0] for r in drafting["rows"]] == [
        "draft model", "eagle3", "eagle3-tree", "medusa", "medusa-tree"]
    assert all("error" not in r for r in drafting["rows"]), drafting["rows"]
    assert all(r["of_a_forward"] > 0 for r in drafting["rows"] if not r["drafter"].startswith("medusa-tree"))
    assert drafting["draft_forward_relative"] > 0

    replay = parts["replay"]["result"]
    assert replay["label"] == "replayed acceptance" and replay["failed"] == []
    assert {r["method"] for r in replay["rows"]} >= {"draft-tree", "eagle3-tree"}
    for row in replay["rows"]:  # the replay accepts what was recorded; every figure is there
        assert row["runs_exact"] == row["runs"] == 1, row
        assert row["replayed_tokens_per_step"] == pytest.approx(row["recorded_tokens_per_step"], rel=0.05), row
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0 and row["predicted_speedup"] > 0


def test_gpu_check_runs_the_parts_asked_for_and_names_an_unknown_one(tmp_path):
    check = [sys.executable, str(REPO / "scripts" / "gpu-check"), "--device", "cpu", "--small", "--out", str(tmp_path)]
    # two of the quickest parts (the whole check runs above)
    done = subprocess.run([*check, "--parts", "versions,overhead"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(json.loads((tmp_path / "gpu-check.json").read_text())["parts"]) == ["versions", "overhead"]
    done = subprocess.run([*check, "--parts", "versions,speed"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "no part named speed" in done.stderr and "Traceback" not in done.stderr
