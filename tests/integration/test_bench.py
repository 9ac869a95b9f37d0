"""The benchmark: metric definitions by hand, data loaders, and the harness on tiny models."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from specdecode import metrics
from specdecode.api import load_models
from specdecode.bench import report
from specdecode.bench.datasets import CATEGORIES, LONG_CONTEXT, TUNING_SHARE, Task
from specdecode.bench.samples import part_of, sample_tasks
from specdecode.bench.harness import Record, method_order, run_benchmark
from specdecode.bench.runners import Output, Runner, build_runners
from specdecode.engine import GenerationConfig
from specdecode.errors import UserError
from specdecode.types import StepStats


def step(drafted, accepted, new_tokens, draft_seconds=0.0, verify_seconds=1.0, forward_tokens=None):
    return StepStats(drafted, accepted, new_tokens, draft_seconds, verify_seconds,
                     drafted + 1 if forward_tokens is None else forward_tokens)


# --- metrics, by hand --------------------------------------------------------------------------------

def test_metric_definitions_by_hand():
    steps = [step(4, 4, 5), step(4, 1, 2), step(2, 0, 1), step(0, 0, 1)]
    assert metrics.mean_accepted_tokens(steps) == 9 / 4  # bonus/correction tokens included
    assert metrics.acceptance_rate(steps) == 5 / 10
    # position 0 drafted in 3 steps, accepted in 2; position 2 drafted in 2 steps, accepted in 1
    assert metrics.accepted_per_position(steps) == [2 / 3, 1 / 3, 1 / 2, 1 / 2]
    assert metrics.acceptance_rate([step(0, 0, 1)]) is None
    assert metrics.mean_and_std([2.0, 4.0]) == (3.0, pytest.approx(2**0.5))
    assert metrics.mean_and_std([5.0]) == (5.0, 0.0)


def test_chain_acceptance_inverts_the_standard_model():
    # a = 0.5, k = 2: expected accepted drafts = 0.5 + 0.25 = 0.75
    assert metrics.chain_acceptance(0.75, 2) == pytest.approx(0.5, abs=1e-9)
    assert metrics.chain_acceptance(0.0, 3) == 0.0 and metrics.chain_acceptance(3.0, 3) == 1.0


def test_predicted_speedup_by_hand():
    # a = 0.5, k = 2 -> 1.75 tokens per step; step = 2 * 0.1 + 1.0 s; plain 1.0 s per token
    assert metrics.predicted_speedup(0.5, 2, 0.1, 1.0, 1.0) == pytest.approx(1.75 / 1.2)


# --- data loaders --------------------------------------------------------------------------------------

def test_loaders_read_the_shipped_data():
    counts = {name: len(load()) for name, load in CATEGORIES.items()}
    assert counts["multi-turn"] == 80 and counts["math"] == 1319 and counts["qa"] == 817
    assert counts["code"] == 164 + 500 and counts["rag"] == 3270
    assert counts["summarisation"] > 100 and counts["translation"] > 100
    mt = CATEGORIES["multi-turn"]()
    assert all(len(t.turns) == 2 and all(t.turns) for t in mt)
    for name, load in CATEGORIES.items():
        tasks = load()
        assert all(t.category.partition("/")[0] == name and t.turns and all(isinstance(x, str) and x for x in t.turns)
                   for t in tasks)
        assert len({t.task_id for t in tasks}) == len(tasks), name


def test_sample_is_seeded_and_per_category():
    first = sample_tasks(["qa", "math"], 3, seed=1)
    assert first == sample_tasks(["qa", "math"], 3, seed=1)
    assert first != sample_tasks(["qa", "math"], 3, seed=2)
    assert [t.category for t in first] == ["qa"] * 3 + ["math"] * 3


def test_tuning_and_reporting_draw_from_disjoint_parts_of_each_category():
    """Every category (every length of long-context) is split once, by its tasks' ids, into a tuning part and a
    held-out part, about one in TUNING_SHARE for tuning; a sample of either part never holds a task of the other,
    whatever the seed or size; the default sample is held out."""
    for category in CATEGORIES:
        everything = sample_tasks([category], None, part="all")
        tuning = {t.task_id for t in sample_tasks([category], None, part="tuning")}
        held_out = {t.task_id for t in sample_tasks([category], None, part="held-out")}
        assert tuning and held_out and not tuning & held_out, category
        assert tuning | held_out == {t.task_id for t in everything}
        groups = {t.split_group for t in everything}
        tuning_groups = {t.split_group for t in everything if t.task_id in tuning}
        assert len(tuning_groups) <= -(-len(groups) // TUNING_SHARE) + 3  # (rounded up per long-context length)
        assert {part_of(t) for t in everything if t.task_id in tuning} == {"tuning"}
    for seed in range(3):
        sample = sample_tasks(["qa", "code-edit"], 4, seed=seed)
        assert sample == sample_tasks(["qa", "code-edit"], 4, seed=seed, part="held-out")
        assert all(part_of(t) == "held-out" for t in sample)
        assert all(part_of(t) == "tuning" for t in sample_tasks(["qa", "code-edit"], 4, seed=seed, part="tuning"))
    # an agentic scenario's tasks each hold the one before it (and its answer): a scenario falls in one part
    parts: dict[str, set[str]] = {}
    for task in CATEGORIES["agentic"]():
        parts.setdefault(task.task_id.partition("/")[0], set()).add(part_of(task))
    assert all(len(found) == 1 for found in parts.values()) and {"tuning", "held-out"} == set().union(*parts.values())


def test_no_material_is_in_both_parts():
    """The parts were split by ids, category by category: code-edit's prompt (a reference solution) was tuning where
    the code task of its problem was held out, a passage asked about twice and an article the corpus holds twice sat
    in both parts, long context was made of both parts' passages and articles, and a translation id was a count over
    the machine's catalogues (another machine's split moved a third of the sentences). Now no text is in both."""
    from specdecode.bench.catalogues import digest

    code = {t.task_id: part_of(t) for t in CATEGORIES["code"]()}
    assert all(part_of(t) == code[t.task_id] for t in CATEGORIES["code-edit"]())
    for category, field in (("rag", "Passage: "), ("summarisation", "three sentences.\n\n")):
        texts: dict[str, set[str]] = {}
        for task in CATEGORIES[category]():
            body = task.turns[0].partition(field)[2].partition("\n\nQuestion:")[0]
            texts.setdefault(body, set()).add(part_of(task))
        assert all(len(parts) == 1 for parts in texts.values()), category
    own = {part: {t.split_group for c in ("rag", "summarisation") for t in CATEGORIES[c]() if part_of(t) == part}
           for part in ("tuning", "held-out")}
    for task in CATEGORIES[LONG_CONTEXT]():
        kind = task.task_id.split("/")[2]
        if kind in ("documents", "digest"):
            heading = "Document" if kind == "documents" else "Article"
            pieces = [piece.partition(": ")[2] for piece in task.turns[0].split("\n\n") if piece.startswith(heading)]
            groups = {f"{'passage' if kind == 'documents' else 'article'}/{digest(p)}" for p in pieces}
            assert groups and groups <= own[part_of(task)], task.task_id
    assert all(t.task_id == f"de/{digest(t.turns[0].rpartition(chr(10))[2])}" for t in CATEGORIES["translation"]())


@pytest.mark.parametrize("n", range(1, 9))
def test_method_order_is_a_balanced_latin_square(n):
    """Over one cycle of rows each method runs exactly as often in every place, and right after every other
    method exactly as often: a method is never always behind the same one."""
    names = [f"m{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    rows = [method_order(names, index) for index in range(cycle)]
    assert all(sorted(row) == names for row in rows)
    assert set(Counter((name, place) for row in rows for place, name in enumerate(row)).values()) == {cycle // n}
    after = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
    if n > 1:
        assert len(after) == n * (n - 1) and set(after.values()) == {cycle // n}
    assert method_order(names, cycle + 1) == rows[1]


# --- the harness on tiny models --------------------------------------------------------------------------

def test_the_warm_up_is_short_when_every_task_is_long(tiny_folder):
    """A benchmark of long-context tasks alone warms each method up on a cut of the shortest prompt, not on a
    16k-token prefill per method (and the warm-up is not recorded)."""
    from specdecode.bench.harness import WARM_UP_CHARACTERS

    models = load_models(str(tiny_folder), None, dtype="float32", progress=False)
    fed = []

    def run(prompt_ids, config):
        fed.append(len(prompt_ids))
        return Output([1, 2], 1.0, None)

    long = "the cat " * (4 * WARM_UP_CHARACTERS)
    tasks = [Task("long", "long/1", (long,)), Task("long", "long/2", (long + "and ",))]
    runner = Runner("ar", True, False, run, max_context=10**6)  # the tiny model's positions do not matter here
    started = []  # what a progress bar is told as each run begins
    records = run_benchmark(models, {"ar": runner}, tasks, GenerationConfig(max_new_tokens=2), 1,
                            on_start=lambda method, task_id: started.append((method, task_id, len(fed))))
    assert [r.task_id for r in records] == ["long/1", "long/2"]
    assert started == [("ar", "warm-up", 0), ("ar", "long/1", 1), ("ar", "long/2", 2)]  # before each run, not after
    warm_up, *measured = fed
    assert warm_up < min(measured) / 4 and warm_up < WARM_UP_CHARACTERS


@pytest.mark.parametrize("memory, forgets", [("repeat", ["forget", "a/1", "b/1", "forget", "a/1", "b/1"]),
                                             ("prompt", ["forget", "forget", "a/1", "forget", "b/1",
                                                         "forget", "forget", "a/1", "forget", "b/1"])])
def test_memory_says_when_a_runner_forgets(tiny_folder, memory, forgets):
    """`memory="repeat"`: a runner forgets what earlier prompts taught it as each repeat starts; "prompt": before
    every prompt too (as the server does for requests without a memory owner). An unknown setting is refused."""
    models = load_models(str(tiny_folder), None, dtype="float32", progress=False)
    tasks = [Task("a", "a/1", ("the cat",)), Task("b", "b/1", ("the cat sat on the mat",))]
    task_of = {len(models.encode_chat([{"role": "user", "content": t.turns[0]}])): t.task_id for t in tasks}
    assert len(task_of) == 2
    seen: list[str] = []
    runner = Runner("ar", True, False, lambda ids, config: (seen.append(task_of.get(len(ids), "?"))
                                                            or Output([1], 1.0, None)),
                    forget=lambda: seen.append("forget"))
    run_benchmark(models, {"ar": runner}, tasks, GenerationConfig(max_new_tokens=1), repeats=2, memory=memory)
    assert seen[1:] == forgets  # (the first: the warm-up run)
    with pytest.raises(UserError, match="--memory"):
        run_benchmark(models, {"ar": runner}, tasks, GenerationConfig(max_new_tokens=1), repeats=1, memory="task")


def test_harness_records_failures_and_keeps_them_out(tiny_folder, tmp_path):
    models = load_models(str(tiny_folder), str(tiny_folder), dtype="float32", progress=False)
    runners = build_runners(models, ["draft", "pld", "hf-plain"])

    calls = {"n": 0}

    def flaky(prompt_ids, config):
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            raise RuntimeError("boom")
        return Output(list(prompt_ids[:3]), 1e9, None)  # absurdly slow: would wreck any average

    runners["broken"] = Runner("broken", True, True, flaky)
    # a peer that runs through our engine (llamacpp-ar) reports steps: kept out, not a failure
    runners["peer-with-steps"] = replace(runners["pld"], name="peer-with-steps", peer=True)
    tasks = [Task("a", "a/1", ("the cat",)), Task("a", "a/2", ("the the", "and again")), Task("b", "b/1", ("hello",))]
    records = run_benchmark(models, runners, tasks, GenerationConfig(max_new_tokens=6), repeats=2)
    assert len(records) == 2 * 3 * 6
    summaries = {s.method: s for s in report.summarise(records, {n: r.lossless for n, r in runners.items()})}

    # lossless, float32: identical to ar, both turns included
    for name in ["draft", "pld", "hf-plain", "peer-with-steps"]:
        assert summaries[name].exact == (6, 6)
        assert summaries[name].cells[report.OVERALL].failures == 0
    two_turns = [r for r in records if r.task_id == "a/2" and r.method == "ar"]
    assert all(len(r.turn_lengths) == 2 and len(r.prompt_ids[1]) > len(r.prompt_ids[0]) for r in two_turns)

    broken = summaries["broken"]
    overall = broken.cells[report.OVERALL]
    assert overall.failures > 0 and overall.runs + overall.failures == 6
    assert overall.speedup[0] < 1e-6  # only the successful, slow runs count
    assert all("boom" in e for e in broken.errors)
    assert summaries["ar"].cells[report.OVERALL].speedup == (1.0, 0.0)
    assert summaries["draft"].cells["a"].mean_accepted_tokens >= 1.0

    text = report.markdown(list(summaries.values()), {"setting": "x"}, ["a note"])
    assert "broken FAILED" in text and "| draft |" in text and "a note" in text
    paths = report.plots(list(summaries.values()), tmp_path)
    assert all(p.stat().st_size > 1000 for p in paths)


def _run(method: str, task: str, seconds: float, category: str = "code", tokens=(1,) * 100, repeat: int = 0,
         error: str | None = None) -> Record:
    return Record(method, category, task, repeat, token_ids=list(tokens), turn_lengths=[len(tokens)], seconds=seconds,
                  error=error)


def test_a_task_is_its_category_and_its_id():
    """code and code-edit both hold HumanEval's ids: a run is timed and compared against the reference's run of its
    own task, not of the other category's task of the same id."""
    records = [_run("ar", "HumanEval/5", 1.0, "code", (1, 2)), _run("ar", "HumanEval/5", 4.0, "code-edit", (3, 4)),
               _run("pld", "HumanEval/5", 1.0, "code", (1, 2)), _run("pld", "HumanEval/5", 2.0, "code-edit", (3, 4))]
    summaries = {s.method: s for s in report.summarise(records, {"ar": True, "pld": True})}
    assert summaries["ar"].exact == (2, 2) == summaries["pld"].exact
    assert summaries["ar"].cells["code"].speedup == (1.0, 0.0)
    assert summaries["pld"].cells["code"].speedup == (1.0, 0.0)
    assert summaries["pld"].cells["code-edit"].speedup[0] == pytest.approx(2.0)


