"""The static path's step inputs (`models.static.pack`, read on the device by `unpack`): the slots, positions and mask
[w, capacity] a forward of n new tokens padded to w attends with must be the ones `CausalLM.forward` describes, for any
tree mask over the last m tokens (cached or new): a dense mask built here from that description is the reference.
Verification always feeds a pending token first, which every node sees; a tree fed without one (siblings first) is
covered too, as a drafter's forward may be."""

from __future__ import annotations

import pytest
import torch

from specdecode.models.hf import HFCausalLM
from specdecode.models.static import BACK, StaticCausalLM, pack, unpack


def dense(start: int, n: int, width: int, tree_mask: torch.Tensor | None, capacity: int) -> torch.Tensor:
    """[w, capacity]: the slots before the last m tokens seen by all; the last m as `tree_mask` says (causal where
    None); a pad (row n or later) sees only those before and itself; nothing past."""
    m = n if tree_mask is None else tree_mask.shape[1]
    allowed = torch.zeros(width, capacity, dtype=torch.bool)
    allowed[:, : start + n - m] = True
    allowed[:n, start + n - m : start + n] = torch.ones(n, n).tril().bool() if tree_mask is None else tree_mask
    for pad in range(n, width):
        allowed[pad, start + pad] = True
    return allowed


def random_tree_mask(n: int, pending: int, generator: torch.Generator) -> torch.Tensor:
    """[n, pending + n]: each new token sees the pending tokens it is given and a random path of earlier new tokens
    (parents before children), itself included."""
    mask = torch.zeros(n, pending + n, dtype=torch.bool)
    mask[:, :pending] = torch.rand(n, pending, generator=generator) < 0.7
    for i in range(n):
        parent = int(torch.randint(-1, i, (1,), generator=generator)) if i else -1
        if parent >= 0:
            mask[i, pending:] = mask[parent, pending:]
        mask[i, pending + i] = True
    return mask


@pytest.mark.parametrize("start", [0, 3, 10, BACK + 5])
def test_the_unpacked_mask_positions_and_slots_are_the_forwards_description(start):
    generator = torch.Generator().manual_seed(start)
    capacity = start + 16 + BACK
    columns = torch.arange(capacity)
    for n in range(1, 6):
        for width in (n, 8):
            for pending in range(0, min(start, 2) + 1):  # (0: siblings first, no pending token)
                for tree_mask in (None, random_tree_mask(n, pending, generator)):
                    if tree_mask is None and pending:
                        continue
                    positions = None if tree_mask is None else start + tree_mask[:, pending:].sum(-1) - 1  # depths
                    slots, got_positions, mask = unpack(pack(start, n, width, positions, tree_mask), width, columns)
                    assert slots.tolist() == list(range(start, start + width))
                    want = list(range(start, start + width)) if positions is None else \
                        positions.tolist() + list(range(start + n, start + width))
                    assert got_positions.tolist() == want
                    assert torch.equal(mask, dense(start, n, width, tree_mask, capacity)), (n, width, pending)

def test_a_static_cache_that_doubles_keeps_what_it_held(tiny_target):
    """Past its first capacity the static cache doubles; the sequence it held must survive the move: greedy
    tokens and logits stay the dynamic path's (no test grows a static cache otherwise: every one allocates 256+)."""
    static = StaticCausalLM(tiny_target, capacity=16)  # 16 + 64 slots: the 18th token's forward doubles it
    dynamic = HFCausalLM(tiny_target)
    prompt = torch.arange(1, 11)
    ours, theirs = static.forward(prompt, num_logits=1).logits, dynamic.forward(prompt, num_logits=1).logits
    for _ in range(30):
        token = theirs.argmax(-1)
        assert torch.equal(ours.argmax(-1), token)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        ours, theirs = static.forward(token.view(1)).logits, dynamic.forward(token.view(1)).logits
    assert static.decoder.capacity > 80  # it did double
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
