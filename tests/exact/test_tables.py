"""The tables a person reads in a terminal fit 80 columns: `specdecode methods`, the table of `generate` and
the demo (`demo.stats_table`), the benchmark's summary (`bench.terminal`). Rendered at width 80, no line is
wider, no header or cell is cut short ("…"), every name is whole, and the legend names each short column.
`--json` keeps every field."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from specdecode.bench import terminal
from specdecode.bench.datasets import DEFAULT_CATEGORIES, LONG_CONTEXT, LONG_LENGTHS
from specdecode.bench.report import OVERALL, Cell, MethodSummary
from specdecode.cli import app
from specdecode.cli.generate import methods_table
from specdecode.demo import DEMO_METHODS, stats_table
from specdecode.methods import METHODS, variant_names

WIDTH = 80
LONGEST = max(variant_names(), key=len)


def _render(table) -> list[str]:
    console = Console(width=WIDTH, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text().splitlines()


def _words(lines: list[str]) -> str:
    return " ".join(" ".join(lines).split())


def _check(lines: list[str], headers: list[str], names: list[str]) -> None:
    assert max(map(len, lines)) <= WIDTH, "\n".join(lines)
    assert not any("…" in line for line in lines), "\n".join(lines)
    assert lines[0].split() == headers, lines[0]
    starts = [line.split()[0] for line in lines[2:] if line[:1].strip()]  # rows begin at column 0
    assert all(name in starts for name in names), (names, starts)


def test_methods_fit_80_columns_and_wrap_only_the_description():
    lines = _render(methods_table())
    _check(lines, ["method", "draft", "tree", "lossless", "batch", "description"], list(METHODS))
    legend_start = next(i for i, line in enumerate(lines) if line.startswith("draft: needs"))
    description = lines[0].index("description")
    for line in lines[2:legend_start]:  # a row's first line, or its description going on alone
        if line[:1].strip():
            assert line.split()[0] in METHODS, line
        else:
            assert not line[:description].strip(), line
    assert all(f"{name}:" in _words(lines[legend_start:]) for name in ("draft", "tree", "lossless", "batch"))


def test_methods_json_has_every_field():
    result = CliRunner().invoke(app, ["methods", "--json"])
    assert result.exit_code == 0, result.output
    entries = json.loads(result.output)
    assert [e["name"] for e in entries] == list(METHODS)
    assert all(set(e) == {f.name for f in dataclasses.fields(METHODS["ar"])} for e in entries)


def _run(method: str, tokens_per_second: float) -> dict:
    return {"method": method, "new_tokens": 1024, "seconds": 1024 / tokens_per_second,
            "tokens_per_second": tokens_per_second, "target_forwards": 1024, "mean_accepted_tokens": 12.34,
            "acceptance_rate": 0.5}


def test_the_demo_table_fits_80_columns():
    rows = [_run(name, 123.45) for name in DEMO_METHODS]
    lines = _render(stats_table(rows, baseline_tps=1.5))
    _check(lines, ["method", "tokens", "s", "tok/s", "fwd", "len", "acc", "x", "ar"], DEMO_METHODS)
    assert "x ar: speedup" in _words(lines)


def test_the_generate_table_fits_80_columns_with_the_longest_name():
    lines = _render(stats_table([_run(LONGEST, 9.5)]))
    _check(lines, ["method", "tokens", "s", "tok/s", "fwd", "len", "acc"], [LONGEST])


def _summaries(categories: list[str]) -> list[MethodSummary]:
    cell = Cell(tokens_per_second=(123.4, 1.0), speedup=(12.345, 0.1), mean_accepted_tokens=3.21, runs=99,
                failures=10)
    failed = dataclasses.replace(cell, speedup=(float("nan"), 0.0), tokens_per_second=(float("nan"), 0.0))
    names = ["ar", LONGEST, "draft-tree"]
    return [MethodSummary(name, {c: failed if name == "draft-tree" else cell for c in [*categories, OVERALL]},
                          (120, 120), acceptance_rate=1.0, draft_share=0.5, predicted_speedup=12.3)
            for name in names]


@pytest.mark.parametrize("categories", [
    DEFAULT_CATEGORIES,
    DEFAULT_CATEGORIES + [f"{LONG_CONTEXT}/{length}" for length in LONG_LENGTHS],
], ids=["default", "with long-context"])
def test_the_bench_summary_fits_80_columns(categories):
    summaries = _summaries(categories)
    names = [s.method for s in summaries]
    shown = []
    for table in terminal.leaderboard(summaries, "ar", WIDTH):
        lines = _render(table)
        headers = lines[0].split()
        _check(lines, headers, names)
        shown += headers[1:]
    assert shown == [terminal.short_category(c) for c in [*categories, OVERALL]]
    lines = _render(terminal.per_method(summaries, "ar"))
    _check(lines, ["method", "tok/s", "x", "ar", "pred", "acc", "len", "draft", "runs", "fail", "exact"], names)
