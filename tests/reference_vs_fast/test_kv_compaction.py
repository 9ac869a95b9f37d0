"""The backend's KV cache after a token tree, on a tiny float32 Qwen2: compacting the cache to an
accepted path leaves it exactly as a fresh prefill of context + path would, and a tree can be fed in
several forwards with a mask over nodes cached by an earlier one. Reference: plain sequential decoding.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.models.hf import HFCausalLM
from specdecode.tree import structure

CONTEXT = [3, 14, 15, 92, 65, 35, 89, 79]
NEXT = [23, 84]  # tokens fed after the compaction

# The tree (node: token):
#
#   context
#   ├── 0: 7 ── 3: 11
#   ├── 1: 8 ── 4: 12
#   └── 2: 9 ─┬── 5: 13 ── 7: 15
#             └── 6: 14
PARENTS = torch.tensor([-1, -1, -1, 0, 1, 2, 2, 5])
TOKENS = torch.tensor([7, 8, 9, 11, 12, 13, 14, 15])
PATHS = [[], [0], [0, 3], [1, 4], [2], [2, 5], [2, 6], [2, 5, 7]]  # root-to-node paths; [2, 5] skips nodes


def fresh(model, tokens: list[int]) -> HFCausalLM:
    lm = HFCausalLM(model)
    lm.forward(torch.tensor(tokens))
    return lm


def verify_tree_forward(model) -> tuple[HFCausalLM, torch.Tensor]:
    """What the engine does: the context's last token is pending, fed together with the tree."""
    lm = fresh(model, CONTEXT[:-1])
    positions, mask = structure.verification_inputs(PARENTS, num_pending=1, context_length=len(CONTEXT))
    tokens = torch.cat([torch.tensor(CONTEXT[-1:]), TOKENS])
    logits = lm.forward(tokens, positions=positions, tree_mask=mask).logits  # [1 + n, vocab]
    assert lm.cache_length == len(CONTEXT) + len(PARENTS)
    return lm, logits


def test_tree_logits_are_the_sequential_logits(tiny_target):
    """Row 0 is the distribution after the context, row i + 1 after node i's path (the convention the
    verifiers rely on)."""
    _, logits = verify_tree_forward(tiny_target)
    reference = HFCausalLM(tiny_target).forward(torch.tensor(CONTEXT)).logits[-1]
    torch.testing.assert_close(logits[0], reference, atol=1e-5, rtol=1e-5)
    for path in PATHS[1:]:
        tokens = CONTEXT + TOKENS[path].tolist()
        reference = HFCausalLM(tiny_target).forward(torch.tensor(tokens)).logits[-1]
        torch.testing.assert_close(logits[path[-1] + 1], reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "path" + "_".join(map(str, p)))
def test_compacted_cache_continues_like_a_fresh_prefill(tiny_target, path):
    lm, _ = verify_tree_forward(tiny_target)
    lm.compact(len(CONTEXT), path)
    accepted = CONTEXT + TOKENS[path].tolist()
    assert lm.cache_length == len(accepted)
    assert all(layer.keys.shape[-2] == len(accepted) for layer in lm._cache.layers)
    reference = fresh(tiny_target, accepted)
    got = lm.forward(torch.tensor(NEXT)).logits
    want = reference.forward(torch.tensor(NEXT)).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert lm.cache_length == reference.cache_length == len(accepted) + len(NEXT)


def test_a_second_tree_after_compaction(tiny_target):
    """Compact to [2, 5], then verify another tree on top of the compacted cache: its logits are the
    sequential ones after context + 9 13 + the new path."""
    lm, logits = verify_tree_forward(tiny_target)
    lm.compact(len(CONTEXT), [2, 5])
    bonus = int(logits[5 + 1].argmax())  # the token emitted after node 5, pending for the next step
    context = CONTEXT + [9, 13, bonus]
    parents = torch.tensor([-1, -1, 0])
    tokens = torch.tensor([40, 41, 42])
    positions, mask = structure.verification_inputs(parents, num_pending=1, context_length=len(context))
    second = lm.forward(torch.cat([torch.tensor([bonus]), tokens]), positions=positions, tree_mask=mask).logits
    for node, path_tokens in {0: [40], 1: [41], 2: [40, 42]}.items():
        want = HFCausalLM(tiny_target).forward(torch.tensor(context + path_tokens)).logits[-1]
        torch.testing.assert_close(second[node + 1], want, atol=1e-5, rtol=1e-5)


def test_compact_to_a_prefix_of_node_order_is_a_crop(tiny_target):
    # a chain tree: the accepted path 0, 1, ..., m - 1 is the first m nodes
    chain = structure.chain(4)
    tokens = torch.tensor([CONTEXT[-1], 50, 51, 52, 53])
    positions, mask = structure.verification_inputs(chain, num_pending=1, context_length=len(CONTEXT))
    for m in range(5):
        compacted, cropped = fresh(tiny_target, CONTEXT[:-1]), fresh(tiny_target, CONTEXT[:-1])
        for lm in (compacted, cropped):
            lm.forward(tokens, positions=positions, tree_mask=mask)
        compacted.compact(len(CONTEXT), list(range(m)))
        cropped.crop(len(CONTEXT) + m)
        assert compacted.cache_length == cropped.cache_length == len(CONTEXT) + m
        for a, b in zip(compacted._cache.layers, cropped._cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        after_compact = compacted.forward(torch.tensor(NEXT)).logits
        after_crop = cropped.forward(torch.tensor(NEXT)).logits
        assert torch.equal(after_compact, after_crop)


def test_tree_fed_in_two_forwards_with_a_mask_over_cached_nodes(tiny_target):
    """Depth-1 nodes in one forward, depth-2 nodes in the next with a [n, m] mask, m > n, that reaches
    back over the depth-1 nodes already in the cache.

        context
        ├── a: 7 ─┬── b: 11
        │         └── e: 13
        └── c: 8 ─── d: 12
    """
    lm = fresh(tiny_target, CONTEXT)
    length = len(CONTEXT)
    first = lm.forward(torch.tensor([7, 8]), positions=torch.tensor([length, length]),
                       tree_mask=torch.eye(2, dtype=torch.bool)).logits  # a, c
    mask = torch.tensor([
        # a  c  b  d  e    (the last 5 tokens: 2 cached, 3 new)
        [1, 0, 1, 0, 0],  # b
        [0, 1, 0, 1, 0],  # d
        [1, 0, 0, 0, 1],  # e
    ], dtype=torch.bool)
    second = lm.forward(torch.tensor([11, 12, 13]), positions=torch.full((3,), length + 1), tree_mask=mask).logits
    assert lm.cache_length == length + 5
    expected = {
        (7,): first[0], (8,): first[1], (7, 11): second[0], (8, 12): second[1], (7, 13): second[2],
    }
    for path, got in expected.items():
        want = HFCausalLM(tiny_target).forward(torch.tensor(CONTEXT + list(path))).logits[-1]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tree_mask_wider_than_cache_and_input_is_rejected(tiny_target):
    lm = fresh(tiny_target, CONTEXT[:2])
    with pytest.raises(ValueError):
        lm.forward(torch.tensor([7]), positions=torch.tensor([2]), tree_mask=torch.ones(1, 4, dtype=torch.bool))
