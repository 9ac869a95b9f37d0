"""Typical acceptance (Medusa, Cai et al. 2024): a LOSSY relaxation of speculative sampling.

Instead of rejection sampling against the draft, a drafted token x is accepted where the target finds
it plausible enough: p(x) > min(epsilon, delta * exp(-H(p))), with p the target's processed
distribution at that point and H its entropy. A confident target (low entropy) accepts only its likely
tokens; an unsure one accepts more. Among the tree's nodes the deepest path of accepted tokens wins
(the first such path in node order on a tie); the token after it is sampled from the target's
distribution there.

The output no longer follows the target's distribution (it favours the drafted, typical tokens), so
methods using it are flagged lossy. Under greedy decoding (temperature 0) it is plain greedy matching,
exact, as in the paper.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from specdecode.devices import to_device, to_host
from specdecode.sampling import logits_to_probs, sample
from specdecode.tree import structure
from specdecode.types import Draft, SamplingParams, Verdict
from specdecode.verify.tree import _verdict, verify

EPSILON = 0.09  # the paper's hard threshold (its posterior_threshold)
DELTA = math.sqrt(EPSILON)  # its entropy-scaled threshold (posterior_alpha)


def typical_thresholds(probs: torch.Tensor, epsilon: float = EPSILON, delta: float = DELTA) -> torch.Tensor:
    """[rows] min(epsilon, delta * exp(-H(p))) of each row's distribution."""
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))


def verify_typical(
    target_logits: torch.Tensor,  # [n + 1, vocab]
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    epsilon: float = EPSILON,
    delta: float = DELTA,
    riders: tuple[torch.Tensor, ...] = (),
) -> Verdict:
    """Typical acceptance of a chain or tree draft (lossy under sampling; exact greedy matching at
    temperature 0). Two host reads: the nodes' tokens, probabilities and thresholds together, then the
    token sampled after the accepted path."""
    if params.greedy or len(draft) == 0:
        return verify(target_logits, draft, params, generator, riders)
    probs = logits_to_probs(target_logits, params)  # [n + 1, vocab]
    device = probs.device
    parents = draft.parents if draft.parents is not None else structure.chain(len(draft))  # [n], host or device
    draft_tokens = to_device(draft.tokens, device)  # [n]
    rows = to_device(parents + 1, device)  # [n] each node's parent's row
    # each row's threshold, each node's token, its probability under its parent's row and its parent, and the
    # draft's riders (a draft left on the device until its verdict: `Draft.riders`)
    threshold, tokens, token_probs, up, *read = to_host(typical_thresholds(probs, epsilon, delta), draft_tokens,
                                                        probs[rows, draft_tokens], parents, *draft.riders)
    if draft.riders:
        draft.read = read
    if draft.layout is not None:  # a tree whose structure is on the device: the host's copy from now on
        draft.parents = torch.tensor(up, dtype=torch.long, device="cpu")
    # a node is accepted when it and all its ancestors are typical; nodes come parents first
    depth = [0] * len(tokens)
    for node, parent in enumerate(up):
        typical = token_probs[node] > threshold[parent + 1]
        if typical and (parent < 0 or depth[parent] > 0):
            depth[node] = 1 + (depth[parent] if parent >= 0 else 0)
    deepest = max(range(len(tokens)), key=lambda node: (depth[node], -node))
    path, node = [], deepest if depth[deepest] else -1
    while node >= 0:
        path.append(node)
        node = up[node]
    path.reverse()
    last_row = path[-1] + 1 if path else 0
    leaf = (path[-1] if path else -1) not in up
    verdict = _verdict(tokens, path, int(sample(probs[last_row], generator)), leaf=leaf)
    return verdict if draft.is_tree else replace(verdict, rejected=tuple(tokens[len(path):]))
