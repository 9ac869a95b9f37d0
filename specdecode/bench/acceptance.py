"""Acceptance recordings: what each step of a run drafted and how much of it the target accepted, per prompt and
method, kept as a small file (`specdecode bench --record-acceptance FILE`) that a machine without the real
models replays (`bench.replay_acceptance`, `scripts/gpu-check --parts replay`).

A recorded step is the draft's shape as the target verified it (after the engine's gate: a chain's length, a
tree's parents) and the verdict's accepted count (and, for a tree, the accepted path), or a plain step the
step-aside switch played (`aside`: the drafter was not asked). A run also keeps its prompt's token ids and
the method's output ids. The file is gzip-compressed JSON:

    {"version": 1, "label": "replayed acceptance", "settings": {...the bench's settings...},
     "runs": [{"method", "category", "task_id", "repeat", "turn", "prompt_ids", "output_ids",
               "drafted": [n per step], "accepted": [n per step], "aside": [indices of plain steps],
               "parents": [a tree step's parents, or null], "paths": [a tree step's accepted nodes, or null]}]}
"""

from __future__ import annotations

import gzip
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.bench.harness import Record
from specdecode.drafters.base import Drafter, Needs, Outcome
from specdecode.engine import SpeculativeEngine
from specdecode.errors import UserError
from specdecode.types import Draft, SamplingParams

VERSION = 1
LABEL = "replayed acceptance"  # how every figure measured from a recording is named


@dataclass(frozen=True)
class RecordedStep:
    """One step as the target verified it: `drafted` tokens (tree nodes), `accepted` of them (the verdict's,
    before any stop cut the output), a tree's `parents` and accepted `path` (None: a chain, whose path is its
    first `accepted` positions), and whether the step-aside switch made it a plain step."""

    drafted: int
    accepted: int
    parents: tuple[int, ...] | None = None
    path: tuple[int, ...] | None = None
    aside: bool = False

    @property
    def accepted_path(self) -> tuple[int, ...]:
        return tuple(range(self.accepted)) if self.path is None else self.path

    @property
    def depth(self) -> int:
        """The longest root-to-leaf path (a chain: its length)."""
        if self.parents is None:
            return self.drafted
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return max(depths, default=0)


@dataclass
class RecordedRun:
    """One turn of one method on one prompt: its prompt and output ids and its steps."""

    method: str
    category: str
    task_id: str
    repeat: int
    turn: int
    prompt_ids: list[int]
    output_ids: list[int]
    steps: list[RecordedStep] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        """The recorded run's new tokens per target forward (`metrics.mean_accepted_tokens`'s convention)."""
        return len(self.output_ids) / max(len(self.steps), 1)

    def to_json(self) -> dict:
        return {"method": self.method, "category": self.category, "task_id": self.task_id, "repeat": self.repeat,
                "turn": self.turn, "prompt_ids": self.prompt_ids, "output_ids": self.output_ids,
                "drafted": [s.drafted for s in self.steps], "accepted": [s.accepted for s in self.steps],
                "aside": [i for i, s in enumerate(self.steps) if s.aside],
                "parents": [None if s.parents is None else list(s.parents) for s in self.steps],
                "paths": [None if s.path is None else list(s.path) for s in self.steps]}

    @classmethod
    def from_json(cls, data: dict) -> RecordedRun:
        aside = set(data["aside"])
        steps = [RecordedStep(d, a, None if p is None else tuple(p), None if q is None else tuple(q), i in aside)
                 for i, (d, a, p, q) in enumerate(zip(data["drafted"], data["accepted"], data["parents"],
                                                      data["paths"]))]
        return cls(data["method"], data["category"], data["task_id"], data["repeat"], data["turn"],
                   list(data["prompt_ids"]), list(data["output_ids"]), steps)


