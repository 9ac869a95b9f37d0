"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding"): Jacobi trajectories harvested for n-grams, and the n-grams verified, in one target forward.

Two branches share every step's forward:

- the *lookahead branch*, a window of W columns and N - 1 levels of Jacobi guesses. Column c of level l
  sits at position P + l + c, P being the position of the context's last token, which is column 0 of
  level 0 (so the branch adds W (N - 1) - 1 tokens). Level 0 is a causal block after the context; the
  token at (l, c) sees level 0 up to column c and column c up to level l. The target's prediction at
  the top level's column c, conditioned on that chain, is the next token of the column's trajectory.
  Each step appends those predictions as a new top level and drops level 0 (the window slides one
  Jacobi iteration per step), and each column, the old level 0 to the new prediction, is an n-gram in
  which every token was the target's guess after the one before: it goes into the pool, keyed by its
  first token. These tokens ride in the forward as `AuxiliaryTokens`: no draft node sees them, and the
  engine never verifies them.
- the *verification branch*, the draft: up to G pool n-grams whose first token is the context's last
  token, their other N - 1 tokens merged by shared prefixes into a token tree, which the engine verifies
  like any tree (greedy: the longest matching path; sampling: lossless as one-hot drafts).

The window fills over the first N - 2 steps (levels are appended, none dropped) before n-grams are
harvested. It slides one level per step whatever was accepted, and positions are recomputed from the
context each step, so after a step that accepts m tokens the window's guesses stand m positions early:
what matters is the chains within columns, which that keeps, and the verification makes any n-gram safe.
Level 0 starts as copies (prompt-lookup style, see `jacobi.extend_guesses`) rather than random prompt
tokens, so that runs reproduce. The pool also takes every n-gram of the prompt and of the output as it
grows (the reference implementation's "pool from prompt"), the most recent G per first token.
"""

from __future__ import annotations

import torch

from specdecode.drafters.base import Drafter, Needs, Outcome
from specdecode.drafters.jacobi import extend_guesses
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.models.costs import CostCurve
from specdecode.tree import structure
from specdecode.tree.budget import Calibration, prune
from specdecode.tree.trie import build_trie, stack
from specdecode.types import AuxiliaryTokens, Draft, SamplingParams

# Defaults for a CPU on which a bf16 forward over 16 tokens costs little more than one and wider ones grow
# steeply (the curve: docs/results/code-choices.md). The reference's GPU settings (W = 15,
# N = 5, G = 15: about 120 tokens a forward) would cost several forwards here; W = 5, N = 3, G = 3 keep a
# step to at most 1 + 9 window + 6 draft = 16 tokens, so the window costs a fraction of a forward and a
# full 2-gram match pays for it. 2-grams cap a step at 3 tokens; the lead tunes W, N and G by benchmark.
DEFAULT_WINDOW = 5
DEFAULT_NGRAM = 3
DEFAULT_CANDIDATES = 3
# Where verification width is dear (bf16 emulated on a CPU without bf16 units: docs/results/cost-curves.md),
# the window is left out once it costs more than this share of a forward, and the candidates' trie is cut to
# the nodes that pay.
WINDOW_SHARE = 0.25
PRIOR_ACCEPTANCE = 0.5  # per level, before the calibration has evidence


class NgramPool:
    """n-grams keyed by their first token: for each, the last `capacity` distinct continuations of
    n - 1 tokens (seeing one again makes it the most recent)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: dict[int, list[tuple[int, ...]]] = {}

    def add(self, first: int, rest: tuple[int, ...]) -> None:
        entries = self._entries.setdefault(first, [])
        if rest in entries:
            entries.remove(rest)
        entries.append(rest)
        if len(entries) > self.capacity:
            del entries[0]

    def candidates(self, first: int) -> list[tuple[int, ...]]:
        """The continuations of `first`, most recent first."""
        return self._entries.get(first, [])[::-1]

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._entries.values())


def window_tokens(levels: list[list[int]], context_length: int) -> AuxiliaryTokens:
    """The lookahead window as auxiliary tokens: every cell but (0, 0), which is the context's last token
    (at position P = context_length - 1), level by level. Cell (i, j) of level i and column j sits at position
    P + i + j and attends to level 0 up to column j and to column j up to level i (itself included)."""
    cells = [(i, j) for i in range(len(levels)) for j in range(len(levels[0])) if (i, j) != (0, 0)]
    level = torch.tensor([i for i, _ in cells], dtype=torch.long, device="cpu")  # [m]
    column = torch.tensor([j for _, j in cells], dtype=torch.long, device="cpu")  # [m]
    row_level, row_column = level[:, None], column[:, None]  # [m, 1] the attending cell
    mask = ((level == 0) & (column <= row_column)) | ((column == row_column) & (level <= row_level))  # [m, m]
    tokens = torch.tensor([levels[i][j] for i, j in cells], dtype=torch.long, device="cpu")
    return AuxiliaryTokens(tokens=tokens, positions=context_length - 1 + level + column, mask=mask)