def test_a_task_the_reference_failed_on_is_left_out_of_the_ratio():
    """A row as fast as the reference on every task is 1.0x, though the reference failed its longest task."""
    records = [_run("ar", "a", 1.0), _run("ar", "b", 10.0, error="UserError: timeout"), _run("m", "a", 1.0),
               _run("m", "b", 10.0)]
    summaries = {s.method: s for s in report.summarise(records, {"ar": True, "m": True})}
    assert summaries["m"].cells[report.OVERALL].speedup == (1.0, 0.0)
    assert summaries["m"].cells[report.OVERALL].runs == 2  # (its own rate still counts the task)


def test_engines_under_load_pair_each_repeat_with_the_reference():
    """Two engines timed alike are 1.00x whatever the repeats' spread (a mean of rates over a pooled rate read
    1.33x here)."""
    from specdecode.bench.openai_engines import LevelRun

    levels = [LevelRun(name, 4, repeat, seconds, [_run(name, "t", seconds, repeat=repeat)])
              for name in ("ref", "eng") for repeat, seconds in ((0, 1.0), (1, 3.0))]
    cell = report.Cell((0, 0), (0, 0), None, 1, 0)
    rows = [report.MethodSummary(name, {report.OVERALL: cell}, None, engine=True) for name in ("ref", "eng")]
    table = [line for line in report._engine_tables(rows, levels, "ref") if line.startswith("| eng | 4 |")]
    assert table and "| 1.00x |" in table[0]


