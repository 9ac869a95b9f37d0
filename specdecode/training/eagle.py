"""Training an EAGLE head on stored target features (`training.features`), on the target's device.

For a sequence with features f_0..f_{n-1} and tokens x_0..x_{n-1}, the head reads the pairs
(f_t, x_{t+1}) for t = 0..n-3 and predicts f_{t+1}. Two losses, as the paper: a smooth-L1 regression of
the feature, and the cross-entropy of the draft distribution (the LM head over the truncated vocabulary
applied to the prediction) against the target's own (the same head applied to the true f_{t+1}: self-
distillation, nothing generated), weighted 0.1. Only positions whose predicted token belongs to an
assistant turn count. Input features get uniform noise (the paper's data augmentation: drafting feeds
the head its own imperfect predictions). Matmuls run in bfloat16 autocast with float32 weights where the
device has bf16 units (`loop.autocast`).

Held-out accuracy per draft position k (1 = the first draft token): the head drafts k tokens on its own
features from a context position, fed the text's actual next tokens, and its k-th token is compared
with the target's most likely token there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.drafters.eagle_head import EagleHead, head_config
from specdecode.training.features import Shard
from specdecode.training.loop import (
    Schedule, TrainingRecord, autocast, frequent_tokens, on_device, optimise, split, windows,
)

NOISE = 0.2  # uniform noise on the input features, +-NOISE/2 (relative to their RMS of about 1)
CLASSIFICATION_WEIGHT = 0.1


@dataclass
class TrainingSettings(Schedule):
    intermediate_size: int = 2048
    vocab_size: int = 32_768  # the truncated draft vocabulary: the most frequent tokens
    sequence_tokens: int = 512  # sequences are cut into windows of this many tokens
    eval_positions: int = 4


def losses(head: EagleHead, embed, head_weight: torch.Tensor, tokens, features, assistant, noise: float):
    """(regression, classification, positions) of one window (on the head's device)."""
    f = features.float()
    inputs = f[:-2]
    if noise:
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * noise
    n = inputs.shape[0]
    embeddings = embed(tokens[1:-1]).float()
    predicted = head(inputs[None], embeddings[None], torch.arange(n, device=f.device)[None])[0].float()  # f^_{t+1}
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
    rng, device = random.Random(1), head_weight.device
    for window in data:
        tokens, features, _ = on_device(window, device)
        assistant = window[2].tolist()  # host data: which positions to start from
        f = features.float()
        candidates = [t for t in range(4, len(tokens) - positions - 1) if assistant[t + 1]]
        for t in rng.sample(candidates, min(starts, len(candidates))):
            cache = DynamicCache(config=head.config)
            # pairs (f_s, x_{s+1}), s < t: the last prediction is f^_t, the first draft's feature
            feature = head(f[None, :t], embed(tokens[1 : t + 1]).float()[None], torch.arange(t, device=device)[None],
                           cache=cache)[0, -1]
            for k in range(positions):
                drafted = int(head.vocab_ids[(feature.float() @ head_weight.T).argmax()])
                wanted = int((f[t + k] @ full_head.T).argmax())  # the target's choice after position t + k
                hits[k] += drafted == wanted
                totals[k] += 1
                feature = head(feature.float()[None, None], embed(tokens[t + k + 1 : t + k + 2]).float()[None],
                               torch.full((1, 1), t + k, device=device), cache=cache)[0, 0]
    return [h / n if n else float("nan") for h, n in zip(hits, totals)]


def train(target_model, shards: list[Shard], settings: TrainingSettings, progress: bool = True,
          log=print, checkpoint: Path | None = None) -> tuple[EagleHead, TrainingRecord]:
    """Train a head for `target_model` (a transformers causal LM) on its stored features, on the target's
    device (carrying on from `checkpoint` where it exists: `loop.optimise`)."""
    torch.manual_seed(settings.seed)
    device = target_model.device
    table = target_model.get_input_embeddings().weight.detach()  # frozen: the target's own

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table)

    full_head = target_model.get_output_embeddings().weight.detach().float()
    from specdecode.models.hf import _eos_ids

    vocab_ids = frequent_tokens(shards, settings.vocab_size, sorted(_eos_ids(target_model)))
    head_weight = full_head[vocab_ids.to(device)]
    head = EagleHead(head_config(target_model.config, settings.intermediate_size), vocab_ids).float().to(device)
    training, evaluation = split(windows(shards, settings.sequence_tokens), settings.seed)
    record = TrainingRecord(settings=vars(settings) | {"vocab": len(vocab_ids), "train_windows": len(training),
                                               "held_out_windows": len(evaluation)})

    def loss(window):
        tokens, features, assistant = window
        parts = losses(head, embed, head_weight, tokens, features, assistant, NOISE)
        if parts is None:
            return None
        regression, classification, positions = parts
        return (regression + CLASSIFICATION_WEIGHT * classification,
                {"regression": regression.detach(), "classification": classification.detach()}, positions)

    optimise(head, loss, training, settings, record, "training EAGLE", progress, checkpoint)
    with autocast(device):  # as in training (`loop.optimise`)
        record.held_out_accuracy = held_out_accuracy(head, embed, head_weight, full_head, evaluation,
                                                     settings.eval_positions)
    log(f"EAGLE head: {record.steps} steps, {record.tokens_seen} tokens, {record.seconds:.0f} s; held-out accuracy "
        f"by draft position: {', '.join(f'{a:.2f}' for a in record.held_out_accuracy)}")
    return head, record


def save(head: EagleHead, record: TrainingRecord, out: Path, describe: dict) -> None:
    head.save(out, {"record": vars(record), **describe})