def save(path: Path, runs: list[RecordedRun], settings: dict[str, str]) -> None:
    """Write a recording (gzip-compressed JSON when the name ends in .gz, else plain JSON)."""
    data = {"version": VERSION, "label": LABEL, "settings": settings, "runs": [run.to_json() for run in runs]}
    text = json.dumps(data, separators=(",", ":"))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)


def load(path: Path) -> tuple[dict[str, str], list[RecordedRun]]:
    """A recording's settings and runs."""
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    if data.get("version") != VERSION:
        raise UserError(f"{path} is an acceptance recording of version {data.get('version')}; this reads {VERSION}")
    return data["settings"], [RecordedRun.from_json(run) for run in data["runs"]]


class Wrapped(Drafter):
    """A drafter that passes every call to `inner` and says what it says of itself: the base of the recording,
    replaying and timing wrappers."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name = inner.name
        self.batchable, self.catches_up, self.weighs_itself = inner.batchable, inner.catches_up, inner.weighs_itself

    @property
    def needs(self) -> Needs:  # type: ignore[override]  # the inner drafter's, read when asked
        return self.inner.needs

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self.inner.begin(prompt_ids, forget)

    def propose(self, context: list[int], max_tokens: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        return self.inner.propose(context, max_tokens, params, generator)

    def observe(self, outcome: Outcome) -> None:
        self.inner.observe(outcome)

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()


def recorded_step(outcome: Outcome) -> RecordedStep:
    """What a step's outcome says of the draft's shape and its acceptance."""
    draft, verdict = outcome.draft, outcome.verdict
    tree = draft.parents is not None and len(draft) > 0
    return RecordedStep(verdict.num_drafted, verdict.num_accepted,
                        tuple(draft.parents.tolist()) if tree and draft.parents is not None else None,
                        tuple(verdict.path) if tree else None, outcome.stats.stepped_aside)


class RecordingDrafter(Wrapped):
    """Keeps, for every sequence it drafts for, the steps' shapes and verdicts (`recorded_step`)."""

    def __init__(self, inner: Drafter, sequences: list[list[RecordedStep]]):
        super().__init__(inner)
        self.sequences = sequences

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self.sequences.append([])
        super().begin(prompt_ids, forget)

    def observe(self, outcome: Outcome) -> None:
        self.sequences[-1].append(recorded_step(outcome))
        super().observe(outcome)


class Recorder:
    """Records the steps of the benchmark's engines (`attach`), and turns each record the harness makes
    into recorded runs (`take`: one per turn; the warm-up's and failed runs' are dropped)."""

    def __init__(self):
        # by method: the steps of each sequence its drafter began since the last record taken
        self._sequences: dict[str, list[list[RecordedStep]]] = {}
        self.runs: list[RecordedRun] = []

    def attach(self, engine: SpeculativeEngine) -> None:
        """Record the steps of `engine`'s drafter (an engine without one, plain decoding, has none)."""
        if engine.drafter is not None:
            engine.drafter = RecordingDrafter(engine.drafter, self._sequences.setdefault(engine.method, []))

    def take(self, record: Record) -> None:
        if record.method not in self._sequences:  # plain decoding, a peer
            return
        sequences = list(self._sequences[record.method])
        self._sequences[record.method].clear()
        if record.repeat < 0 or not record.ok or record.steps is None:  # the warm-up, a failure
            return
        turns = record.turns()
        if len(sequences) < len(turns):  # not one sequence a turn: nothing to trust
            print(f"record-acceptance: {record.method} {record.task_id}: {len(sequences)} sequences for "
                  f"{len(turns)} turns, not recorded", file=sys.stderr)
            return
        # the record's turns are the last sequences begun (before them: the warm-up, which makes no record)
        for turn, ((prompt, output), steps) in enumerate(zip(turns, sequences[len(sequences) - len(turns):])):
            self.runs.append(RecordedRun(record.method, record.category, record.task_id, record.repeat, turn,
                                         list(prompt), list(output), steps))