def test_two_sample_ks_matches_scipy():
    from scipy.stats import ks_2samp
    import torch

    g = torch.Generator().manual_seed(0)
    same_a, same_b = torch.randn(400, generator=g).tolist(), torch.randn(300, generator=g).tolist()
    shifted = (torch.randn(300, generator=g) + 0.5).tolist()
    for a, b in [(same_a, same_b), (same_a, shifted)]:
        gap, p = metrics.two_sample_ks(a, b)
        reference = ks_2samp(a, b, method="asymp")
        assert gap == pytest.approx(reference.statistic)
        assert p == pytest.approx(reference.pvalue, abs=0.02)
    assert metrics.two_sample_ks(same_a, shifted)[1] < 1e-4
    assert metrics.two_sample_ks([1, 1, 2], [1, 1, 2]) == (0.0, 1.0)


def test_sampled_fidelity_on_tiny_models(tiny_folder):
    from specdecode.bench.main import sampled_fidelity
    from specdecode.types import SamplingParams

    models = load_models(str(tiny_folder), str(tiny_folder), dtype="float32", progress=False)
    runners = build_runners(models, ["draft", "pld"])
    params = SamplingParams(temperature=1.0)
    colder = runners["ar"].run  # a broken "method": samples at a lower temperature than asked

    def biased(prompt_ids, config):
        return colder(prompt_ids, replace(config, sampling=SamplingParams(temperature=0.3)))

    runners["biased"] = Runner("biased", True, False, biased)
    tasks = [Task("a", f"a/{i}", (f"the cat {i}",)) for i in range(16)]
    records = run_benchmark(models, runners, tasks, GenerationConfig(max_new_tokens=24, sampling=params, seed=3), 1)
    notes = sampled_fidelity(models, records, {"ar": True, "draft": True, "pld": True, "biased": True}, params)
    by_method = {note.split(":")[0]: note for note in notes}
    assert len(notes) == 3 and "no difference" in by_method["draft"] and "no difference" in by_method["pld"]
    assert "DIFFERS" in by_method["biased"]
    # prompt lookup's drafts carry no distributions: under each task's seed, plain sampling's answer itself
    # (docs/verification.md, "Randomness"); the draft model samples its drafts, and its answers are its own
    answers = {(r.method, r.task_id): r.token_ids for r in records}
    tasks_ids = [task.task_id for task in tasks]
    assert all(answers["pld", task] == answers["ar", task] for task in tasks_ids)
    assert sum(step.drafted for r in records if r.method == "pld" for step in r.steps or []) > 0
    assert any(answers["draft", task] != answers["ar", task] for task in tasks_ids)


