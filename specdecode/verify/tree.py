"""Verification of a token tree: the greedy longest path and lossless multi-draft speculative sampling (or, for a
tree without distributions in a seeded sequence, the path of the tokens plain decoding samples: `sampling`).

Pure functions. `target_logits` / `target_probs` has one row for the context (row 0: the distribution
of the token after the context) and one per node (row i + 1: the distribution after node i's path).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specdecode.sampling import logits_to_probs, sample, step_uniforms
from specdecode.tree import structure
from specdecode.types import Draft, SamplingParams, Verdict
from specdecode.devices import to_device, to_host
from specdecode.verify.chain import match_chain, residual_distribution, verify_chain


def _verdict(tokens: list[int], path: list[int], last: int, leaf: bool, riders: tuple = ()) -> Verdict:
    return Verdict(num_drafted=len(tokens), num_accepted=len(path), tokens=tuple([tokens[i] for i in path] + [last]),
                   path=tuple(path), bonus=leaf, riders=riders)


def verify_tree_greedy(
    target_logits: torch.Tensor,  # [n + 1, vocab]
    draft_tokens: torch.Tensor,  # [n]
    parents: torch.Tensor,  # [n] on the host
    riders: tuple[torch.Tensor, ...] = (),  # read in the same transfer (`Verdict.riders`)
) -> Verdict:
    """Follow the target's argmax down the tree as far as a child matches it: the longest accepted path.

    The result equals plain greedy decoding: every accepted node's token is the target's argmax after
    its (accepted) path, and the last token is the argmax after the deepest accepted node.
    """
    return match_tree(target_logits.argmax(-1), draft_tokens, parents, riders)


def match_tree(
    target_tokens: torch.Tensor,  # [n + 1] each row's token: its argmax, or sampled with its position's uniform
    draft_tokens: torch.Tensor,  # [n]
    parents: torch.Tensor,  # [n] on the host
    riders: tuple[torch.Tensor, ...] = (),
) -> Verdict:
    """Follow the target's tokens down the tree as far as a child carries its parent's row's token. The target's
    tokens and the draft's reach the host in one transfer; the walk down the tree is host work."""
    # (a host-made draft's tokens go to the device through pinned memory: a pageable copy would wait there)
    target_list, tokens, *extra = to_host(target_tokens, to_device(draft_tokens, target_tokens.device), *riders)
    kids = structure.children(parents)
    node = structure.ROOT
    path: list[int] = []  # the accepted nodes, root first
    while True:
        want = target_list[node + 1]
        match = next((child for child in kids[node + 1] if tokens[child] == want), None)
        if match is None:
            break
        path.append(match)
        node = match
    return _verdict(tokens, path, target_list[node + 1], leaf=not kids[node + 1], riders=tuple(extra))


def verify_tree_on_device(
    target_tokens: torch.Tensor,  # [n + 1] each row's token: its argmax, or sampled with its position's uniform
    draft: Draft,  # a tree whose tokens, parents and `layout` are on the device
    riders: tuple[torch.Tensor, ...] = (),
) -> Verdict:
    """`match_tree` of a tree whose structure is on the device (`Draft.layout`), decided there: a node is accepted
    where it and each of its ancestors carry the target's token after their parent's path, and the path is the
    deepest such node's. One transfer brings the path, the last token, the tree's tokens and parents and the
    riders; the draft's `parents` become the host's copy."""
    layout = draft.layout
    assert layout is not None and draft.parents is not None
    matches = draft.tokens == target_tokens[draft.parents + 1]  # [n] each node against its parent's row
    accepted = ~(layout.ancestors & ~matches[None, :]).any(dim=1)  # [n] it and all its ancestors match
    depths = torch.where(accepted, layout.depths, 0)
    # [1], not 0-d: torch reads a 0-d index on the host (a wait on a GPU). Node 0 where none is accepted: its
    # depth 0 tells
    deepest = depths.argmax().view(1)
    reached = depths[deepest] > 0  # [1]
    on_path = layout.ancestors[deepest][0] & reached  # [n]
    last = target_tokens[torch.where(reached, deepest + 1, 0)][0]
    path_mask, last_token, tokens, parents, *extra = to_host(on_path, last, draft.tokens, draft.parents, *riders)
    draft.parents = torch.tensor(parents, dtype=torch.long, device="cpu")
    path = [node for node, on in enumerate(path_mask) if on]  # parents come first: root to deepest
    node = path[-1] if path else structure.ROOT
    leaf = node not in parents  # no child after the deepest accepted node (or the context)
    return _verdict(tokens, path, last_token, leaf=leaf, riders=tuple(extra))


