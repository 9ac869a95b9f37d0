"""`specdecode train data --ray ADDRESS`: the target's answers made on a Ray cluster's nodes.

One actor per node (`AnswerNode`) loads the target once and keeps its own batch full
(`answers.Answerer`, the batched path of the single-machine run). The driver lists the prompts the
folder has not answered (`training.prompts`), hands each node `batch` of them at a time, as the node's
previous ones have all joined its batch, and appends the answers as they come back to the folder as
one machine does (`answer_store.Store`): the same answers.jsonl and answers.json, resumable the same way.

Limits as on one machine, counted over the cluster: no prompt is handed out once the folder's answer
tokens and those in flight on every node reach `tokens`; after `seconds` the answers in flight are
dropped. Which prompt is greedy or sampled, and with what seed, follows from its id alone
(`prompts.sampling_of`), so a node answers it as one machine would.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from specdecode import cluster
from specdecode.errors import UserError
from specdecode.training.answer_store import Answer, Store, describe_target
from specdecode.training.answers import Answerer, Summary, check_limits, progress_columns, summary
from specdecode.training.prompts import Prompt, Settings, prompts


@dataclass(frozen=True)
class Tick:
    """What a node sends back: the answers that ended, then the tokens its sequences in flight hold and
    all it has generated."""

    answers: list[Answer]
    live: int
    generated: int


class AnswerNode:
    """On a node: the target, loaded once (`start`), answering the prompts the driver hands it."""

    def __init__(self, target: str, dtype: str, settings: Settings, threads: int):
        self.target, self.dtype, self.settings, self.threads = target, dtype, settings, threads
        self.waiting: deque[Prompt] = deque()

    def start(self) -> dict:
        """Load the target; the target as a folder's manifest names it (`answers.describe_target`)."""
        from specdecode.api import load_models

        torch.set_num_threads(self.threads)
        models = load_models(self.target, None, dtype=self.dtype, progress=False)
        self.answerer = Answerer(models, self.settings)
        return describe_target(models, self.target)

    def answer(self, given: list[Prompt], batch: int, seconds: float | None, drain: bool) -> Iterator[Tick]:
        """Step the batch until every prompt given has joined it (`drain`: until none is in flight) or
        `seconds` have passed, yielding the answers as they end; last, where the node is."""
        self.waiting.extend(given)
        deadline = None if seconds is None else time.perf_counter() + seconds
        answerer = self.answerer
        while True:
            while answerer.busy < batch and self.waiting:
                answerer.add(self.waiting.popleft())
            late = deadline is not None and time.perf_counter() >= deadline
            if not answerer.busy or not (self.waiting or drain) or late:
                break
            ended = answerer.step()
            if ended:
                yield Tick(ended, answerer.live_tokens, answerer.generated)
        yield Tick([], answerer.live_tokens, answerer.generated)

    def drop(self) -> int:
        """Drop the sequences in flight (the time is out) and the prompts waiting; how many were in flight."""
        self.waiting.clear()
        return self.answerer.drop()


def start_nodes(ray, target: str, dtype: str, settings: Settings) -> dict:
    """An `AnswerNode` on every node, holding all its CPUs, by node name."""
    actor = ray.remote(AnswerNode)
    return {node.name: cluster.pinned(actor, node, node.cpus).remote(target, dtype, settings, node.cpus)
            for node in cluster.nodes(ray)}


def loaded_target(ray, nodes: dict, target: str) -> dict:
    """Each node's target loaded; the target as the folder's manifest names it (the same on every node)."""
    described = {}
    for name, node in nodes.items():
        try:
            described[name] = ray.get(node.start.remote())
        except ray.exceptions.RayTaskError as error:
            raise cluster.user_error(error, name) from None
    keys = {name: target["target_key"] for name, target in described.items()}
    if len(set(keys.values())) > 1:
        raise UserError(f"the nodes load different weights for {target!r}: {keys}")
    return next(iter(described.values()))


def generate(address: str, out: Path, *, target: str, dtype: str = "auto", settings: Settings = Settings(),
             tokens: int = 1_000_000, seconds: float | None = None, batch: int = 16, sharegpt: Path | None = None,
             stdlib: Path | None = None, openings: frozenset[str] | None = None, progress: bool = True) -> Summary:
    """`answers.generate` on the Ray cluster at `address`: every node answering with `batch` sequences in
    flight, the driver writing the folder `out`."""
    from specdecode.progress import Progress

    check_limits(tokens, seconds, batch)
    ray = cluster.connect(address)
    nodes = start_nodes(ray, target, dtype, settings)
    try:
        store = Store(out, loaded_target(ray, nodes, target), settings)
        listed = prompts(settings, sharegpt=sharegpt, stdlib=stdlib, openings=openings)
        todo = (p for p in listed if p.id not in store.done)
        live, generated = dict.fromkeys(nodes, 0), dict.fromkeys(nodes, 0)
        written, stopped_by, dropped, drained = store.tokens, "tokens", 0, set()
        start = time.perf_counter()

        def left() -> float | None:
            return None if seconds is None else seconds - (time.perf_counter() - start)

        def next_call(name: str):
            """The node's next call: more prompts while there is time and room, else finish its own (or,
            the time out, drop them)."""
            nonlocal stopped_by, dropped
            remaining = left()
            if remaining is not None and remaining <= 0:
                stopped_by = "seconds"
                dropped += ray.get(nodes[name].drop.remote())
                return None
            room = store.tokens + sum(live.values()) < tokens
            given = list(islice(todo, batch)) if room else []
            if room and not given:
                stopped_by = "prompts"
            if not given and name in drained:
                return None
            if not given:
                drained.add(name)
            return nodes[name].answer.remote(given, batch, left(), not given)

        try:
            with Progress(*progress_columns(), disable=not progress) as bar:
                task = bar.add_task("answers", total=tokens, completed=min(store.tokens, tokens), rate=0.0)
                first = {name: call for name in nodes if (call := next_call(name)) is not None}
                for name, tick in cluster.gather(ray, first, next_call):
                    live[name], generated[name] = tick.live, tick.generated
                    for answer in tick.answers:
                        store.append(answer)
                        store.write_manifest(sum(generated.values()), time.perf_counter() - start)
                    elapsed = time.perf_counter() - start
                    bar.update(task, completed=min(store.tokens + sum(live.values()), tokens),
                               rate=sum(generated.values()) / max(elapsed, 1e-9))
        finally:
            store.write_manifest(sum(generated.values()), time.perf_counter() - start)
            store.close()
    finally:
        for node in nodes.values():
            ray.kill(node)
    return summary(store, written, sum(generated.values()), time.perf_counter() - start, dropped, stopped_by)
