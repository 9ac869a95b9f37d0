"""What training any head on stored target features shares: the data windows, the draft vocabulary,
the held-out split, the record, and the optimisation loop (AdamW, warm-up then cosine decay, gradient
clipping, a time budget per run, checkpoints a later run resumes from, bfloat16 autocast over float32
weights where the CPU has bf16 units, a progress bar).

Training on a CPU takes hours, so it runs in bounded pieces: `optimise` saves where it is to a
checkpoint every CHECKPOINT_SECONDS and when its time budget runs out (the head's and the optimiser's
state, the learning-rate schedule, the step, the position in the shuffled windows (whose order the seed
fixes), torch's global generator (feature noise draws from it), the record so far), and a run given the
same checkpoint, settings and data carries on from there: a run cut into pieces, or killed and started
again, ends with the weights one uninterrupted run gives. The checkpoint is removed once the schedule is
complete."""

from __future__ import annotations

import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdecode.errors import UserError
from specdecode.models.precision import bf16_units
from specdecode.training.features import Shard

HELD_OUT = 0.05  # share of windows kept for evaluation
CHECKPOINT_SECONDS = 300.0  # how often a run saves where it is (and always when its time budget ends)

Window = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tokens [n], features [n, d], assistant [n]


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


def frequent_tokens(shards: list[Shard], size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent token ids of the data (assistant tokens counted), plus `always`, sorted."""
    counts = Counter()
    for shard in shards:
        counts.update(shard.tokens[shard.assistant].tolist())
    chosen = {token for token, _ in counts.most_common(size)} | set(always)
    return torch.tensor(sorted(chosen)[: max(size, len(always))], dtype=torch.long)


def windows(shards: list[Shard], length: int) -> list[Window]:
    """(tokens, features, assistant) windows of at most `length` tokens, sequences cut where needed."""
    out = []
    for shard in shards:
        for tokens, hidden, assistant in shard.sequences():
            for begin in range(0, len(tokens) - 2, length):
                end = min(begin + length, len(tokens))
                if end - begin >= 8:
                    out.append((tokens[begin:end], hidden[begin:end], assistant[begin:end]))
    return out


def split(data: list[Window], seed: int) -> tuple[list[Window], list[Window]]:
    """(training, held-out) windows, shuffled with `seed`."""
    data = list(data)
    random.Random(seed).shuffle(data)
    held = max(1, int(len(data) * HELD_OUT))
    return data[held:], data[:held]


# a window's losses: (the total to minimise, named parts to log, positions counted) or None (nothing to learn)
LossFn = Callable[[Window], "tuple[torch.Tensor, dict[str, torch.Tensor], int] | None"]


def optimise(module: torch.nn.Module, loss: LossFn, training: list[Window], schedule: Schedule, record: TrainingRecord,
             label: str, progress: bool = True, checkpoint: Path | None = None,
             checkpoint_seconds: float = CHECKPOINT_SECONDS) -> None:
    """Train `module`'s parameters on `training` windows until the epochs or this run's time budget run out;
    with `checkpoint`, carry on from it if it exists, and save to it as the module docstring says."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    rng = random.Random(schedule.seed)
    total_steps = max(1, schedule.epochs * len(training) // schedule.batch_windows)
    optimiser = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=schedule.learning_rate,
                                  betas=(0.9, 0.95), weight_decay=0.0)

    def rate(step: int) -> float:  # linear warm-up, cosine decay
        if step < schedule.warmup_steps:
            return (step + 1) / schedule.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * min(1.0, step / total_steps)))

    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, rate)
    order = [i for _ in range(schedule.epochs) for i in rng.sample(range(len(training)), len(training))]
    # what a checkpoint must agree with to be carried on: the settings (the time budget aside) and the data
    identity = {"settings": asdict(schedule) | {"seconds": None}, "windows": len(training),
                "tokens": sum(len(window[0]) for window in training)}
    sums: dict[str, float] = {}
    count = step = position = 0  # position: the first window of `order` not yet trained on

    def unfinished() -> bool:
        return position < len(order) and step < total_steps

    earlier_seconds = 0.0  # what earlier runs of the same schedule spent
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        if state["identity"] != identity:
            raise UserError(f"{checkpoint} is from training with other settings or data; delete it to start "
                            "afresh, or run with the settings and data it was made with")
        module.load_state_dict(state["module"])
        optimiser.load_state_dict(state["optimiser"])
        lr_schedule.load_state_dict(state["lr_schedule"])
        torch.set_rng_state(state["torch_rng"])
        step, position, sums, count = state["step"], state["position"], state["sums"], state["count"]
        record.losses, record.tokens_seen = state["losses"], state["tokens_seen"]
        earlier_seconds = state["seconds"]

    def save() -> None:
        temporary = checkpoint.with_suffix(".partial")
        torch.save({"identity": identity, "module": module.state_dict(), "optimiser": optimiser.state_dict(),
                    "lr_schedule": lr_schedule.state_dict(), "torch_rng": torch.get_rng_state(), "step": step,
                    "position": position, "sums": sums, "count": count, "losses": record.losses,
                    "tokens_seen": record.tokens_seen, "seconds": earlier_seconds + time.perf_counter() - start},
                   temporary)
        os.replace(temporary, checkpoint)  # a run killed while saving leaves the previous checkpoint whole

    bf16 = bf16_units()  # bfloat16 autocast only where the CPU has bf16 units: emulated, it is far slower
    module.train()
    start = last_saved = time.perf_counter()
    columns = [TextColumn(label), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("{task.fields[loss]}"), TimeElapsedColumn()]
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("train", total=total_steps, completed=step, loss="")
        while unfinished():
            if time.perf_counter() - start > schedule.seconds:
                break
            batch = order[position : position + schedule.batch_windows]
            position += len(batch)
            optimiser.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                parts = [loss(training[i]) for i in batch]
            parts = [p for p in parts if p is not None]
            if not parts:
                continue
            (sum(p[0] for p in parts) / len(parts)).backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
            optimiser.step()
            lr_schedule.step()
            step += 1
            record.tokens_seen += sum(p[2] for p in parts)
            for name in parts[0][1]:
                sums[name] = sums.get(name, 0.0) + sum(float(p[1][name]) for p in parts) / len(parts)
            count += 1
            if step % 20 == 0:
                record.losses.append({"step": step, **{k: v / count for k, v in sums.items()},
                                      "seconds": round(earlier_seconds + time.perf_counter() - start, 1)})
                sums, count = {}, 0
                bar.update(task, loss=" ".join(f"{k[:5]} {v:.3f}" for k, v in record.losses[-1].items()
                                               if k not in ("step", "seconds")))
            bar.update(task, completed=step)
            if checkpoint is not None and time.perf_counter() - last_saved > checkpoint_seconds:
                save()
                last_saved = time.perf_counter()
    if checkpoint is not None:
        if unfinished():
            save()  # the time budget ran out: the next run carries on
        else:
            checkpoint.unlink(missing_ok=True)
    module.eval()
    record.steps, record.seconds = step, round(earlier_seconds + time.perf_counter() - start, 1)
