"""What training any head on stored target features shares: the data windows, the draft vocabulary,
the held-out split, the record, and the optimisation loop (AdamW, warm-up then cosine decay, gradient
clipping, a time budget per run, checkpoints a later run resumes from, bfloat16 autocast over float32
weights where the device computes in bf16 natively, a progress bar).

Training runs on the device of the module it trains (the target's, `specdecode train --device`): the
stored features are host data, mapped from their files, and each window goes to the device as it is
trained on (`on_device`).

Training on a CPU takes hours, so it runs in bounded pieces: `optimise` saves where it is to a
checkpoint every CHECKPOINT_SECONDS and when its time budget runs out (the head's and the optimiser's
state, the learning-rate schedule, the step, the position in the shuffled windows (whose order the seed
fixes), torch's global generators (the CPU's, and a GPU's where it trains: feature noise draws from the
device's), the record so far), and a run given the same checkpoint, settings and data carries on from
there: a run cut into pieces, or killed and started again, ends with the weights one uninterrupted run
gives. The checkpoint is removed once the schedule is complete."""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdecode.devices import to_device
from specdecode.errors import UserError
from specdecode.models.precision import bf16_units
from specdecode.paths import console
from specdecode.training.features import Shard

HELD_OUT = 0.05  # share of sequences kept for evaluation (`held_out`)
CHECKPOINT_SECONDS = 300.0  # how often a run saves where it is (and always when its time budget ends)

# tokens [n], features [n, d], assistant [n]; with EAGLE-3's layer inputs [n, k d] after them
Window = tuple[torch.Tensor, ...]


@dataclass
class Schedule:
    seconds: float = 3600.0  # the time budget
    epochs: int = 4
    learning_rate: float = 3e-4
    warmup_steps: int = 50
    batch_windows: int = 4  # windows per optimiser step
    seed: int = 0


@dataclass
class TrainingRecord:
    settings: dict
    steps: int = 0
    tokens_seen: int = 0
    seconds: float = 0.0
    losses: list[dict] = field(default_factory=list)  # every 20 steps: step, each loss's mean, seconds
    held_out_accuracy: list[float] = field(default_factory=list)  # by draft position, 1 first
    notes: dict = field(default_factory=dict)  # further measurements a kind of head records


