"""Training Medusa heads on stored target features (`training.features`), on the target's device.

Head k (1..K) reads the target's feature f_t and should give the distribution the target itself gives
k positions later, softmax(LM(f_{t+k})), that of token t + 1 + k: self-distillation on teacher-forced
text, nothing generated. The loss is the cross-entropy of each head's distribution (over the draft
vocabulary) against the target's, weighted 0.8^(k-1) as in the paper (later heads are less often
reached and harder), counted at positions whose predicted token belongs to an assistant turn. The
target's LM head is frozen; only the residual blocks learn.

Held-out accuracy by head k: how often head k's top token on f_t is the target's most likely token
after position t + k (over the full vocabulary, so a token outside the draft vocabulary counts as a
miss).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.drafters.medusa import MedusaHeads
from specdecode.training.features import Shard
from specdecode.training.loop import (
    Schedule, TrainingRecord, autocast, frequent_tokens, on_device, optimise, split, windows,
)

DECAY = 0.8  # head k's loss weight is DECAY ** (k - 1)


@dataclass
class TrainingSettings(Schedule):
    num_heads: int = 4
    vocab_size: int = 32_768  # the truncated draft vocabulary: the most frequent tokens
    sequence_tokens: int = 512  # sequences are cut into windows of this many tokens
    learning_rate: float = 1e-3


def losses(heads: MedusaHeads, head_weight: torch.Tensor, tokens, features, assistant):
    """(the weighted loss, each head's cross-entropy, positions) of one window (on the heads' device)."""
    f = features.float()
    n, K = f.shape[0], heads.num_heads
    with torch.no_grad():
        teacher = torch.softmax(f @ head_weight.T, dim=-1)  # [n, V'] the target's next-token distributions
    states = heads(f)  # [n, K, d]
    total, parts, positions = 0.0, {}, 0
    for k in range(1, K + 1):
        if n - k - 1 < 1:
            break
        mask = assistant[k + 1 :].float()  # position t counts when token t + 1 + k is the assistant's
        if mask.sum() == 0:
            continue
        student = torch.log_softmax(states[: n - k - 1, k - 1] @ head_weight.T, dim=-1)  # [n - k - 1, V']
        ce = (-(teacher[k : n - 1] * student).sum(-1) * mask).sum() / mask.sum()
        total = total + DECAY ** (k - 1) * ce
        parts[f"head{k}"] = ce.detach()
        positions += int(mask.sum()) if k == 1 else 0
    return (total, parts, positions) if parts else None


@torch.no_grad()
def held_out_accuracy(heads: MedusaHeads, vocab_ids, head_weight, full_head, data) -> list[float]:
    """Top-1 accuracy of each head (drafting over `vocab_ids`, whose LM-head rows are `head_weight`)
    against the target's own choice, over the held-out windows."""
    hits = [0] * heads.num_heads
    totals = [0] * heads.num_heads
    for window in data:
        tokens, features, assistant = on_device(window, head_weight.device)
        f = features.float()
        n = f.shape[0]
        states = heads(f)  # [n, K, d]
        wanted = (f @ full_head.T).argmax(-1)  # [n] the target's choice after each position
        for k in range(1, heads.num_heads + 1):
            if n - k - 1 < 1:
                continue
            drafted = vocab_ids[(states[: n - k - 1, k - 1] @ head_weight.T).argmax(-1)]
            mask = assistant[k + 1 :]
            hits[k - 1] += int(((drafted == wanted[k : n - 1]) & mask).sum())
            totals[k - 1] += int(mask.sum())
    return [h / t if t else float("nan") for h, t in zip(hits, totals)]


def train(target_model, shards: list[Shard], settings: TrainingSettings, progress: bool = True,
          log=print, checkpoint: Path | None = None) -> tuple[MedusaHeads, TrainingRecord]:
    """Train Medusa heads for `target_model` (a transformers causal LM) on its stored features, on the
    target's device (carrying on from `checkpoint` where it exists: `loop.optimise`)."""
    from specdecode.models.hf import _eos_ids

    torch.manual_seed(settings.seed)
    device = target_model.device
    full_head = target_model.get_output_embeddings().weight.detach().float()
    vocab_ids = frequent_tokens(shards, settings.vocab_size, sorted(_eos_ids(target_model))).to(device)
    head_weight = full_head[vocab_ids]
    heads = MedusaHeads(full_head.shape[1], settings.num_heads, vocab_ids).float().to(device)
    training, evaluation = split(windows(shards, settings.sequence_tokens), settings.seed)
    record = TrainingRecord(settings=vars(settings) | {"vocab": len(vocab_ids), "train_windows": len(training),
                                               "held_out_windows": len(evaluation)})
    optimise(heads, lambda window: losses(heads, head_weight, *window), training, settings, record,
             "training Medusa", progress, checkpoint)
    with autocast(device):  # as in training (`loop.optimise`)
        record.held_out_accuracy = held_out_accuracy(heads, vocab_ids, head_weight, full_head, evaluation)
        record.notes["held_out_accuracy_full_vocabulary"] = held_out_accuracy(
            heads, torch.arange(full_head.shape[0], device=device), full_head, full_head, evaluation)
    log(f"Medusa heads: {record.steps} steps, {record.tokens_seen} tokens, {record.seconds:.0f} s; held-out top-1 "
        f"by head: {', '.join(f'{a:.2f}' for a in record.held_out_accuracy)} (full vocabulary: "
        f"{', '.join(f'{a:.2f}' for a in record.notes['held_out_accuracy_full_vocabulary'])})")
    return heads, record


def save(heads: MedusaHeads, record: TrainingRecord, out: Path, describe: dict) -> None:
    heads.save(out, {"record": vars(record), **describe})
