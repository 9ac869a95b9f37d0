"""Ray: the benchmark and the trained drafters' data on a local cluster of two worker nodes started here
(on loopback), each against the single-machine run of the same prompts: the same records but for the
timings, every node with work, ratios taken within a node; and `--ray` without Ray is one line."""

from __future__ import annotations

import json
import os
import sys

import pytest

import conftest
from specdecode.bench import main as bench_main
from specdecode.bench import report
from specdecode.bench.datasets import Task
from specdecode.bench.harness import Record
from specdecode.errors import UserError
from test_training_answers import SETTINGS, sources  # noqa: F401 - the fixture, a small ShareGPT file and stdlib

pytestmark = pytest.mark.usefixtures("one_thread")

TASKS = [Task("a", "a/1", ("the cat",)), Task("a", "a/2", ("the the", "and again")),
         Task("b", "b/1", ("hello",)), Task("b", "b/2", ("the mat the cat",)), Task("b", "b/3", ("and then",))]
TIMINGS = {"seconds", "prefill_seconds", "draft_seconds", "verify_seconds", "node"}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A head node that takes no work and two worker nodes of one CPU each, on 127.0.0.1; their workers
    get the tests' fixed cost curves (`conftest.fixed_measure`) and a temporary cache, as this process."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read at import: Ray's addresses stay on loopback
    import ray
    from ray import cloudpickle
    from ray.cluster_utils import Cluster

    store = 100 * 2**20
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "object_store_memory": store})
    for _ in range(2):
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=store)
    cluster.wait_for_nodes()
    cloudpickle.register_pickle_by_value(conftest)  # the workers cannot import the tests' conftest

    fixed_measure = conftest.fixed_measure

    def fixed_cost_curves():
        from specdecode.models import costs
        from specdecode.models.base import CausalLM

        costs.measure = fixed_measure
        CausalLM.cost_curve = lambda self: costs.cached(self, self.cost_key)

    cache = tmp_path_factory.mktemp("ray-cache")
    ray.init(address=cluster.address, log_to_driver=False, runtime_env={
        "worker_process_setup_hook": fixed_cost_curves, "env_vars": {"SPECDECODE_CACHE": str(cache)}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    cloudpickle.unregister_pickle_by_value(conftest)
    del os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]


def without_timings(record: dict) -> dict:
    kept = {key: value for key, value in record.items() if key not in TIMINGS}
    if kept["steps"] is not None:
        kept["steps"] = [{k: v for k, v in step.items() if k not in TIMINGS} for step in kept["steps"]]
    return kept


def bench(monkeypatch, folder, out, ray=None, temperature=0.0):
    monkeypatch.setattr(bench_main, "sample_tasks", lambda categories, per_category, seed=0, part="held-out": TASKS)
    bench_main.run(methods=["pld", "draft", "hf-plain"], categories=["a", "b"], per_category=None, max_new_tokens=8,
                   repeats=2, out=out, target=str(folder), drafter=str(folder), dtype="float32",
                   draft_dtype="float32", threads=1, backend="torch", temperature=temperature, top_k=0, top_p=1.0,
                   seed=0, ray=ray)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return sorted(records, key=lambda r: (r["method"], r["task_id"], r["repeat"]))


def test_bench_on_two_nodes_gives_the_single_machine_records(ray_cluster, tiny_folder, tmp_path, monkeypatch):
    here = bench(monkeypatch, tiny_folder, tmp_path / "here")
    there = bench(monkeypatch, tiny_folder, tmp_path / "there", ray="auto")
    assert len(there) == len(here) == 2 * len(TASKS) * 4  # ar and three methods
    assert [without_timings(r) for r in there] == [without_timings(r) for r in here]
    assert all(r["error"] is None for r in there)
    nodes = {r["node"] for r in there}
    assert len(nodes) == 2 and all(r["node"] is None for r in here)
    for node in nodes:  # every task's runs on one node, every method with them
        mine = [r for r in there if r["node"] == node]
        assert {r["method"] for r in mine} == {"ar", "pld", "draft", "hf-plain"}
        assert all(r["node"] == node for r in there if r["task_id"] in {m["task_id"] for m in mine})
    text = (tmp_path / "there" / "report.md").read_text()
    assert "--ray auto" in text and "2 Ray nodes" in text and "| draft |" in text


def test_sampled_bench_on_two_nodes(ray_cluster, tiny_folder, tmp_path, monkeypatch):
    """Sampling: the same seeds per task on a node as on one machine, so the same tokens; the distribution
    notes gathered from both nodes."""
    here = bench(monkeypatch, tiny_folder, tmp_path / "here", temperature=0.8)
    there = bench(monkeypatch, tiny_folder, tmp_path / "there", ray="auto", temperature=0.8)
    assert [without_timings(r) for r in there] == [without_timings(r) for r in here]
    text = " ".join((tmp_path / "there" / "report.md").read_text().split())
    assert "pld: target log-probabilities of its" in text


def test_train_data_on_two_nodes_writes_the_single_machine_answers(ray_cluster, tiny_folder,
                                                                   sources, tmp_path):  # noqa: F811  (imported fixture)
    """The same answers and counts as one machine's run; resumed as one machine resumes: a folder begun
    here (stopped by its token budget) finished on the cluster, no prompt answered twice."""
    from specdecode.api import load_models
    from specdecode.training import answer_store, answers, ray_answers

    models = load_models(str(tiny_folder), None, dtype="float32", progress=False)
    options = dict(target=str(tiny_folder), settings=SETTINGS, batch=4, sharegpt=sources[0], stdlib=sources[1],
                   openings=frozenset(), progress=False)
    whole = answers.generate(models, tmp_path / "here", tokens=10**6, **options)
    begun = answers.generate(models, tmp_path / "there", tokens=60, **options)
    assert whole.stopped_by == "prompts" and begun.stopped_by == "tokens" and begun.answers < whole.answers
    rest = ray_answers.generate("auto", tmp_path / "there", dtype="float32", tokens=10**6, **options)
    assert rest.stopped_by == "prompts" and begun.answers + rest.answers == whole.answers
    manifest_here, stored_here = answer_store.load(tmp_path / "here")
    manifest_there, stored_there = answer_store.load(tmp_path / "there")
    assert sorted(stored_there, key=lambda a: a.id) == sorted(stored_here, key=lambda a: a.id)
    counts = ("target", "target_key", "dtype", "settings", "answers", "answer_tokens", "prompt_tokens",
              "tokens_by_source", "tokens_by_mode", "finish_reasons")
    assert {key: manifest_there[key] for key in counts} == {key: manifest_here[key] for key in counts}
    assert len(manifest_there["runs"]) == 2


def record(method, node, tokens, seconds, repeat=0):
    return Record(method, "a", f"a/{node}", repeat, token_ids=[1] * tokens, seconds=seconds,
                  turn_lengths=[tokens], prefill_seconds=None, node=node)


def test_each_ratio_is_taken_within_a_node():
    """A fast node and a slow one, each method twice as fast as ar on both: 2x, with no spread."""
    records = [record("ar", "fast", 100, 1.0), record("m", "fast", 100, 0.5),
               record("ar", "slow", 100, 10.0), record("m", "slow", 100, 5.0)]
    summaries = {s.method: s for s in report.summarise(records, {"ar": True, "m": False})}
    assert summaries["m"].cells[report.OVERALL].speedup == (2.0, 0.0)
    assert summaries["ar"].cells[report.OVERALL].speedup == (1.0, 0.0)


def test_without_ray_a_one_line_error(monkeypatch, capsys, tiny_folder, tmp_path):
    from specdecode.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is not installed
    for command in (["bench", "--methods", "pld", "--target", str(tiny_folder), "--ray", "auto"],
                    ["train", "data", "--out", str(tmp_path / "answers"), "--target", str(tiny_folder),
                     "--ray", "auto"]):
        monkeypatch.setattr(sys, "argv", ["specdecode", *command])
        with pytest.raises(SystemExit) as exit_info:
            main()
        err = " ".join(capsys.readouterr().err.split())
        assert exit_info.value.code == 2 and "Traceback" not in err, err
        assert "pip install 'specdecode[ray]'" in err, err
    with pytest.raises(UserError, match="specdecode\\[ray\\]"):
        from specdecode import cluster

        cluster.import_ray()