class LookaheadDrafter(Drafter):
    """Lookahead decoding: a Jacobi window of `window` columns and `ngram` - 1 levels rides in every
    verification forward and fills an n-gram pool; up to `candidates` pool n-grams that start with the
    context's last token are the step's draft, as a token tree."""

    name = "lookahead"
    needs = Needs(logits=True)

    def __init__(
        self,
        window: int = DEFAULT_WINDOW,
        ngram: int = DEFAULT_NGRAM,
        candidates: int = DEFAULT_CANDIDATES,
        max_context: int | None = None,  # the target's; the window is left out where it would not fit
        pool_from_context: bool = True,
        curve: CostCurve | None = None,  # the target's; None: width is taken as free (window and tree always)
    ):
        if window < 1 or ngram < 2 or candidates < 0:
            raise UserError(f"lookahead decoding needs W >= 1, N >= 2 and G >= 0; got {window}, {ngram}, {candidates}")
        self.window, self.ngram, self.candidates = window, ngram, candidates
        self.max_context = max_context
        self.pool_from_context = pool_from_context
        self.curve = curve
        self.begin([])

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self.calibration = Calibration()  # accepted nodes against the candidates' expected acceptance
        self.pool = NgramPool(max(self.candidates, 1))
        self._levels: list[list[int]] = []  # oldest first, `window` tokens each; [] until the first step
        self._indexed = 0  # n-grams of the context up to this start are in the pool

    def _index_context(self, context: list[int]) -> None:
        """Every n-gram of the context not pooled yet (the prompt at first, then the output)."""
        n = self.ngram
        for start in range(self._indexed, len(context) - n + 1):
            self.pool.add(context[start], tuple(context[start + 1 : start + n]))
        self._indexed = max(self._indexed, len(context) - n + 1)

    def propose(self, context: list[int], max_tokens: int, params: SamplingParams, generator) -> Draft:
        if self.pool_from_context:
            self._index_context(context)
        # 1. Verification branch: the pool's n-grams after the last token, as a trie.
        depth = min(self.ngram - 1, max_tokens)
        found = [c[:depth] for c in self.pool.candidates(context[-1])[: self.candidates]] if depth > 0 else []
        merged = build_trie(stack(found))
        tokens, parents = merged.tokens.tolist(), merged.parents.tolist()
        scores = None
        if tokens and self.curve is not None:  # the nodes that pay on the cost curve
            tokens, parents, scores = self._cut(self.curve, tokens, parents)
        # 2. Lookahead branch: the window, its level 0 starting at the context's last token, where it fits
        #    and costs at most WINDOW_SHARE of a forward (else the pool grows from the context alone).
        if not self._levels:
            self._levels = [extend_guesses(context, [context[-1]], self.window)]
        self._levels[0][0] = context[-1]
        room = len(context) + len(tokens) + self.window * (self.ngram - 1) + self.ngram
        auxiliary = None if self.max_context is not None and room > self.max_context else (
            window_tokens(self._levels, len(context))
        )
        if auxiliary is not None and self.curve is not None:
            fed = 1 + len(tokens)
            if self.curve(fed + len(auxiliary)) - self.curve(fed) > WINDOW_SHARE:
                auxiliary = None
        if not tokens:
            return Draft(tokens=torch.empty(0, dtype=torch.long, device="cpu"), auxiliary=auxiliary)
        return Draft(tokens=torch.tensor(tokens, device="cpu"), parents=torch.tensor(parents, device="cpu"),
                     auxiliary=auxiliary, scores=scores)

    def observe(self, outcome: Outcome) -> None:
        """Slide the window on the target's predictions (when it rode in the forward); recalibrate the
        candidates' scores."""
        if outcome.logits is not None and outcome.draft.auxiliary is not None:
            self._slide(outcome.draft, outcome.logits)
        if self.curve is not None and outcome.verdict.num_drafted:
            self.calibration.record_verdict(self._scores, outcome.verdict)

    def _slide(self, draft: Draft, logits: torch.Tensor) -> None:
        """logits: [len(draft) + 1 + len(draft.auxiliary), vocab]. The top level's rows are the last W
        (on the first step the top level is level 0, whose column 0 is the row after the context)."""
        rows = torch.cat([logits[:1], logits[len(draft) + 1 :]])[-self.window :]  # [W, vocab]
        predicted = rows.argmax(-1).tolist()  # [W] the next token of every column's trajectory
        if len(self._levels) < self.ngram - 1:  # still filling the window
            self._levels.append(predicted)
            return
        for c in range(self.window):
            column = [level[c] for level in self._levels] + [predicted[c]]  # [N], an n-gram
            self.pool.add(column[0], tuple(column[1:]))
        self._levels = self._levels[1:] + [predicted]

    def _cut(self, curve: CostCurve, tokens: list[int], parents: list[int]
             ) -> tuple[list[int], list[int], torch.Tensor]:
        """The trie's nodes that pay on the cost curve, each scored by the share of the candidates through
        it times PRIOR_ACCEPTANCE per level, rescaled by how often such scores held (`Calibration`)."""
        parents_t = torch.tensor(parents, device="cpu")
        through = torch.zeros(len(tokens), device="cpu")  # candidates (root-to-leaf paths) through each node
        for path in structure.leaf_paths(parents_t).tolist():
            through[[node for node in path if node >= 0]] += 1
        scores = (through / through.max() * PRIOR_ACCEPTANCE ** structure.depths(parents_t).float()
                  * self.calibration.factor)  # [n], never higher for a child than for its parent
        keep = prune(parents_t, scores, curve, cap=len(tokens))
        self._scores = scores[keep]
        return [tokens[i] for i in keep.tolist()], structure.select(parents_t, keep).tolist(), self._scores


def build_lookahead(target: CausalLM, draft: CausalLM | None, options) -> Drafter:
    """The `lookahead` method: no draft model; W, N, G at their defaults; window and trie follow the
    target's cost curve."""
    return LookaheadDrafter(max_context=target.max_context, curve=target.cost_curve())
