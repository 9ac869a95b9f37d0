"""Training an EAGLE-3 head (`drafters.eagle3`) on stored target features with layer inputs
(`training.features`, `layers=`), with training-time test.

For a window of tokens x_0..x_{n-1}, the target's layer inputs a_t and final hidden states f_t, the head
is unrolled for `steps` draft steps over rows t = 0..m-1 at once:
- step 0 reads the pairs (fc(a_t), x_{t+1}) at positions t, as when it reads the context;
- step j reads (o^{j-1}_t, x_{t+j+1}) at position t + j: its own previous output, as when it drafts, and
  attends to step 0's keys up to row t (the real context up to t) and to its own earlier steps' keys of
  row t alone (the draft path above it), the attention a draft at depth j + 1 sees;
- step j's draft distribution is trained towards the target's own after x_{t+j+1} (its LM head on
  f_{t+j+1}, over the draft vocabulary), a cross-entropy weighted STEP_DECAY^j; only rows whose
  predicted token x_{t+j+2} is an assistant token count.
So the head learns to draft on its own imperfect outputs, which is what it does at inference. The tokens
fed are the data's; with the target's own answers as data (`specdecode train data`), they are what the
target would have said.

Held-out agreement by draft position k: the same unroll on held-out windows, draft k's most likely token
against the target's most likely token there (k = 1 is the head reading the real context).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.drafters.eagle3_head import Eagle3Config, Eagle3Head, unroll
from specdecode.errors import UserError
from specdecode.training.features import Shard
from specdecode.training.loop import (
    Schedule, TrainingRecord, Window, frequent_tokens, on_device, optimise, split, windows,
)

STEP_DECAY = 0.8  # weight of draft step j's loss: STEP_DECAY ** j


@dataclass
class TrainingSettings(Schedule):
    intermediate_size: int = 2048
    vocab_size: int = 16_384  # the draft vocabulary: the most frequent tokens of the target's answers
    sequence_tokens: int = 512
    steps: int = 3  # draft steps unrolled in training (training-time test)
    eval_positions: int = 4


def losses(head, embed, draft_head: torch.Tensor, window: Window, steps: int):
    """(total, {step_k: cross-entropy}, positions) of one window (on the head's device), or None when it has no
    assistant row."""
    tokens, hidden, assistant, aux = window
    m = len(tokens) - steps - 1
    # step j's row t predicts x_{t+j+2}: it counts if that is an assistant token, and its teacher is the
    # target's distribution after x_{t+j+1} (teacher row t + j, the same for every step that reaches it)
    counted = assistant[2 : steps + m + 1].nonzero().squeeze(-1)
    rows = [counted[(counted >= step) & (counted < step + m)] for step in range(steps)]
    if any(len(r) == 0 for r in rows):  # decided before the unroll: a prompt's window costs nothing
        return None
    with torch.no_grad():  # only the counted rows' distributions: logits elsewhere would be thrown away
        teachers = torch.zeros(steps + m - 1, draft_head.shape[0], device=draft_head.device)
        # .float(): under bfloat16 autocast the product, and its softmax, come out in bfloat16
        teachers[counted] = torch.softmax(hidden[1 + counted].float() @ draft_head.T, dim=-1).float()
    weighted: list[torch.Tensor] = []  # each step's loss, decayed
    parts = {}
    for step, (out, r) in enumerate(zip(unroll(head, embed, tokens, aux, steps), rows)):
        student = torch.log_softmax(head.logits(out[r - step], draft_head).float(), dim=-1)
        loss = -(teachers[r] * student).sum(-1).mean()
        weighted.append(STEP_DECAY**step * loss)
        parts[f"step{step + 1}"] = loss.detach()
    return sum(weighted[1:], weighted[0]), parts, len(rows[-1])  # steps >= 1


@torch.no_grad()
def held_out_agreement(head, embed, draft_head, full_head, data: list[Window], positions: int) -> list[float]:
    """By draft position: how often the head's most likely token is the target's most likely token."""
    hits, totals = [0] * positions, [0] * positions
    draft_ids = head.draft_ids
    for window in data:
        if len(window[0]) < positions + 8:
            continue
        tokens, hidden, assistant, aux = on_device(window, draft_head.device)
        m = len(tokens) - positions - 1
        targets = (hidden[1 : positions + m].float() @ full_head.T).argmax(-1)  # once for every position
        for step, out in enumerate(unroll(head, embed, tokens, aux, positions)):
            rows = assistant[step + 2 : step + 2 + m]
            drafted = draft_ids[head.logits(out, draft_head).argmax(-1)]
            wanted = targets[step : step + m]
            hits[step] += int(((drafted == wanted) & rows).sum())
            totals[step] += int(rows.sum())
    return [h / n if n else float("nan") for h, n in zip(hits, totals)]


def check_init(init: Eagle3Head, target_config, layers) -> None:
    """A one-line UserError unless the head to start from (`--init`) is of this target's shape and reads `layers`:
    checked as the target loads, before any feature is extracted."""
    config = Eagle3Config.for_target(target_config, init.config.intermediate_size, init.config.draft_vocab_size)
    config.aux_layers = tuple(layers)
    differ = [f"{name} {getattr(init.config, name)} (this target: {getattr(config, name)})"
              for name in vars(config) if getattr(init.config, name) != getattr(config, name)]
    if differ:
        raise UserError(f"the head to start from was made for another target or other layers: {', '.join(differ)}")


def train(target_model, shards: list[Shard], settings: TrainingSettings, layers: tuple[int, ...],
          progress: bool = True, log=print, checkpoint: Path | None = None,
          init: Eagle3Head | None = None) -> tuple[Eagle3Head, TrainingRecord]:
    """Train an EAGLE-3 head for `target_model` (a transformers causal LM) on its stored features, whose
    layer inputs are those of `layers`, on the target's device (carrying on from `checkpoint` where it exists:
    `loop.optimise`);
    from `init`'s weights and draft vocabulary when given (a head trained before, carried on to more data;
    its MLP width and vocabulary size replace the settings')."""
    from specdecode.models.hf import _eos_ids

    if settings.steps < 1:
        raise UserError(f"training-time test needs at least one draft step, got {settings.steps}")
    torch.manual_seed(settings.seed)
    device = target_model.device
    table = target_model.get_input_embeddings().weight.detach().float()

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table)

    full_head = target_model.get_output_embeddings().weight.detach().float()
    if init is not None:
        settings = replace(settings, intermediate_size=init.config.intermediate_size,
                           vocab_size=init.config.draft_vocab_size)
        vocab_ids = init.draft_ids.clone()
    else:
        vocab_ids = frequent_tokens(shards, settings.vocab_size, sorted(_eos_ids(target_model)))
    draft_head = full_head[vocab_ids.to(device)]
    config = Eagle3Config.for_target(target_model.config, settings.intermediate_size, len(vocab_ids))
    config.aux_layers = tuple(layers)
    head = Eagle3Head(config, vocab_ids).float().to(device)
    if init is not None:
        check_init(init, target_model.config, layers)
        head.load_state_dict(init.state_dict())
    training, evaluation = split(windows(shards, settings.sequence_tokens, settings.steps + 8, aux=True), settings.seed)
    record = TrainingRecord(settings=vars(settings) | {"vocab": len(vocab_ids), "aux_layers": list(layers),
                                               "train_windows": len(training), "held_out_windows": len(evaluation)})
    optimise(head, lambda window: losses(head, embed, draft_head, window, settings.steps), training, settings,
             record, "training EAGLE-3", progress, checkpoint)
    log(f"measuring held-out agreement on {len(evaluation)} windows")
    record.held_out_accuracy = held_out_agreement(head, embed, draft_head, full_head, evaluation,
                                                  settings.eval_positions)
    log(f"EAGLE-3 head: {record.steps} steps, {record.tokens_seen} tokens, {record.seconds:.0f} s; held-out "
        f"agreement by draft position: {', '.join(f'{a:.2f}' for a in record.held_out_accuracy)}")
    return head, record


def save(head: Eagle3Head, record: TrainingRecord, out: Path, describe: dict) -> None:
    head.save(out, {"record": vars(record), **describe})
