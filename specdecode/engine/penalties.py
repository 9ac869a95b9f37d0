"""What a sequence's penalties count (`TokenHistory`), and the target's logits at every drafted position processed
as plain decoding would process them there (`TokenHistory.penalise`).

Plain decoding penalises the logits of a position by the tokens before it. A speculative step scores several
positions in one forward, each after the context and the draft tokens on its path (a chain's earlier tokens, a
tree node's ancestors), so each row is penalised by the context's counts plus its path's: verifying a draft
then meets exactly the distributions plain decoding would have sampled from, which keeps speculation lossless
under penalties, greedy or sampled. `min_tokens` is counted by position the same way: a row before it may not end
the output.
"""

from __future__ import annotations

import torch

from specdecode.devices import to_device
from specdecode.sampling import penalise
from specdecode.tree import structure
from specdecode.types import Draft, SamplingParams


class TokenHistory:
    """A sequence's prompt and the tokens generated so far, as its penalties count them: how often each token was
    generated and whether it was seen (prompt or output), [vocab] tensors on the target's device updated by each
    step's tokens, and the distinct tokens seen, on the host (the only columns a penalty can touch)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, vocab_size: int, device: torch.device | str,
                 ends: frozenset[int] = frozenset()):
        """`ends`: the tokens that would end the output, held off its first `params.min_tokens` positions."""
        self.params = params
        self.device = device
        self.count = 0  # tokens generated so far
        self.ends: torch.Tensor | None = None  # [vocab] bool, the tokens held off (None: none)
        if ends and params.min_tokens:
            self.ends = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.ends[torch.tensor(sorted(ends), device=device)] = True
        self.tokens = list(dict.fromkeys(prompt_ids))  # every distinct token seen, in order of first sight
        self._known = set(self.tokens)
        self.generated = torch.zeros(vocab_size, device=device)  # [vocab] float32
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [vocab]
        if self.tokens:
            self.seen[torch.tensor(self.tokens, device=device)] = True

    def add(self, tokens: list[int]) -> None:
        """Count a step's generated tokens."""
        if not tokens:
            return
        self.count += len(tokens)
        ids = torch.tensor(tokens, device=self.device)  # [k]
        self.generated.index_add_(0, ids, torch.ones(len(tokens), device=self.device))
        self.seen[ids] = True
        for token in tokens:
            if token not in self._known:
                self._known.add(token)
                self.tokens.append(token)

    def penalise(self, rows: torch.Tensor, draft: Draft) -> torch.Tensor:
        """rows: [len(draft) + 1, vocab], the target's logits after the context (row 0) and after each draft
        node's path; each row penalised by the tokens before its position, and the end held off before min_tokens.
        -> [len(draft) + 1, vocab] float32."""
        return self._held_open(self._penalised(rows, draft), draft)

    def _penalised(self, rows: torch.Tensor, draft: Draft) -> torch.Tensor:
        n, device = len(draft), rows.device
        if not self.params.counts_tokens:  # a bias alone, or min_tokens
            nothing = torch.zeros(n + 1, 0, device=device)
            return penalise(rows, self.params, torch.zeros(0, dtype=torch.long, device=device), nothing, nothing > 0)
        # (host data through pinned memory: a pageable copy to a GPU would wait for the kernels queued)
        drafted = to_device(draft.tokens[:n], device)  # [n]
        ids = torch.cat([to_device(self.tokens, device), drafted])  # [cols]
        # above[r, j]: draft node j lies on the path before row r's position (row 0: none; row i + 1: node i's
        # path, node i included)
        within = structure.ancestor_mask(draft.parents) if draft.parents is not None else torch.ones(
            n, n, dtype=torch.bool, device="cpu").tril()  # [n, n]
        above = torch.cat([torch.zeros(1, n, dtype=torch.bool, device="cpu"), within]).float()  # [n + 1, n]
        above = to_device(above, device)
        on_path = above @ (drafted[:, None] == ids[None, :]).float()  # [n + 1, cols]
        generated = self.generated[ids] + on_path  # [n + 1, cols]
        seen = self.seen[ids] | (on_path > 0)  # [n + 1, cols]
        return penalise(rows, self.params, ids, generated, seen)

    def _held_open(self, rows: torch.Tensor, draft: Draft) -> torch.Tensor:
        """min_tokens: the rows whose position comes before it, the context's row at the next output position and a
        node's after the nodes of its path, have the tokens that would end the output at -inf."""
        short = self.params.min_tokens - self.count
        if short <= 0 or self.ends is None:
            return rows
        parents = draft.parents
        depths = torch.arange(1, len(draft) + 1, device="cpu") if parents is None else structure.depths(parents)
        # [n + 1] the row's position past the output's
        offsets = torch.cat([torch.zeros(1, dtype=torch.long, device="cpu"), depths])
        early = to_device(offsets, rows.device) < short  # [n + 1]
        return rows.masked_fill(early[:, None] & self.ends[None, :], float("-inf"))
