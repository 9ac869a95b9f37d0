"""`specdecode bench --ray ADDRESS`: the benchmark's tasks shared out over a Ray cluster's nodes.

Node i of n takes tasks i, i + n, i + 2n, ... of the run's list, loads the models once and runs the
harness on them as one machine runs the whole list (`harness.interleaved`): every method on each task,
in the order of methods and with the seed that task has in the whole run. Every ratio to `ar` is thus
one machine's: the report compares a node's runs with that node's `ar` runs (`report.summarise` groups by
`Record.node`). The driver writes each record as it arrives; each names the node that ran it.

The exactness notes are made where the models are: each node diagnoses its own divergences (greedy) or
sends the target's log-probabilities of its sampled tokens, which the driver tests together (sampling).
A method that learns across prompts (suffix decoding, say) learns from its node's share only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from specdecode import cluster
from specdecode.bench.datasets import Task
from specdecode.bench.exactness import diagnose_divergences, distribution_notes, target_log_probs
from specdecode.bench.harness import BenchOutcome, Record, interleaved
from specdecode.bench.runners import Setup
from specdecode.engine import GenerationConfig
from specdecode.models import costs


@dataclass(frozen=True)
class NodeStart:
    """A node's first message, once its models are loaded."""

    lossless: dict[str, bool]
    precision: str
    threads: int
    machine: str


@dataclass(frozen=True)
class NodeEnd:
    """A node's last message: its exactness notes (greedy) or log-probabilities (sampling)."""

    notes: list[str]
    log_probs: dict[str, list[float]]


def share(tasks: list[Task], nodes: int) -> list[list[tuple[int, Task]]]:
    """(position in the run, task) for each node: every n-th task, so each node gets every category."""
    return [[(i, task) for i, task in enumerate(tasks) if i % nodes == k] for k in range(nodes)]


def node_job(setup: Setup, tasks: list[tuple[int, Task]], count: int, config: GenerationConfig, repeats: int,
             reference: str, node: str, memory: str = "repeat") -> Iterator[NodeStart | Record | NodeEnd]:
    """On a node: load the models, run every method on its share of the `count` tasks, then the notes."""
    models, runners = setup.load(progress=False)
    lossless = {name: runner.lossless for name, runner in runners.items()}
    precision, threads = models.target.precision, torch.get_num_threads()
    yield NodeStart(lossless, precision, threads, f"{node}: {costs.machine()}, {precision}")
    records = []
    for record in interleaved(models, runners, [task for _, task in tasks], config, repeats,
                              positions=[position for position, _ in tasks], count=count, memory=memory):
        record.node = node
        records.append(record)
        yield record
    if config.sampling.greedy:
        yield NodeEnd(diagnose_divergences(models, records, lossless, reference=reference), {})
    else:
        yield NodeEnd([], target_log_probs(models, records, lossless, config.sampling))


def run(address: str, setup: Setup, tasks: list[Task], config: GenerationConfig, repeats: int, reference: str,
        on_record: Callable[[Record], None], on_start: Callable[[int, str], None] = lambda total, what: None,
        memory: str = "repeat") -> BenchOutcome:
    """The benchmark on the cluster at `address`: one job per node (no more nodes than tasks), pinned to
    it; records handed to `on_record` as they arrive, in no set order; `on_start(records to come, what
    runs them)` once every node has its models."""
    ray = cluster.connect(address)
    nodes = cluster.nodes(ray)[: len(tasks)]
    job = ray.remote(node_job)
    streams = {node.name: cluster.pinned(job, node, setup.threads).remote(
        setup, shard, len(tasks), config, repeats, reference, node.name, memory)
        for node, shard in zip(nodes, share(tasks, len(nodes)))}
    starts: dict[str, NodeStart] = {}
    records: list[Record] = []
    notes: list[str] = []
    log_probs: dict[str, list[float]] = {}
    for name, item in cluster.gather(ray, streams):
        if isinstance(item, NodeStart):
            starts[name] = item
            if len(starts) == len(nodes):
                on_start(repeats * len(tasks) * len(item.lossless), f"on {len(nodes)} Ray node(s)")
        elif isinstance(item, Record):
            records.append(item)
            on_record(item)
        else:
            notes += item.notes
            for method, values in item.log_probs.items():
                log_probs.setdefault(method, []).extend(values)
    first = starts[nodes[0].name]
    return BenchOutcome(records, first.lossless, notes + distribution_notes(log_probs), first.precision,
                        first.threads, [starts[node.name].machine for node in nodes])
