"""Verification of a token tree: the greedy longest path and lossless multi-draft speculative sampling.

Pure functions. `target_logits` / `target_probs` has one row for the context (row 0: the distribution
of the token after the context) and one per node (row i + 1: the distribution after node i's path).
"""

from __future__ import annotations

import torch

from specdecode.sampling import logits_to_probs, sample
from specdecode.tree import structure
from specdecode.types import Draft, SamplingParams, Verdict
from specdecode.verify.chain import residual_distribution, verify_chain


def _verdict(draft_tokens: torch.Tensor, path: list[int], last: int, leaf: bool) -> Verdict:
    tokens = draft_tokens[path].tolist() + [last] if path else [last]
    return Verdict(num_drafted=draft_tokens.numel(), num_accepted=len(path), tokens=tuple(tokens),
                   path=tuple(path), bonus=leaf)


def verify_tree_greedy(
    target_logits: torch.Tensor,  # [n + 1, vocab]
    draft_tokens: torch.Tensor,  # [n]
    parents: torch.Tensor,  # [n]
) -> Verdict:
    """Follow the target's argmax down the tree as far as a child matches it: the longest accepted path.

    The result equals plain greedy decoding: every accepted node's token is the target's argmax after
    its (accepted) path, and the last token is the argmax after the deepest accepted node.
    """
    target_tokens = target_logits.argmax(-1).tolist()  # [n + 1]
    tokens = draft_tokens.tolist()
    kids = structure.children(parents)
    node, path = structure.ROOT, []
    while True:
        want = target_tokens[node + 1]
        match = next((child for child in kids[node + 1] if tokens[child] == want), None)
        if match is None:
            break
        path.append(match)
        node = match
    return _verdict(draft_tokens, path, target_tokens[node + 1], leaf=not kids[node + 1])


def verify_tree_sampling(
    target_probs: torch.Tensor,  # [n + 1, vocab] float32
    draft_tokens: torch.Tensor,  # [n]
    parents: torch.Tensor,  # [n]
    draft_probs: torch.Tensor | None,  # [n, vocab] float32; None: every node deterministic (one-hot)
    generator: torch.Generator | None,
) -> Verdict:
    """Multi-draft speculative sampling (SpecInfer; recursive rejection sampling), lossless.

    At a node, try its children in order: accept child x, drawn from draft distribution q, with
    probability min(1, p(x) / q(x)) under the current target distribution p; after a rejection replace p
    by the residual norm(max(0, p - q)) and try the next child. Accepting moves to the child and starts
    afresh with the target's distribution there; when every child is rejected, sample the correction from
    the residual. Lossless when each child is either drawn from its q independently of its earlier
    siblings (i.i.d. sampling, repeats allowed) or fixed in advance (q one-hot: the residual then removes
    that token, and the node's children together are accepted with probability p(children)). Nothing in
    the tensors tells which: a draft promises it with `Draft.drawn_independently`, which `verify` checks.
    """
    tokens = draft_tokens.tolist()
    kids = structure.children(parents)
    node, path = structure.ROOT, []
    while True:
        probs = target_probs[node + 1]  # [vocab] the target's distribution after the path so far
        accepted = None
        for child in kids[node + 1]:
            token = tokens[child]
            if draft_probs is None:
                draft_row = torch.zeros_like(probs)
                draft_row[token] = 1.0
            else:
                draft_row = draft_probs[child]
            uniform = float(torch.rand((), generator=generator))
            if uniform * float(draft_row[token]) < float(probs[token]):  # u < p(x) / q(x), no division
                accepted = child
                break
            probs = residual_distribution(probs, draft_row)
        if accepted is None:
            return _verdict(draft_tokens, path, int(sample(probs, generator)), leaf=not kids[node + 1])
        path.append(accepted)
        node = accepted


def verify(
    target_logits: torch.Tensor,  # [draft_len + 1, vocab]
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """Any draft, chain or tree: greedy match when decoding greedily, speculative sampling otherwise.
    Refuses a tree's probs unless its nodes were drawn independently (`Draft.check_probs`)."""
    draft.check_probs()
    if not draft.is_tree:
        return verify_chain(target_logits, draft, params, generator)
    if params.greedy:
        return verify_tree_greedy(target_logits, draft.tokens, draft.parents)
    target_probs = logits_to_probs(target_logits, params)
    return verify_tree_sampling(target_probs, draft.tokens, draft.parents, draft.probs, generator)
