"""The files of a folder of the target's answers (`training.answers` makes them), in the output folder:
  answers.jsonl  one object per finished answer, appended and flushed line by line: id, source, mode
                 ("greedy" or "sampled"), seed (the sampling seed; null when greedy), prompt_ids,
                 answer_ids (the EOS token included when it ended there), finish_reason
  answers-NNN.jsonl.xz  answers packed away (`pack`): the same lines, xz-compressed, never written
                 again; about 1 byte a token, prompts included, so a folder's answers can be kept in a
                 repository and a fresh machine carries on from them (the project keeps its default
                 target's in training-data/)
  answers.json   the manifest: the target (name, cost key, precision, path), the settings, the counts
  features/      (with `keep_features`) the target's features of each answer, kept from the forwards that
                 generated it (`features.Writer`; the inputs of EAGLE-3's three layers and the final-norm
                 states of the prompt's tokens and the answer's but its last): the training's pass over
                 the answers is then not needed. A kill loses the features of the answers not yet in a
                 shard; the training extracts those.
A kill loses at most the answers in flight; a rerun skips the ids already answered, for the same target
and settings only. One process writes a folder at a time (a lock on answers.jsonl).
"""

from __future__ import annotations

import fcntl
import json
import lzma
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from specdecode.errors import UserError
from specdecode.paths import read_record
from specdecode.training import corpus
from specdecode.training.prompts import Settings

ANSWERS = "answers.jsonl"
PACKED = "answers-{:03d}.jsonl.xz"  # `pack`'s chunks, numbered from 0
REMAKE = "move it away and make the answers again (`specdecode train data --out DIR`)"  # a damaged file's fix
MANIFEST = "answers.json"


@dataclass(frozen=True)
class Answer:
    """One line of answers.jsonl."""

    id: str
    source: str
    mode: str  # "greedy" or "sampled"
    seed: int | None  # the sampling seed (None: greedy)
    prompt_ids: list[int]  # chat-templated, as the target saw them
    answer_ids: list[int]  # the new tokens, the EOS token included when it ended there
    finish_reason: str  # "eos" or "length" (max_new_tokens or the context is full)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Answer:
        return cls(**json.loads(line))


def describe_target(models, name: str) -> dict:
    """The target as a folder's manifest names it: a rerun must find the same cost key (weights and
    precision; the folder they are cached in may differ, `check_target`)."""
    target = models.target
    config = getattr(getattr(target, "model", None), "config", None)
    return {"target": name, "target_key": target.cost_key, "dtype": getattr(target, "precision", None),
            "path": getattr(config, "_name_or_path", None)}


def read_answers(path: Path, repair: bool = False) -> list[Answer]:
    """The answers of an answers.jsonl. A last line cut by a kill is dropped (and, with repair=True,
    cut off the file, so the next line starts clean); a broken line elsewhere is an error."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete < len(data) and repair:
        with path.open("r+b") as file:
            file.truncate(complete)
    answers = []
    for number, line in enumerate(data[:complete].decode("utf-8").splitlines(), 1):
        try:
            answers.append(Answer.from_json(line))
        except (ValueError, TypeError):
            raise UserError(f"line {number} of {path} is not an answer; the file is damaged") from None
    return answers


def packed_files(folder: Path) -> list[Path]:
    """The folder's packed chunks, in the order they were packed."""
    return sorted(Path(folder).glob(PACKED.replace("{:03d}", "[0-9]*")))


def read_packed(folder: Path) -> list[Answer]:
    """The answers of the folder's packed chunks."""
    return [Answer.from_json(line) for path in packed_files(folder)
            for line in lzma.decompress(path.read_bytes()).decode().splitlines()]


def read_all(folder: Path, repair: bool = False) -> list[Answer]:
    """The packed answers, then answers.jsonl's (`read_answers`), each id once: a kill during `pack`
    may leave a chunk's answers in answers.jsonl too."""
    answers, seen = [], set()
    for answer in read_packed(folder) + read_answers(Path(folder) / ANSWERS, repair):
        if answer.id not in seen:
            seen.add(answer.id)
            answers.append(answer)
    return answers


def load(folder: Path) -> tuple[dict, list[Answer]]:
    """The manifest and the answers of an answers folder."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise UserError(f"{folder} holds no answers ({MANIFEST} is missing): "
                        "`specdecode train data --out DIR` makes them")
    return read_record(folder / MANIFEST, "an answers manifest", REMAKE), read_all(folder)


def _lock(file, folder: Path) -> None:
    """Hold answers.jsonl for this process (until the file closes): two writers would interleave lines,
    and `pack` under a writer would lose the lines written meanwhile."""
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        raise UserError(f"another process is writing answers into {folder}; wait for it or stop it") from None


def pack(folder: Path) -> tuple[int, int, Path | None]:
    """Move answers.jsonl's answers into the next compressed chunk (answers-NNN.jsonl.xz) and empty it;
    (answers, answer tokens, the chunk or None when there was nothing to pack). Refused while a `train
    data` run writes to the folder."""
    folder = Path(folder)
    load(folder)  # a folder of answers, or a UserError
    with (folder / ANSWERS).open("a+b") as file:
        _lock(file, folder)
        packed = {a.id for a in read_packed(folder)}
        fresh = [a for a in read_answers(folder / ANSWERS) if a.id not in packed]
        if fresh:
            chunk = folder / PACKED.format(len(packed_files(folder)))
            temporary = chunk.with_name(chunk.name + ".tmp")
            temporary.write_bytes(lzma.compress("".join(a.to_json() + "\n" for a in fresh).encode(), preset=9))
            os.replace(temporary, chunk)
        # after the chunk is in place: a kill before this leaves both, and `read_all` takes each id once
        file.truncate(0)
    return len(fresh), sum(len(a.answer_ids) for a in fresh), chunk if fresh else None


def features_folder(folder: Path) -> Path:
    """Where `generate(keep_features=True)` keeps the features of an answers folder's answers."""
    return Path(folder) / "features"


