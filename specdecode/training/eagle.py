"""Training an EAGLE head on stored target features (`training.features`), on the CPU.

For a sequence with features f_0..f_{n-1} and tokens x_0..x_{n-1}, the head reads the pairs
(f_t, x_{t+1}) for t = 0..n-3 and predicts f_{t+1}. Two losses, as the paper: a smooth-L1 regression of
the feature, and the cross-entropy of the draft distribution (the LM head over the truncated vocabulary
applied to the prediction) against the target's own (the same head applied to the true f_{t+1}: self-
distillation, nothing generated), weighted 0.1. Only positions whose predicted token belongs to an
assistant turn count. Input features get uniform noise (the paper's data augmentation: drafting feeds
the head its own imperfect predictions). Matmuls run in bfloat16 autocast with float32 weights.

Held-out accuracy per draft position k (1 = the first draft token): the head drafts k tokens on its own
features from a context position, fed the text's actual next tokens, and its k-th token is compared
with the target's most likely token there.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.drafters.eagle import EagleHead, head_config
from specdecode.training.features import Shard

NOISE = 0.2  # uniform noise on the input features, +-NOISE/2 (relative to their RMS of about 1)
CLASSIFICATION_WEIGHT = 0.1
HELD_OUT = 0.05  # share of sequences kept for evaluation


@dataclass
class TrainingSettings:
    intermediate_size: int = 2048
    vocab_size: int = 32_768  # the truncated draft vocabulary: the most frequent tokens
    seconds: float = 3600.0  # the time budget
    epochs: int = 4
    learning_rate: float = 3e-4
    warmup_steps: int = 50
    sequence_tokens: int = 512  # sequences are cut into windows of this many tokens
    batch_windows: int = 4  # windows per optimiser step
    seed: int = 0
    eval_positions: int = 4


@dataclass
class Record:
    settings: dict
    steps: int = 0
    tokens_seen: int = 0
    seconds: float = 0.0
    losses: list[dict] = field(default_factory=list)  # every 20 steps: step, regression, classification
    held_out_accuracy: list[float] = field(default_factory=list)  # by draft position, 1 first


def frequent_tokens(shards: list[Shard], size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent token ids of the data (assistant tokens counted), plus `always`, sorted."""
    counts = Counter()
    for shard in shards:
        counts.update(shard.tokens[shard.assistant].tolist())
    chosen = {token for token, _ in counts.most_common(size)} | set(always)
    return torch.tensor(sorted(chosen)[: max(size, len(always))], dtype=torch.long)