def test_an_interrupted_run_says_where_its_records_are(tmp_path, monkeypatch, capsys):
    """Ctrl-C mid-run: the runs that ended stay in records.jsonl and the command says so; a later run into the same
    folder is refused rather than writing over them."""
    from specdecode.bench import main as bench_main

    def interrupted(setup, tasks, config, repeats, levels, engines, reference, sink, *rest):
        sink(_run("ar", tasks[0].task_id, 1.0))
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_main, "run_here", interrupted)
    options = dict(methods=["ar"], categories=["qa"], per_category=1, max_new_tokens=4, repeats=1, out=tmp_path,
                   target="t", drafter="d", dtype="float32", draft_dtype="auto", threads=1, backend="torch",
                   temperature=0.0, top_k=0, top_p=1.0, seed=0)
    with pytest.raises(KeyboardInterrupt):
        bench_main.run(**options)
    said = capsys.readouterr().err.replace("\n", "")
    assert "interrupted: the 1 runs that ended are in" in said and "records.jsonl" in said
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 1
    with pytest.raises(UserError, match="holds an earlier run's records"):
        bench_main.run(**options)


def test_the_commit_a_report_records_is_the_packages_own(monkeypatch, tmp_path):
    """Installed inside another project's repository, the package is not that repository's: a report records its
    version, not the enclosing project's commit (as it did)."""
    import subprocess
    from pathlib import Path

    from specdecode.bench import server_process

    root = Path(server_process.__file__).resolve().parents[2]
    here = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    assert server_process.commit() == (here.stdout.strip() if here.returncode == 0 else server_process.commit())
    monkeypatch.setattr(server_process.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout=f"{tmp_path}\n3193d5a\n"))  # another repository's top level and commit
    assert server_process.commit().startswith("specdecode ")


