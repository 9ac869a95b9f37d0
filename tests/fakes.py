"""A tiny fake `CausalLM` for statistical tests: thousands of end-to-end runs in seconds.

`FakeLM` has a vocabulary of a few tokens and logits that are a fixed function of the whole token
sequence a position sees (`ContextLogits`), so the exact distribution of any continuation is enumerated
from that function alone. It honours the whole model interface the engines use: explicit positions,
tree masks over cache and input (several sequences side by side, as `engine.batch` lays them out),
logits for chosen rows, crop and compact. Every cache entry remembers the entry it followed, and a
forward whose visible entries do not form one chain (a stale or misplaced entry, a gap or a duplicate in
the positions) raises instead of giving plausible logits: an engine bug is loud.

Test drafters that sample are here too: `IndependentTreeDrafter` draws every node's children i.i.d.
from its distribution (the only tree with `Draft.probs` that verification accepts), and `TopKTreeDrafter`
the fixed top-k children that make such probs lossy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specdecode.drafters.base import Drafter
from specdecode.models.base import CausalLM, ForwardOutput
from specdecode.models.costs import CostCurve
from specdecode.sampling import logits_to_probs
from specdecode.types import Draft

Tokens = tuple[int, ...]


class ContextLogits:
    """A fixed, seeded function from a token sequence to logits over `vocab` tokens: scale * N(0, 1)
    noise drawn from a generator seeded by (seed, sequence), plus `base`'s logits when given (a drafter
    that agrees with the target more often than chance)."""

    def __init__(self, vocab: int, seed: int, scale: float = 1.0, base: ContextLogits | None = None):
        self.vocab, self.seed, self.scale, self.base = vocab, seed, scale, base
        if base is not None and base.vocab != vocab:
            raise ValueError("a base of another vocabulary")

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019  (instances live as long as the tests)
    def __call__(self, sequence: Tokens) -> torch.Tensor:
        """[vocab] float32 logits of the token after `sequence`."""
        key = self.seed
        for token in sequence:  # a hash that no Python version or hash seed changes
            key = (key * 1_000_003 + token + 1) % (1 << 61)
        generator = torch.Generator().manual_seed(key)
        logits = self.scale * torch.randn(self.vocab, generator=generator)
        return logits if self.base is None else logits + self.base(sequence)


@dataclass(frozen=True, eq=False)
class _Entry:
    """A cache entry: its token and position, the entry it followed (None at position 0) and the whole
    sequence it saw, itself last."""

    token: int
    position: int
    previous: _Entry | None
    sequence: Tokens


class FakeLM(CausalLM):
    """A `CausalLM` whose logits after a token are `logits(the sequence it sees)`."""

    several_sequences = True
    weight_bytes_per_token = 1

    def __init__(self, logits: ContextLogits, max_context: int = 512, curve: CostCurve | None = None):
        self.logits, self.vocab_size, self.max_context = logits, logits.vocab, max_context
        self.eos_token_ids = frozenset()
        self.curve = curve or CostCurve.linear(0.05)
        self.cache: list[_Entry] = []

    @property
    def cache_length(self) -> int:
        return len(self.cache)

    def cost_curve(self) -> CostCurve:
        return self.curve  # fixed: tests time nothing

    def forward(self, token_ids, *, positions=None, tree_mask=None, num_logits=None, output_hidden=False,
                rows=None) -> ForwardOutput:
        if output_hidden:
            raise NotImplementedError("a fake model has no hidden states")
        tokens, n, cached = token_ids.tolist(), token_ids.numel(), len(self.cache)
        positions = list(range(cached, cached + n)) if positions is None else positions.tolist()
        fed = self._causal(tokens, positions) if tree_mask is None else self._masked(tokens, positions, tree_mask)
        self.cache.extend(fed)
        num_logits = n if num_logits is None else num_logits
        wanted = range(n - num_logits, n) if rows is None else rows.tolist()
        logits = [self.logits(fed[r].sequence) for r in wanted]  # [vocab] each
        return ForwardOutput(logits=torch.stack(logits) if logits else torch.empty(0, self.vocab_size))

    def _causal(self, tokens: list[int], positions: list[int]) -> list[_Entry]:
        """Entries for tokens that see the whole cache and each other in order."""
        previous = None
        for position, entry in enumerate(self.cache):  # the cache must be one chain
            if entry.position != position or entry.previous is not previous:
                raise ValueError(f"cache entry {position} does not follow the one before it")
            previous = entry
        fed = []
        for token, position in zip(tokens, positions):
            fed.append(self._after(previous, token, position))
            previous = fed[-1]
        return fed

    def _masked(self, tokens: list[int], positions: list[int], mask: torch.Tensor) -> list[_Entry]:
        """Entries for tokens that see what `mask` [n, m] allows of the last m cached and fed entries."""
        cached = len(self.cache)
        always = cached + len(tokens) - mask.shape[1]  # entries before the mask's columns are visible to all
        fed: list[_Entry] = []
        for i, row in enumerate(mask.tolist()):
            visible = self.cache[:always]
            for column in (j for j, allowed in enumerate(row) if allowed):
                k = always + column  # index into the cache followed by the fed tokens
                if k > cached + i:
                    raise ValueError(f"token {i} attends to a later token")
                if k < cached + i:
                    visible.append(self.cache[k] if k < cached else fed[k - cached])
            visible.sort(key=lambda entry: entry.position)
            previous = None  # consistent: positions 0, 1, ..., each entry computed after the one before it
            for position, entry in enumerate(visible):
                if entry.position != position or entry.previous is not previous:
                    raise ValueError(f"token {i} sees an entry at position {entry.position} that does not follow "
                                     f"the ones before it: {[e.position for e in visible]}")
                previous = entry
            fed.append(self._after(previous, tokens[i], positions[i]))
        return fed

    @staticmethod
    def _after(previous: _Entry | None, token: int, position: int) -> _Entry:
        expected = 0 if previous is None else previous.position + 1
        if position != expected:
            raise ValueError(f"a token at position {position} after {expected} tokens")
        return _Entry(token, position, previous, (() if previous is None else previous.sequence) + (token,))

    def crop(self, length: int) -> None:
        if not 0 <= length <= len(self.cache):
            raise ValueError(f"cannot crop a cache of {len(self.cache)} entries to {length}")
        del self.cache[length:]

    def _move(self, start: int, keep: list[int]) -> None:
        self.cache[start : start + len(keep)] = [self.cache[start + k] for k in keep]


def correlated_pair(vocab: int, seed: int, draft_noise: float = 0.7) -> tuple[ContextLogits, ContextLogits]:
    """(target, drafter) logit functions: the drafter is the target plus noise of scale `draft_noise`."""
    target = ContextLogits(vocab, seed)
    return target, ContextLogits(vocab, seed + 1, draft_noise, base=target)


# The setting the statistical tests share: 4 tokens; a prompt in which "2" was followed by 1, 0 and 3
# (prompt lookup and lookahead find a three-branch trie after it); a target whose first three tokens
# spread over all 64 continuations, and a drafter that agrees with it more often than chance.
VOCAB = 4
PROMPT = [1, 3, 2, 1, 3, 2, 0, 2, 3, 2]
TARGET, DRAFT = correlated_pair(VOCAB, seed=1)


class IndependentTreeDrafter(Drafter):
    """Samples a token tree from a drafter distribution `logits` (processed like the target's): the
    context's `widths[0]` children i.i.d., each of those `widths[1]` children i.i.d. from the
    distribution after it, and so on; repeated siblings are kept. Every node carries its distribution in
    `probs`, and the draft says its siblings were drawn independently."""

    name = "iid-tree"
    batchable = True  # a fixed function, no model
    independent = True

    def __init__(self, logits: ContextLogits, widths: tuple[int, ...] = (2, 2)):
        self.logits, self.widths = logits, widths

    def children(self, probs: torch.Tensor, width: int, generator) -> list[int]:
        """The tokens of a node's `width` children, given the distribution after it ([vocab])."""
        return torch.multinomial(probs, width, replacement=True, generator=generator).tolist()

    def propose(self, context, max_tokens, params, generator) -> Draft:
        tokens, parents, rows = [], [], []
        frontier = [(-1, tuple(context))]  # (node, the sequence it ends)
        for width in self.widths[:max_tokens]:
            grown = []
            for node, sequence in frontier:
                probs = logits_to_probs(self.logits(sequence), params)  # [vocab]
                for token in self.children(probs, width, generator):
                    tokens.append(token)
                    parents.append(node)
                    rows.append(probs)
                    grown.append((len(tokens) - 1, sequence + (token,)))
            frontier = grown
        if not tokens:
            return Draft.empty()
        return Draft(tokens=torch.tensor(tokens), parents=torch.tensor(parents), probs=torch.stack(rows),
                     drawn_independently=self.independent)


class TopKTreeDrafter(IndependentTreeDrafter):
    """A tree of each node's `top_k` likeliest tokens, `depth` levels deep, sent with the distributions
    the children were ranked by in `probs` — the tree `Draft.probs` must not describe, since the
    children were not drawn from them. `claim_independent` sets the flag anyway (a drafter that lies)."""

    name = "topk-tree-with-probs"

    def __init__(self, logits: ContextLogits, top_k: int = 2, depth: int = 2, claim_independent: bool = False):
        super().__init__(logits, widths=(top_k,) * depth)
        self.independent = claim_independent

    def children(self, probs: torch.Tensor, width: int, generator) -> list[int]:
        return torch.topk(probs, width).indices.tolist()