def windows(shards: list[Shard], length: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(tokens, features, assistant) windows of at most `length` tokens, sequences cut where needed."""
    out = []
    for shard in shards:
        for tokens, hidden, assistant in shard.sequences():
            for begin in range(0, len(tokens) - 2, length):
                end = min(begin + length, len(tokens))
                if end - begin >= 8:
                    out.append((tokens[begin:end], hidden[begin:end], assistant[begin:end]))
    return out


def losses(head: EagleHead, embed, head_weight: torch.Tensor, tokens, features, assistant, noise: float):
    """(regression, classification, positions) of one window."""
    f = features.float()
    inputs = f[:-2]
    if noise:
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * noise
    n = inputs.shape[0]
    embeddings = embed(tokens[1:-1]).float()
    predicted = head(inputs[None], embeddings[None], torch.arange(n)[None])[0].float()  # f^_{t+1}
    truth = f[1:-1]
    mask = assistant[2:].float()
    if mask.sum() == 0:
        return None
    regression = (F.smooth_l1_loss(predicted, truth, reduction="none").mean(-1) * mask).sum() / mask.sum()
    with torch.no_grad():
        teacher = torch.softmax(truth @ head_weight.T, dim=-1)
    student = torch.log_softmax(predicted @ head_weight.T, dim=-1)
    classification = (-(teacher * student).sum(-1) * mask).sum() / mask.sum()
    return regression, classification, int(mask.sum())


@torch.no_grad()
def held_out_accuracy(head: EagleHead, embed, head_weight, full_head, data, positions: int, starts: int = 4):
    """Accuracy by draft position. From a few positions t of each held-out window: the head reads the
    real pairs up to t (its cache, as when drafting), then drafts `positions` tokens on its own features,
    fed the text's tokens; draft k is right when it is the target's most likely token there."""
    from transformers import DynamicCache

    hits, totals = [0] * positions, [0] * positions
    rng = random.Random(1)
    for tokens, features, assistant in data:
        f = features.float()
        candidates = [t for t in range(4, len(tokens) - positions - 1) if assistant[t + 1]]
        for t in rng.sample(candidates, min(starts, len(candidates))):
            cache = DynamicCache(config=head.config)
            # pairs (f_s, x_{s+1}), s < t: the last prediction is f^_t, the first draft's feature
            feature = head(f[None, :t], embed(tokens[1 : t + 1]).float()[None], torch.arange(t)[None], cache=cache)[0, -1]
            for k in range(positions):
                drafted = int(head.vocab_ids[(feature.float() @ head_weight.T).argmax()])
                wanted = int((f[t + k] @ full_head.T).argmax())  # the target's choice after position t + k
                hits[k] += drafted == wanted
                totals[k] += 1
                feature = head(feature.float()[None, None], embed(tokens[t + k + 1 : t + k + 2]).float()[None],
                               torch.tensor([[t + k]]), cache=cache)[0, 0]
    return [h / n if n else float("nan") for h, n in zip(hits, totals)]


def train(target_model, shards: list[Shard], settings: TrainingSettings, progress: bool = True,
          log=print) -> tuple[EagleHead, Record]:
    """Train a head for `target_model` (a transformers causal LM) on its stored features."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    table = target_model.get_input_embeddings().weight.detach()  # frozen: the target's own

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table)

    full_head = target_model.get_output_embeddings().weight.detach().float()
    from specdecode.models.hf import _eos_ids

    vocab_ids = frequent_tokens(shards, settings.vocab_size, sorted(_eos_ids(target_model)))
    head_weight = full_head[vocab_ids]
    head = EagleHead(head_config(target_model.config, settings.intermediate_size), vocab_ids).float().train()
    data = windows(shards, settings.sequence_tokens)
    rng.shuffle(data)
    held = max(1, int(len(data) * HELD_OUT))
    evaluation, training = data[:held], data[held:]
    total_steps = max(1, settings.epochs * len(training) // settings.batch_windows)
    optimiser = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=settings.learning_rate,
                                  betas=(0.9, 0.95), weight_decay=0.0)

    def rate(step: int) -> float:  # linear warm-up, cosine decay
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * min(1.0, step / total_steps)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, rate)
    record = Record(settings=vars(settings) | {"vocab": len(vocab_ids), "train_windows": len(training),
                                               "held_out_windows": len(evaluation)})
    start = time.perf_counter()
    columns = [TextColumn("training EAGLE"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("{task.fields[loss]}"), TimeElapsedColumn()]
    running = [0.0, 0.0, 0]
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("train", total=total_steps, loss="")
        step = 0
        order = [i for _ in range(settings.epochs) for i in rng.sample(range(len(training)), len(training))]
        for first in range(0, len(order), settings.batch_windows):
            if time.perf_counter() - start > settings.seconds or step >= total_steps:
                break
            optimiser.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                parts = [losses(head, embed, head_weight, *training[i], NOISE) for i in order[first : first + settings.batch_windows]]
            parts = [p for p in parts if p is not None]
            if not parts:
                continue
            regression = sum(p[0] for p in parts) / len(parts)
            classification = sum(p[1] for p in parts) / len(parts)
            (regression + CLASSIFICATION_WEIGHT * classification).backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            optimiser.step()
            schedule.step()
            step += 1
            record.tokens_seen += sum(p[2] for p in parts)
            running = [running[0] + regression.item(), running[1] + classification.item(), running[2] + 1]
            if step % 20 == 0:
                record.losses.append({"step": step, "regression": running[0] / running[2],
                                      "classification": running[1] / running[2],
                                      "seconds": round(time.perf_counter() - start, 1)})
                running = [0.0, 0.0, 0]
                bar.update(task, loss=f"reg {record.losses[-1]['regression']:.3f} "
                                      f"ce {record.losses[-1]['classification']:.3f}")
            bar.update(task, completed=step)
    head.eval()
    record.steps, record.seconds = step, round(time.perf_counter() - start, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        record.held_out_accuracy = held_out_accuracy(head, embed, head_weight, full_head, evaluation,
                                                     settings.eval_positions)
    log(f"EAGLE head: {step} steps, {record.tokens_seen} tokens, {record.seconds:.0f} s; held-out accuracy by "
        f"draft position: {', '.join(f'{a:.2f}' for a in record.held_out_accuracy)}")
    return head, record


def save(head: EagleHead, record: Record, out: Path, describe: dict) -> None:
    head.save(out, {"record": vars(record), **describe})