def test_the_decoding_alone_table_and_an_engine_rows_own_reference():
    """The report's "Decoding alone" table gives each category's own decoding speedup in its column (not the overall
    one in every column); a row with its own plain run (`references`: an engine's, whose tokenizer may differ) is
    checked for exactness against that run, not against the report's reference."""
    def cell(speedup: float) -> report.Cell:
        return report.Cell((10.0, 0.0), (1.0, 0.0), None, 1, 0, decode_speedup=(speedup, 0.0))

    rows = [report.MethodSummary("m", {"code": cell(1.5), "qa": cell(3.0), report.OVERALL: cell(2.0)}, None)]
    table = report.markdown(rows, {}, [], "ar").split("## Decoding alone")[1].split("##")[0]
    assert next(line for line in table.splitlines() if line.startswith("| m |")) == "| m | 1.50x | 3.00x | 2.00x |"

    def run(method: str, tokens: tuple[int, ...]) -> Record:
        return Record(method, "code", "t", 0, token_ids=list(tokens), turn_lengths=[len(tokens)], seconds=1.0)

    records = [run("ar", (1, 2, 3)), run("eng-ar", (7, 8, 9)), run("eng", (7, 8, 9))]
    summaries = {s.method: s for s in report.summarise(records, {"ar": True, "eng-ar": False, "eng": True}, "ar",
                                                       {"eng": "eng-ar"})}
    assert summaries["eng"].exact == (1, 1) and summaries["eng"].reference == "eng-ar"
