"""benchmarks/serve_concurrency.py: each method's throughput over `ar`, repeat by repeat, read from kept records."""

from __future__ import annotations

import math

from conftest import benchmark_script


def script():
    return benchmark_script("serve_concurrency")


def records(walls: dict[tuple[int, str, int], float], tokens: int = 10) -> list[dict]:
    """Runs of two requests of `tokens` tokens each: (clients, method, repeat) -> the run's wall seconds."""
    out = []
    for (clients, method, repeat), wall in walls.items():
        out.append({"kind": "run", "repeat": repeat, "clients": clients, "method": method, "wall": wall})
        out += [{"kind": "request", "repeat": repeat, "clients": clients, "method": method, "prompt": p,
                 "token_ids": [1] * tokens} for p in range(2)]
    return out


def rows(lines: list[str]) -> dict[tuple[str, str], list[str]]:
    cells = ([c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ") and
             not line.startswith("| clients"))
    return {(c[0], c[1]): c for c in cells}


def test_ratios_pair_each_repeat_with_ars_own():
    # auto: twice ar's rate at 1 client in every repeat, though the repeats' own rates differ by 3x; at 8, within
    # a wobble of ar's
    walls = {(1, "ar", 0): 2.0, (1, "auto", 0): 1.0, (1, "ar", 1): 6.0, (1, "auto", 1): 3.0,
             (1, "ar", 2): 4.0, (1, "auto", 2): 2.0,
             (8, "ar", 0): 1.0, (8, "auto", 0): 1.02, (8, "ar", 1): 1.0, (8, "auto", 1): 0.97,
             (8, "ar", 2): 1.0, (8, "auto", 2): 1.0}
    found = rows(script().noise_lines(records(walls), [1, 8], ["auto", "ar"]))
    assert found[("1", "`auto`")][2:6] == ["2.00, 2.00, 2.00", "2.000", "2.000-2.000", "ahead"]
    eight = found[("8", "`auto`")]
    assert eight[5] == "level" and math.isclose(float(eight[3]), (1 / 1.02 / 0.97) ** (1 / 3), rel_tol=1e-3)
    assert ("1", "`ar`") not in found  # ar over itself is no row


def test_one_repeat_gives_no_interval():
    found = rows(script().noise_lines(records({(2, "ar", 0): 2.0, (2, "auto", 0): 1.6}), [2], ["auto", "ar"]))
    assert found[("2", "`auto`")][2:] == ["1.25", "1.250", "-", "-"]


def test_a_variants_rows_are_compared_with_ar_on_its_own_server():
    """`--variant NAME=...`: `auto [NAME]` over `ar [NAME]`, not over the other server's `ar`."""
    assert script().baseline("auto [0.25 s]") == "ar [0.25 s]" and script().baseline("pld") == "ar"
    walls = {(8, "ar [1 s]", 0): 1.0, (8, "auto [1 s]", 0): 0.5, (8, "ar [q]", 0): 3.0, (8, "auto [q]", 0): 2.0}
    found = rows(script().noise_lines(records(walls), [8], ["auto [1 s]", "ar [1 s]", "auto [q]", "ar [q]"]))
    assert found[("8", "`auto [1 s]`")][2] == "2.00" and found[("8", "`auto [q]`")][2] == "1.50"
    assert ("8", "`ar [q]`") not in found


def test_each_method_runs_in_each_place_as_often():
    """The rows of the Latin square turn with each (repeat, level) cell, so over whole cycles of rows (n cells for n
    methods, 2n for an odd n) each method runs in each place as often: before, the row index moved by a run, and
    with a cell's runs counted in whole rows it never turned (`ar` second in every run of three methods)."""
    from collections import Counter

    for labels, repeats, levels in ((["auto", "ar", "pld"], 2, [1, 2, 8]), (["auto", "ar"], 2, [1, 2, 4, 8])):
        order = script().run_order(labels, repeats, levels)
        assert [(repeat, level) for repeat, level, _ in order] == [(r, c) for r in range(repeats) for c in levels]
        places = Counter((label, place) for _, _, row in order for place, label in enumerate(row))
        assert len(set(places.values())) == 1 and len(places) == len(labels) ** 2, places


def test_chunk_gaps_count_each_wait_once():
    """A step that brings three tokens 90 ms after the last: one 90 ms wait, where `gaps` counts 30 ms three times."""
    request = {"chunks": [[0.0, [1]], [0.09, [2, 3, 4]], [0.12, [5]]]}
    assert script().chunk_gaps(request) == [0.09, 0.12 - 0.09]
    assert script().gaps(request) == [0.03, 0.03, 0.03, 0.12 - 0.09]