def sequences(folder: Path) -> list[corpus.Sequence]:
    """The stored answers as training sequences: prompt then answer, the answer's tokens marked as the
    assistant's (source "sharegpt-answers" or "stdlib-answers"), in the file's order."""
    return [corpus.Sequence(f"{a.source}-answers", a.prompt_ids + a.answer_ids,
                            [False] * len(a.prompt_ids) + [True] * len(a.answer_ids), a.id)
            for a in load(folder)[1] if a.answer_ids]


class Store:
    """An answers folder open for appending."""

    def __init__(self, folder: Path, target: dict, settings: Settings):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        manifest_path, answers_path = self.folder / MANIFEST, self.folder / ANSWERS
        if manifest_path.is_file():
            self.manifest = read_record(manifest_path, "an answers manifest", REMAKE)
            check_target(self.folder, self.manifest, target)
            check_settings(self.folder, settings)
        elif answers_path.is_file() and answers_path.stat().st_size:
            raise UserError(f"{answers_path} has no {MANIFEST} beside it; pick another --out")
        else:
            self.manifest = {**target, "settings": asdict(settings), "runs": []}
        self._file = answers_path.open("a", encoding="utf-8")
        _lock(self._file, self.folder)
        answers = read_all(self.folder, repair=True)
        self.done = {a.id for a in answers}
        self.counts: Counter[str] = Counter()
        self.groups: dict[str, Counter[str]] = {name: Counter() for name in
                                                ("tokens_by_source", "tokens_by_mode", "finish_reasons")}
        for answer in answers:
            self._count(answer)
        self.manifest["runs"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "answers": 0, "tokens": 0,
                                      "generated": 0, "seconds": 0.0})
        self.write_manifest()

    @property
    def tokens(self) -> int:
        return self.counts["answer_tokens"]

    def _count(self, answer: Answer) -> None:
        self.counts["answers"] += 1
        self.counts["answer_tokens"] += len(answer.answer_ids)
        self.counts["prompt_tokens"] += len(answer.prompt_ids)
        self.groups["tokens_by_source"][answer.source] += len(answer.answer_ids)
        self.groups["tokens_by_mode"][answer.mode] += len(answer.answer_ids)
        self.groups["finish_reasons"][answer.finish_reason] += 1

    def append(self, answer: Answer) -> None:
        self._file.write(answer.to_json() + "\n")
        self._file.flush()
        self.done.add(answer.id)
        self._count(answer)
        run = self.manifest["runs"][-1]
        run["answers"] += 1
        run["tokens"] += len(answer.answer_ids)

    def write_manifest(self, generated: int = 0, seconds: float = 0.0) -> None:
        """The manifest with the counts so far, replaced whole (a kill leaves the old one or the new)."""
        run = self.manifest["runs"][-1]
        run["generated"], run["seconds"] = generated, round(seconds, 1)
        self.manifest.update({key: self.counts[key] for key in ("answers", "answer_tokens", "prompt_tokens")})
        self.manifest.update({name: dict(sorted(group.items())) for name, group in self.groups.items()})
        temporary = self.folder / (MANIFEST + ".tmp")
        temporary.write_text(json.dumps(self.manifest, indent=1))
        os.replace(temporary, self.folder / MANIFEST)

    def close(self) -> None:
        self._file.close()


def target_identity(key: str) -> str:
    """A cost key as the identity of its target: a registered model's folder, in each user's own cache (a folder of
    answers kept in a repository meets many), cut to the model's name; any other folder kept whole (two checkpoints
    of one folder name are two targets; `models.loading.resolve` makes a local folder's path absolute)."""
    from specdecode.models.registry import registered_models

    parts = key.split("|")
    if len(parts) > 2 and Path(parts[1]).parent.name == "models" and Path(parts[1]).name in registered_models():
        parts[1] = Path(parts[1]).name
    return "|".join(parts)


def same_target(kept: object, key: object) -> bool:
    """Whether a folder's recorded target key (`kept`) names the target of `key` (`target_identity`)."""
    return target_identity(str(kept or "")) == target_identity(str(key or ""))


def check_target(folder: Path, manifest: dict, target: dict) -> None:
    """A UserError unless a folder's answers come from this target (`describe_target`), wherever its
    weights are cached."""
    if not same_target(manifest.get("target_key"), target["target_key"]):
        raise UserError(f"{folder} holds answers of {manifest.get('target')!r} ({manifest.get('dtype')}), not of "
                        f"{target['target']!r} ({target['dtype']}); pick another --out")


def check_settings(folder: Path, settings: Settings) -> None:
    """A UserError if the folder holds answers made with other settings (before a model loads)."""
    if not (Path(folder) / MANIFEST).is_file():
        return
    stored = read_record(Path(folder) / MANIFEST, "an answers manifest", REMAKE).get("settings", {})
    for item in fields(Settings):
        if stored.get(item.name) != getattr(settings, item.name):
            raise UserError(f"{folder} holds answers made with {item.name}={stored.get(item.name)!r}, not "
                            f"{getattr(settings, item.name)!r}; rerun with the same settings or pick another --out")
