"""The retrieval drafters: the continuations of the context's longest match, merged into a trie, drafted
as its heaviest path (`rest`) or as its best nodes (`rest-tree`); and the method's builder."""

from __future__ import annotations

import copy

import numpy as np
import torch

from specdecode.drafters.base import Drafter, Memory, Outcome
from specdecode.drafters.options import check_budget
from specdecode.drafters.retrieval.build import default_datastore
from specdecode.drafters.retrieval.datastore import (
    MAX_MATCH, MAX_OCCURRENCES, MIN_MATCH, SEPARATOR, Datastore, open_datastore, vocabulary_digest,
)
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.models.costs import CostCurve
from specdecode.tree import structure
from specdecode.tree.budget import Calibration, prune
from specdecode.tree.trie import build_trie
from specdecode.types import Draft, SamplingParams


# --- The chain: the heaviest path ------------------------------------------------------------------


def heaviest_path(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The trie's path that takes the most frequent child at every node (ties: the smaller id), and the
    count at each of its nodes. rows: [m, depth] as for `tree.trie.build_trie`. -> ([k] int64, [k] int64)"""
    path, counts = [], []
    for d in range(rows.shape[1]):
        column = rows[:, d]
        values, sizes = np.unique(column[column != SEPARATOR], return_counts=True)
        if not values.size:
            break
        best = int(np.argmax(sizes))
        path.append(int(values[best]))
        counts.append(int(sizes[best]))
        rows = rows[column == values[best]]
    return np.array(path, dtype=np.int64), np.array(counts, dtype=np.int64)


# --- The drafters ----------------------------------------------------------------------------------


def _check_retrieval(num_tokens: int, max_match: int, min_match: int, max_occurrences: int) -> None:
    if num_tokens < 1:
        raise UserError(f"retrieval drafting needs num_tokens >= 1, got {num_tokens}")
    if not 1 <= min_match <= max_match:
        raise UserError(f"retrieval drafting needs 1 <= min_match <= max_match, got {min_match}, {max_match}")
    if max_occurrences < 1:
        raise UserError(f"retrieval drafting needs max_occurrences >= 1, got {max_occurrences}")


class _RetrievalDrafter(Drafter):
    """What the chain and tree forms share: the lookup and the calibration of their scores."""

    batchable = True  # no model: one instance per sequence serves a batch
    catches_up = False

    def __init__(self, datastore: Datastore, num_tokens: int, max_match: int, min_match: int, max_occurrences: int):
        _check_retrieval(num_tokens, max_match, min_match, max_occurrences)
        self.datastore = datastore
        self.num_tokens, self.max_match, self.min_match = num_tokens, max_match, min_match
        self.max_occurrences = max_occurrences
        self._calibration = Calibration()
        self._shares = np.empty(0)  # [len(last draft)] each node's count / occurrences considered

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self._calibration.reset()
        self._shares = np.empty(0)

    def for_sequence(self, memory: Memory | None = None) -> Drafter:
        twin = copy.copy(self)  # the datastore shared
        twin._calibration = Calibration()
        twin.begin([])
        return twin

    def _continuations(self, context: list[int], depth: int) -> np.ndarray | None:
        """[occurrences, depth] what followed the longest matching suffix of the context, or None."""
        match = self.datastore.longest_match(context, self.max_match, self.min_match)
        return None if match is None else self.datastore.continuations(match, depth, self.max_occurrences)

    def _scores(self, shares: np.ndarray) -> np.ndarray:
        """Acceptance estimates: the shares, scaled by how acceptance has compared with them so far."""
        return np.minimum(shares * self._calibration.factor, 1.0)

    def observe(self, outcome: Outcome) -> None:
        self._calibration.record_verdict(self._shares, outcome.verdict)

    def _rows(self, context: list[int], max_tokens: int) -> np.ndarray | None:
        """The continuations (at most `num_tokens` and `max_tokens` deep) of the context's longest match."""
        self._shares = np.empty(0)
        depth = min(self.num_tokens, max_tokens)
        return self._continuations(context, depth) if depth > 0 else None


class RetrievalDrafter(_RetrievalDrafter):
    """REST as a chain: the most frequent continuation of the context's longest suffix found in the
    datastore. Its scores (count through each token / occurrences, calibrated) let the engine verify
    only the prefix that pays on the target's cost curve."""

    name = "rest"

    def __init__(
        self,
        datastore: Datastore,
        num_tokens: int = 16,
        max_match: int = MAX_MATCH,
        min_match: int = MIN_MATCH,
        max_occurrences: int = MAX_OCCURRENCES,
    ):
        super().__init__(datastore, num_tokens, max_match, min_match, max_occurrences)

    def propose(self, context, max_tokens, params: SamplingParams, generator) -> Draft:
        rows = self._rows(context, max_tokens)
        if rows is None:
            return Draft.empty()
        tokens, counts = heaviest_path(rows)
        if not tokens.size:  # every occurrence ends its document
            return Draft.empty()
        self._shares = counts / rows.shape[0]  # [k], non-increasing
        scores = torch.from_numpy(self._scores(self._shares)).float()
        return Draft(tokens=torch.from_numpy(tokens), scores=scores)


class RetrievalTreeDrafter(_RetrievalDrafter):
    """REST as a token tree: every continuation of the context's longest matching suffix, merged into
    a trie; the best nodes by score are kept, a fixed number (`budget`) or the number that maximises
    expected tokens per unit of time on the target's cost curve (as PromptLookupTreeDrafter)."""

    name = "rest-tree"

    def __init__(
        self,
        datastore: Datastore,
        curve: CostCurve,
        num_tokens: int = 10,
        max_match: int = MAX_MATCH,
        min_match: int = MIN_MATCH,
        max_occurrences: int = MAX_OCCURRENCES,
        budget: int | None = None,
    ):
        super().__init__(datastore, num_tokens, max_match, min_match, max_occurrences)
        check_budget(budget)
        self.curve, self.budget = curve, budget

    def propose(self, context, max_tokens, params: SamplingParams, generator) -> Draft:
        rows = self._rows(context, max_tokens)
        if rows is None:
            return Draft.empty()
        # 1. Merge the continuations into a trie, depth by depth; score each node.
        trie = build_trie(rows, by_depth=True)
        shares = trie.weights / trie.total  # [nodes]
        scores = self._scores(shares)
        # 2. The best nodes (none: nothing followed the match, or no node pays, a plain step).
        keep = prune(torch.from_numpy(trie.parents), torch.from_numpy(scores), self.curve, self.budget)
        if not keep.numel():
            return Draft.empty()
        self._shares = shares[keep.numpy()]
        return Draft(
            tokens=torch.from_numpy(trie.tokens)[keep],
            parents=structure.select(torch.from_numpy(trie.parents), keep),
            scores=torch.from_numpy(scores[keep.numpy()]).float(),
        )


def build_retrieval(target: CausalLM, draft: CausalLM | None, options) -> Drafter:
    """The `rest` method's drafter: `options.datastore` (a path), else the standard-library datastore
    for `options.tokenizer`; a tree when `options.tree` (sized by `options.budget` or the target's cost
    curve). `options` is a `DrafterOptions`."""
    if options.datastore is not None:
        # The tokenizer's length when known; the logits may be wider than it (Qwen2.5 pads them).
        expected = len(options.tokenizer) if options.tokenizer is not None else None
        datastore = open_datastore(options.datastore, expected)
        if datastore.info.vocab_size > target.vocab_size:
            raise UserError(
                f"the datastore {options.datastore} was built for a vocabulary of {datastore.info.vocab_size} "
                f"tokens, more than the target's {target.vocab_size}: rebuild it with the target's tokenizer"
            )
        kept = datastore.info.vocabulary
        if options.tokenizer is not None and kept and kept != vocabulary_digest(options.tokenizer):
            raise UserError(f"the datastore {options.datastore} was built with another tokenizer "
                            f"({datastore.info.tokenizer}), whose ids mean other text: rebuild it with "
                            "`specdecode datastore build CORPUS_DIR OUT --target <your target>`")
    elif options.tokenizer is not None:
        datastore = open_datastore(default_datastore(options.tokenizer), len(options.tokenizer))
    else:
        raise UserError("retrieval drafting needs a datastore (`specdecode datastore build`) or the target's "
                        "tokenizer to build the default one from the standard library")
    if not options.tree:
        return RetrievalDrafter(datastore)
    return RetrievalTreeDrafter(datastore, target.cost_curve(), budget=options.budget)