def autocast(device: torch.device):
    """bfloat16 autocast over float32 weights where `device` computes in bf16 natively: a CPU with bf16 units
    (emulated, it is far slower), a CUDA GPU of compute capability 8 or more; else nothing (float32)."""
    if device.type == "cpu":
        enabled = bf16_units()
    else:
        enabled = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def on_device(window: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """A window's tensors (host data, mapped from the features' files) on `device`."""
    return tuple(to_device(part, device) for part in window)


def frequent_tokens(shards: list[Shard], size: int, always: list[int]) -> torch.Tensor:
    """`always` (the end-of-answer ids), and the most frequent other token ids of the data (assistant tokens counted)
    up to `size` in all, sorted."""
    counts: Counter[int] = Counter()
    for shard in shards:
        counts.update(shard.tokens[shard.assistant].tolist())
    ranked = [token for token, _ in counts.most_common() if token not in always]
    chosen = set(ranked[: max(size - len(set(always)), 0)]) | set(always)
    return torch.tensor(sorted(chosen), dtype=torch.long, device="cpu")  # host data


def windows(shards: list[Shard], length: int, shortest: int = 8, aux: bool = False) -> list[tuple[str, Window]]:
    """(sequence key, (tokens, features, assistant[, layer inputs with `aux`])) windows of at most `length`
    tokens and at least `shortest`, sequences cut where needed."""
    out = []
    for index, shard in enumerate(shards):
        sequences = shard.sequences_with_aux() if aux else shard.sequences()
        for key, parts in zip(shard.keys(index), sequences):
            for begin in range(0, len(parts[0]), length):
                end = min(begin + length, len(parts[0]))
                if end - begin >= shortest:
                    out.append((key, tuple(part[begin:end] for part in parts)))
    return out


def held_out(key: str) -> bool:
    """Whether the sequence named `key` is kept for evaluation: about HELD_OUT of them, chosen by a hash of
    the name, so a sequence stays on its side as the data grows (a head carried on to more data is never
    evaluated on what it learnt from) and all of a sequence's windows go to the same side."""
    return zlib.crc32(key.encode()) % 10_000 < HELD_OUT * 10_000


def split(data: list[tuple[str, Window]], seed: int) -> tuple[list[Window], list[Window]]:
    """(training windows shuffled with `seed`, held-out windows) of (sequence key, window) pairs; a UserError for
    none to train on (every sequence shorter than a window: Medusa and EAGLE saved an untrained head)."""
    training = [window for key, window in data if not held_out(key)]
    evaluation = [window for key, window in data if held_out(key)]
    random.Random(seed).shuffle(training)
    if not evaluation and len(training) > 1:  # a tiny data set: one window still shows something
        evaluation.append(training.pop())
    if not training:
        raise UserError("the features hold no window long enough to train on")
    return training, evaluation


# a window's losses: (the total to minimise, named parts to log, positions counted) or None (nothing to learn)
LossFn = Callable[[Window], "tuple[torch.Tensor, dict[str, torch.Tensor], int] | None"]


class _Run:
    """One run of `optimise`: the optimiser, its schedule, where the run is in the shuffled windows, and the
    checkpoint that saves all of it."""

    def __init__(self, module: torch.nn.Module, training: list[Window], schedule: Schedule, record: TrainingRecord,
                 checkpoint: Path | None):
        self.module, self.schedule, self.record, self.checkpoint = module, schedule, record, checkpoint
        self.device = next(module.parameters()).device  # where it trains, and each window goes
        rng = random.Random(schedule.seed)
        self.total_steps = max(1, schedule.epochs * len(training) // schedule.batch_windows)
        self.optimiser = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad],
                                           lr=schedule.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(self.optimiser, lambda step: self.rate(step))
        self.order = [i for _ in range(schedule.epochs) for i in rng.sample(range(len(training)), len(training))]
        # what a checkpoint must agree with to be carried on: the settings (the time budget aside) and the data
        self.identity = {"settings": asdict(schedule) | {"seconds": None}, "windows": len(training),
                         "tokens": sum(len(window[0]) for window in training)}
        self.sums: dict[str, float] = {}
        self.count = self.step = self.position = 0  # position: the first window of `order` not yet trained on
        self.earlier_seconds = 0.0  # what earlier runs of the same schedule spent
        self.start = time.perf_counter()

    def rate(self, step: int) -> float:  # linear warm-up, cosine decay
        if step < self.schedule.warmup_steps:
            return (step + 1) / self.schedule.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * min(1.0, step / self.total_steps)))

    def unfinished(self) -> bool:
        return self.position < len(self.order) and self.step < self.total_steps

    def seconds(self) -> float:
        return self.earlier_seconds + time.perf_counter() - self.start

    def resume(self) -> None:
        """Carry on from the checkpoint, if there is one."""
        if self.checkpoint is None or not self.checkpoint.exists():
            return
        state = torch.load(self.checkpoint, weights_only=False, map_location="cpu")  # the module's device next
        if state["identity"] != self.identity:
            raise UserError(f"{self.checkpoint} is from training with other settings or data; delete it to start "
                            "afresh, or run with the settings and data it was made with")
        self.module.load_state_dict(state["module"])
        self.optimiser.load_state_dict(state["optimiser"])
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.step, self.position = state["step"], state["position"]
        self.sums, self.count = state["sums"], state["count"]
        self.record.losses, self.record.tokens_seen = state["losses"], state["tokens_seen"]
        self.earlier_seconds = state["seconds"]

    def save(self) -> None:
        if self.checkpoint is None:
            raise ValueError("this run has no checkpoint to save to")
        temporary = self.checkpoint.with_suffix(".partial")
        torch.save({"identity": self.identity, "module": self.module.state_dict(),
                    "optimiser": self.optimiser.state_dict(), "lr_schedule": self.lr_schedule.state_dict(),
                    "torch_rng": torch.get_rng_state(), "step": self.step, "position": self.position,
                    "sums": self.sums, "count": self.count, "losses": self.record.losses,
                    "tokens_seen": self.record.tokens_seen, "seconds": self.seconds(),
                    **({"cuda_rng": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {})},
                   temporary)
        os.replace(temporary, self.checkpoint)  # a run killed while saving leaves the previous checkpoint whole

    def train_step(self, loss: LossFn, training: list[Window]) -> bool:
        """One optimiser step on the next batch of windows; False if none of them had anything to learn."""
        batch = self.order[self.position : self.position + self.schedule.batch_windows]
        self.position += len(batch)
        self.optimiser.zero_grad(set_to_none=True)
        with autocast(self.device):
            results = [loss(on_device(training[i], self.device)) for i in batch]
        parts = [p for p in results if p is not None]
        if not parts:
            return False
        totals = [p[0] for p in parts]
        (sum(totals[1:], totals[0]) / len(parts)).backward()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), 0.5)
        self.optimiser.step()
        self.lr_schedule.step()
        self.step += 1
        self.record.tokens_seen += sum(p[2] for p in parts)
        for name in parts[0][1]:
            self.sums[name] = self.sums.get(name, 0.0) + sum(float(p[1][name]) for p in parts) / len(parts)
        self.count += 1
        return True

    def log(self) -> str | None:
        """Every 20 steps: the losses' means since the last entry into the record, and as the bar shows them."""
        if self.step % 20:
            return None
        self.record.losses.append({"step": self.step, **{k: v / self.count for k, v in self.sums.items()},
                                   "seconds": round(self.seconds(), 1)})
        self.sums, self.count = {}, 0
        return " ".join(f"{k[:5]} {v:.3f}" for k, v in self.record.losses[-1].items() if k not in ("step", "seconds"))


