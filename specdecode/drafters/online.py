"""Online adaptation of an EAGLE-3 head (after Online Speculative Decoding, Liu et al. 2023): while it
serves, the head keeps learning from the text the target writes.

Every verification hands the drafter the target's features of the tokens it kept (`Drafter.needs`), and
the kept tokens are the target's own choices: that is the training data of `training.eagle3`, free. When
a sequence ends (the drafter begins the next one), `OnlineAdaptation.learn` takes its features and tokens,
keeps them in a replay buffer with the sequences before it, and makes a few optimiser steps of
training-time test, each on that sequence and one earlier one (so that the head does not forget what came
before), the target's tokens as the labels (under sampling, samples of the target's distribution: the
same loss in expectation); the drafting copy of the head is then rebuilt from the updated weights
(`heads.for_drafting`). The learning runs when the next sequence begins, in its time: on a CPU with no
idle core it is paid for in serving time (`benchmarks/online_adaptation.py` measures what it buys).

Lossless whatever it learns: the head only proposes. It learns from the text of the requests it served,
so a server keeps one per owner (the method `remembers`); nothing is written to disk. Off unless asked
for: the method `eagle3-online` (`eagle3-online-tree`).
"""

from __future__ import annotations

import copy
import random
from collections import deque

import torch
import torch.nn.functional as F

from specdecode import devices
from specdecode.devices import to_device
from specdecode.drafters.base import Drafter
from specdecode.drafters.eagle3 import build_eagle3
from specdecode.drafters.heads import lm_head_rows
from specdecode.drafters.eagle3_head import Eagle3Head, unroll

LEARNING_RATE = 1e-4
STEPS = 2  # optimiser steps after each sequence, each on it and one earlier sequence (replay)
UNROLL = 2  # draft steps of training-time test
REPLAY_TOKENS = 8192  # the newest sequences kept for replay, about this many tokens
MIN_TOKENS = 16  # a shorter sequence teaches nothing worth a step
# a finished sequence's last this many tokens are learnt from, as offline training cuts its windows
# (`training.eagle3.TrainingSettings.sequence_tokens`): a step's memory grew with the square of the whole sequence's
# length (the head's attention mask), several GiB at 8k tokens, outside any memory budget
LEARN_TOKENS = 512


class OnlineAdaptation:
    """The float32 head that learns (a copy of the one given) and its optimiser, on the target's device."""

    def __init__(self, head: Eagle3Head, target_model, learning_rate: float | None = None, steps: int | None = None,
                 unroll: int = UNROLL, replay_tokens: int = REPLAY_TOKENS):
        """`learning_rate` and `steps`: the module's LEARNING_RATE and STEPS unless given."""
        self.trained = head
        self.table = target_model.get_input_embeddings().weight.detach()  # [vocab, d], the target's own (no copy)
        self.device = self.table.device
        self.head = self._copy(head)
        self.learning_rate = LEARNING_RATE if learning_rate is None else learning_rate
        self.steps, self.unroll, self.replay_tokens = STEPS if steps is None else steps, unroll, replay_tokens
        self.optimiser = self._optimiser()
        self.lm_rows = lm_head_rows(target_model, self.head.draft_ids).float()  # [V', d]
        draft_index = torch.full((self.table.shape[0],), -1, dtype=torch.long, device=self.device)
        draft_index[self.head.draft_ids] = torch.arange(len(self.head.draft_ids), device=self.device)
        self.draft_index = draft_index  # target id -> draft id (-1: outside the draft vocabulary)
        self.replay: deque[tuple[torch.Tensor, torch.Tensor]] = deque()  # (tokens [n], features [n, k d])
        self.updates = 0  # optimiser steps made
        self.losses: list[float] = []  # the mean loss of each `learn`
        self._seconds = 0.0  # spent learning, as timed so far
        self._stopwatch = devices.stopwatch(self.device)  # (on CUDA events: learning's seconds come once done)
        self._rng = random.Random(0)

    def tensors(self) -> tuple:
        """What it holds: the learning head, its optimiser's state, the LM head's rows and the replay buffer."""
        return self.head, self.optimiser, self.lm_rows, self.replay

    def _copy(self, head: Eagle3Head) -> Eagle3Head:
        """A float32 copy of `head` on the target's device, to learn."""
        return copy.deepcopy(head).float().to(self.device)

    def _optimiser(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.head.parameters(), lr=self.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)

    def restart(self) -> bool:
        """Back to the trained head, nothing learnt (`forget`); True if it had learnt something."""
        changed = self.updates > 0
        self.head = self._copy(self.trained)
        self.optimiser = self._optimiser()
        self.replay.clear()
        self.updates, self.losses, self._seconds = 0, [], 0.0
        self._stopwatch = devices.stopwatch(self.device)  # (a timing still to come belongs to what was forgotten)
        return changed

    @property
    def seconds(self) -> float:
        """Seconds spent learning, timed without waiting for the device: the latest `learn` counts once the
        device has done it."""
        self._stopwatch.settle()
        return self._seconds

    def _learnt(self, seconds: float) -> None:
        self._seconds += seconds

    def learn(self, tokens: list[int], features: torch.Tensor) -> bool:
        """One finished sequence's tokens and the target's features at each ([n, k d]), of which its last
        LEARN_TOKENS are learnt from; True if the head changed (the caller rebuilds its drafting copy)."""
        n = min(len(tokens), features.shape[0])
        if n < MIN_TOKENS:
            return False
        first = max(0, n - LEARN_TOKENS)
        self.replay.append((to_device(tokens[first:n], self.device), features[first:n].float()))
        while sum(len(t) for t, _ in self.replay) > self.replay_tokens and len(self.replay) > 1:
            self.replay.popleft()
        start = self._stopwatch.mark()
        self.head.train()
        total = 0.0
        newest, earlier = self.replay[-1], list(self.replay)[:-1]
        for _ in range(self.steps):
            self.optimiser.zero_grad(set_to_none=True)
            batch = [newest] + ([self._rng.choice(earlier)] if earlier else [])
            losses = [loss for loss in (self._loss(tokens, features) for tokens, features in batch)
                      if loss is not None]
            if not losses:
                break
            loss = sum(losses[1:], losses[0]) / len(losses)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
            self.optimiser.step()
            self.updates += 1
            total += float(loss.detach())
        self.head.eval()
        self.losses.append(total / max(1, self.steps))
        self._stopwatch.measure(start, self._stopwatch.mark(), self._learnt)
        return True

    def _loss(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor | None:
        """Training-time test's cross-entropy against the tokens the target chose (`unroll`: draft step j
        at row t predicts token t + j + 2)."""
        if len(tokens) < self.unroll + 8:
            return None
        m = len(tokens) - self.unroll - 1
        outputs = unroll(self.head, lambda ids: F.embedding(ids, self.table).float(), tokens, features, self.unroll)
        total: torch.Tensor | None = None
        counted = 0
        for step, out in enumerate(outputs):
            labels = self.draft_index[tokens[step + 2 : step + 2 + m]]  # [m]
            keep = labels >= 0
            if keep.any():
                logits = self.head.logits(out[keep], self.lm_rows)
                loss = F.cross_entropy(logits, labels[keep], reduction="sum")
                total = loss if total is None else total + loss
                counted += int(keep.sum())
        return None if total is None else total / counted


def build_eagle3_online(target, draft, options) -> Drafter:
    """The `eagle3-online` method: `eagle3` whose head keeps learning from the text it drafts for."""
    return build_eagle3(target, draft, options, adapt=OnlineAdaptation)
