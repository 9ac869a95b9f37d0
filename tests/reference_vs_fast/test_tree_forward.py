"""The backend's tree forward: a 4D mask and explicit positions through the stock transformers forward
give every node the logits of decoding its root-to-node path sequentially."""

from __future__ import annotations

import torch

from specdecode.models.hf import HFCausalLM


def test_tree_nodes_match_sequential_paths(tiny_target):
    prefix = [3, 14, 15, 92, 65]
    # nodes: 0 = a (child of the context), 1 = b (child of a), 2 = c (child of the context), 3 = d (child of c)
    tokens = torch.tensor([7, 8, 9, 10])
    parents = [-1, 0, -1, 2]
    depth = [0, 1, 0, 1]
    n = len(parents)
    tree_mask = torch.eye(n, dtype=torch.bool)  # [n, n] node i sees node j when j is i or an ancestor
    for i in range(n):
        j = parents[i]
        while j >= 0:
            tree_mask[i, j] = True
            j = parents[j]
    lm = HFCausalLM(tiny_target)
    lm.forward(torch.tensor(prefix))
    tree = lm.forward(tokens, positions=len(prefix) + torch.tensor(depth), tree_mask=tree_mask).logits  # [n, vocab]

    paths = {0: [7], 1: [7, 8], 2: [9], 3: [9, 10]}
    for node, path in paths.items():
        reference = HFCausalLM(tiny_target)
        expected = reference.forward(torch.tensor(prefix + path), num_logits=1).logits[0]
        torch.testing.assert_close(tree[node], expected, atol=1e-5, rtol=1e-5)

    # after cropping the tree away, the cache continues like a fresh prefill of the prefix
    lm.crop(len(prefix))
    fresh = HFCausalLM(tiny_target)
    fresh.forward(torch.tensor(prefix))
    torch.testing.assert_close(lm.forward(torch.tensor([11])).logits, fresh.forward(torch.tensor([11])).logits)