def optimise(module: torch.nn.Module, loss: LossFn, training: list[Window], schedule: Schedule, record: TrainingRecord,
             label: str, progress: bool = True, checkpoint: Path | None = None,
             checkpoint_seconds: float = CHECKPOINT_SECONDS) -> None:
    """Train `module`'s parameters on `training` windows until the epochs or this run's time budget run out;
    with `checkpoint`, carry on from it if it exists, and save to it as the module docstring says."""
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    from specdecode.progress import Progress

    run = _Run(module, training, schedule, record, checkpoint)
    run.resume()
    module.train()
    run.start = last_saved = time.perf_counter()
    columns = [TextColumn(label), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("{task.fields[loss]}"), TimeElapsedColumn()]
    with Progress(*columns, disable=not progress) as bar, _stop_between_steps(checkpoint is not None) as stopping:
        task = bar.add_task("train", total=run.total_steps, completed=run.step, loss="")
        while run.unfinished() and time.perf_counter() - run.start <= schedule.seconds and not stopping():
            if not run.train_step(loss, training):
                continue
            shown = run.log()
            if shown is not None:
                bar.update(task, loss=shown)
            bar.update(task, completed=run.step)
            if checkpoint is not None and time.perf_counter() - last_saved > checkpoint_seconds:
                run.save()
                last_saved = time.perf_counter()
    if checkpoint is not None:
        if run.unfinished():
            run.save()  # the time budget ran out, or Ctrl-C: the next run carries on
        else:
            checkpoint.unlink(missing_ok=True)
        if stopping():
            console.print(f"[yellow]interrupted at step {run.step}: saved in {checkpoint}; the same command "
                          "carries on from there[/]", highlight=False)
            raise KeyboardInterrupt
    module.eval()
    record.steps, record.seconds = run.step, round(run.seconds(), 1)


@contextlib.contextmanager
def _stop_between_steps(wanted: bool) -> Iterator[Callable[[], bool]]:
    """Ctrl-C (or `kill`) while training asks the run to stop at its step's end, where the checkpoint it then
    saves is whole (a step cut in its middle would leave the weights and the optimiser's state apart); a second
    one stops at once. Only where there is a checkpoint to save (`wanted`), in the main thread (signals)."""
    if not wanted or threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    asked = threading.Event()

    def ask(signum, frame) -> None:
        if asked.is_set():
            raise KeyboardInterrupt
        asked.set()
        console.print("[yellow]stopping at this step's end to save where training is (again: stop at once)[/]")

    previous = {number: signal.signal(number, ask) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield asked.is_set
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
