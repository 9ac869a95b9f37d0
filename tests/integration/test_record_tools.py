"""The tools that read kept records (benchmarks/over_peer.py, benchmarks/within_noise.py, `bench.report`) refuse what
would mislead a reader rather than print a table of it: a file given twice (its pairs counted twice narrowed the
interval and turned a verdict), a method the records do not hold, a baseline with no usable run, a line that is not
a record; and a run's own rate is its own whether or not the reference ran beside it."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

from specdecode.bench.harness import Record, record_lines
from specdecode.bench.report import summarise
from specdecode.errors import UserError

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def records(methods: dict[str, float], tasks: int = 3, repeats: int = 2, failed: tuple[str, ...] = ()) -> list[dict]:
    """Runs of each method at its rate (tokens a second, with a little spread), on `tasks` prompts and `repeats`."""
    out = []
    for repeat in range(repeats):
        for task in range(tasks):
            for method, rate in methods.items():
                seconds = 32 / (rate * (1 + 0.01 * ((task + repeat) % 3)))
                out.append({"method": method, "category": "code", "task_id": f"t{task}", "repeat": repeat,
                            "turn_lengths": [32], "seconds": seconds, "prefill_seconds": 0.1,
                            "error": "boom" if method in failed else None})
    return out


def write(path: Path, rows: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)
    return path


@pytest.fixture
def script(monkeypatch, capsys):
    """Run a benchmark script's main() in-process: (exit code, stdout, stderr), a SystemExit's message in stderr."""
    def run(name: str, *args) -> tuple[int, str, str]:
        spec = importlib.util.spec_from_file_location(f"records_{name}", BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.setattr(sys, "argv", [name, *map(str, args)])
        code: int | str | None = 0
        try:
            module.main()
        except SystemExit as end:
            code = end.code
        out, err = capsys.readouterr()
        return (code, out, err) if not isinstance(code, str) else (1, out, err + code)

    return run


def test_within_noise_refuses_what_would_mislead(tmp_path, script):
    runs = write(tmp_path / "a.jsonl", records({"ar": 10.0, "auto": 15.0, "pld": 14.0}))
    copy = write(tmp_path / "b.jsonl", records({"ar": 10.0, "auto": 15.0, "pld": 14.0}))
    code, out, err = script("within_noise", runs)
    assert code == 0 and "| code | pld |" in out, err
    slim = write(tmp_path / "slim.jsonl", [{key: row[key] for key in row if key != "prefill_seconds"}
                                           for row in reversed(records({"ar": 10.0, "auto": 15.0, "pld": 14.0}))])
    served = write(tmp_path / "served.jsonl", [{"clients": 2, "method": "auto", "tokens": 64}])
    # the same runs in a slimmed copy, in another order (a guard on the files' bytes let those through)
    for args, words in [((runs, runs), "a run is in the records twice"), ((runs, copy), "in the records twice"),
                        ((runs, slim), "in the records twice"),
                        ((served,), "not a file of `specdecode bench` runs (its record 1 has no 'category')"),
                        ((runs, "--method", "nope"), "no usable runs of nope"),
                        ((runs, "--rivals", "pld,nope"), "no usable runs of nope"),
                        ((write(tmp_path / "one.jsonl", records({"auto": 15.0})),), "no rival of auto"),
                        ((write(tmp_path / "empty.jsonl", []),), "methods there: none")]:
        code, _, err = script("within_noise", *args)
        assert code == 2 and words in err, (args, err)


def test_over_peer_refuses_a_baseline_without_a_usable_run(tmp_path, script):
    for rows, words in [(records({"ar": 10.0, "auto": 15.0}, failed=("ar",)), "no usable run of ar"),
                        (records({"ar": 10.0}), "nothing to compare")]:
        code, _, err = script("over_peer", write(tmp_path / "r.jsonl", rows), "--baseline", "ar")
        assert code != 0 and words in err, err
    code, _, err = script("over_peer", tmp_path / "missing.jsonl")
    assert code != 0 and "no such records file" in err, err


def test_a_records_file_cut_short_while_writing_loses_only_its_last_line(tmp_path, capsys):
    rows = records({"ar": 10.0, "auto": 15.0})
    cut = write(tmp_path / "cut.jsonl", rows, tail='{"method": "auto", "categ')
    assert record_lines(cut) == rows and "cut short" in capsys.readouterr().err
    broken = write(tmp_path / "broken.jsonl", rows[:1], tail='{"method"\n' + json.dumps(rows[1]) + "\n")
    with pytest.raises(UserError, match="broken.jsonl:2 is not a JSON record"):
        record_lines(broken)
    gapped = tmp_path / "gapped.jsonl"
    gapped.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    assert record_lines(gapped) == rows[:2]


def test_a_methods_own_rate_stands_when_the_reference_failed():
    """The report showed tokens/s "failed" for every method whose runs went well but the reference's did not."""
    rows = [Record.from_json({**row, "token_ids": [1] * 32}) for row in records({"ar": 10.0, "auto": 15.0},
                                                                                failed=("ar",))]
    by_name = {summary.method: summary for summary in summarise(rows, {"ar": True, "auto": True})}
    auto = by_name["auto"].cells["overall"]
    assert auto.runs == 6 and auto.failures == 0
    assert auto.tokens_per_second[0] == pytest.approx(15.0, rel=0.05)
    assert math.isnan(auto.speedup[0])  # nothing to compare with
    # a reference with no runs at all adds no row of its own
    assert {s.method for s in summarise([r for r in rows if r.method == "auto"], {"auto": True})} == {"auto"}


def test_level_means_equivalence_shown_not_a_gap_missed():
    """An interval that merely holds 1 was read "level": with 4 pairs at the benchmark's usual noise (13.8% a run), a
    method truly 10% slower read level in 77% of runs. Level now needs the whole interval within MARGIN of 1;
    "unresolved" is the rest. The t quantiles and the smallest gap found four times in five are checked against
    scipy and against a simulation."""
    import random

    from scipy import stats

    from specdecode.bench import noise

    for degrees in range(1, 300):
        assert abs(noise.t95(degrees) - stats.t.ppf(0.95, degrees)) < 0.003
        assert abs(noise.t80(degrees) - stats.t.ppf(0.80, degrees)) < 0.001
    near = math.log1p(noise.MARGIN) * 0.9
    assert noise.verdict(0.01, 0.2) == "ahead" and noise.verdict(-0.2, -0.01) == "behind"
    assert noise.verdict(-near, near) == "level" and noise.verdict(-0.2, 0.01) == "unresolved"
    rng = random.Random(7)
    spread = 0.195  # a pair's log ratio: two runs, each 13.8% from its mean
    pairs = [[rng.gauss(0.0, spread) for _ in range(6)] for _ in range(400)]
    gap = statistics.fmean(noise.detectable(p) for p in pairs)
    found = sum(noise.interval([x - gap for x in p])[2] < 0 for p in pairs) / len(pairs)
    assert 0.7 < found < 0.9  # about four times in five
    slower = [noise.verdict(*noise.interval([x + math.log(0.9) for x in p])[1:]) for p in pairs]
    assert slower.count("level") == 0 and slower.count("unresolved") > 200