def verify_tree_sampling(
    target_probs: torch.Tensor,  # [n + 1, vocab] float32
    draft_tokens: torch.Tensor,  # [n]
    parents: torch.Tensor,  # [n] on the host
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

    One level of the tree at a time on the device: every child is tried there (a child after the accepted
    one changes nothing), the correction is drawn from the final residual in case none is accepted, and
    the host learns which child won (or the correction) in one transfer per level.
    """
    device = target_probs.device
    draft_tokens = to_device(draft_tokens, device)
    kids = structure.children(parents)
    uniforms = torch.rand(draft_tokens.numel(), generator=generator, device=device)  # [n] one per node, up front
    node = structure.ROOT
    path: list[int] = []  # the accepted nodes, root first
    while True:
        probs = target_probs[node + 1]  # [vocab] the target's distribution after the path so far
        winner = torch.full((), -1, dtype=torch.long, device=device)  # the accepted child's rank; -1: none yet
        for rank, child in enumerate(kids[node + 1]):
            token = draft_tokens[child : child + 1]  # [1], on the device (a 0-d index would be read on the host)
            if draft_probs is None:
                draft_row = torch.zeros_like(probs).index_fill_(0, token, 1.0)
            else:
                draft_row = draft_probs[child]
            accept = (uniforms[child] * draft_row[token][0] < probs[token][0]) & (winner < 0)  # u < p(x) / q(x)
            winner = torch.where(accept, rank, winner)
            probs = torch.where(winner < 0, residual_distribution(probs, draft_row), probs)
        correction = sample(probs, generator)  # used only if every child was rejected
        (rank, last), tokens = to_host(torch.stack([winner, correction.view(())]), draft_tokens)
        if rank < 0:
            return _verdict(tokens, path, last, leaf=not kids[node + 1])
        node = kids[node + 1][rank]
        path.append(node)


def verify(
    target_logits: torch.Tensor,  # [draft_len + 1, vocab]
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    riders: tuple[torch.Tensor, ...] = (),
) -> Verdict:
    """Any draft, chain or tree: greedy match when decoding greedily; under sampling, a draft without distributions
    matched against each row's token sampled with its position's uniform where `generator` names them
    (`sampling.step_uniforms`: plain decoding's tokens under the seed), else speculative sampling. Matching reads
    the draft's riders (`Draft.riders`) and `riders` with the verdict. Refuses a tree's probs unless its nodes were
    drawn independently (`Draft.check_probs`)."""
    draft.check_probs()
    targets = (target_logits.argmax(-1) if params.greedy  # [n + 1]
               else matched_tokens(target_logits, draft, params, generator))
    if targets is None:
        if draft.parents is None:
            return verify_chain(target_logits, draft, params, generator)
        target_probs = logits_to_probs(target_logits, params)
        return verify_tree_sampling(target_probs, draft.tokens, draft.parents, draft.probs, generator)
    both = (*draft.riders, *riders)  # the drafter's riders first (`Draft.riders`), then the caller's
    if draft.parents is None:  # a chain
        verdict = match_chain(targets, draft.tokens, both)
    elif draft.layout is not None:
        verdict = verify_tree_on_device(targets, draft, both)
    else:
        verdict = match_tree(targets, draft.tokens, draft.parents, both)
    if not draft.riders:
        return verdict
    draft.read = list(verdict.riders[: len(draft.riders)])
    return replace(verdict, riders=verdict.riders[len(draft.riders) :])


def matched_tokens(target_logits: torch.Tensor, draft: Draft, params: SamplingParams,
                   generator: torch.Generator | None) -> torch.Tensor | None:
    """Under sampling, the token each row of a draft without distributions is sampled to, with its position's
    uniform (the context's row decides the context's next position, a node's row the one after the node), where
    `generator` names them; else None. -> [len(draft) + 1] on the device of the logits"""
    if draft.probs is not None:
        return None
    device = target_logits.device
    if draft.parents is None:
        depths = torch.arange(len(draft) + 1, device=device)
    elif draft.layout is not None:
        depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), draft.layout.depths])
    else:
        above = torch.cat([torch.zeros(1, dtype=torch.long, device="cpu"), structure.depths(draft.parents)])
        depths = to_device(above, device)
    uniforms = step_uniforms(generator, depths)
    if uniforms is None:
        return None
    return sample(logits_to_probs(target_logits[: len(draft) + 1], params), None, uniforms)
