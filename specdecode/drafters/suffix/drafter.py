"""The suffix drafter: continuations from a `SuffixIndex`, merged into a weighted trie (`tree.trie`) and
drafted as a chain or a tree; judged against the output to rank and evict the index's sequences."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdecode.drafters.base import Drafter, Memory, Outcome
from specdecode.drafters.options import DrafterOptions, check_budget
from specdecode.drafters.prompt_lookup import JUDGED, CopyAcceptance
from specdecode.drafters.suffix.index import Match, SuffixIndex
from specdecode.errors import UserError
from specdecode.models.costs import CostCurve
from specdecode.tree import structure
from specdecode.tree.budget import prune
from specdecode.tree.trie import best_path, build_trie, stack
from specdecode.types import Draft, SamplingParams

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM


@dataclass
class _Judgment:
    """A proposal's leading match, to be compared with the output as it arrives."""

    own: bool  # found in the current request (else in an earlier one)
    bucket: int  # CopyAcceptance's kind of match
    tokens: list[int]  # [<= JUDGED] its continuation
    at: int  # the context length it was proposed after
    sequence: int  # in the index of the earlier requests, for a shared match


@dataclass
class SuffixMemory:
    """What one owner's earlier requests leave to a batched sequence's suffix drafter (`SuffixDrafter.for_sequence`):
    their text, indexed (closed sequences only), and how matches into it have fared."""

    index: SuffixIndex
    rates: CopyAcceptance = field(default_factory=CopyAcceptance)

    def memory_bytes(self) -> int:
        return self.index.nbytes


class SuffixDrafter(Drafter):
    """Drafts from a `SuffixIndex` of this request and the earlier ones this drafter handled.

    Each step the context's new tokens are appended to the open sequence (the request is indexed as it
    grows; the next `begin()` closes it, keeping its output and, unless `include_prompts`, only the last
    `max_match` tokens of its prompt, which key the output's start). Then the lookup's matches are
    merged into a trie by shared prefixes, and a node scores the chance that its path is accepted under
    a mixture: match i is the right source with probability w_i / sum(w), and then its continuation's
    first token is right with chance f and each later one with chance r, (f, r) being CopyAcceptance's
    rates for its match length. So score(node) = sum over the matches through the node of
    w_i / sum(w) * f_i * r_i^(depth - 1), which never grows from a parent to its child, is a match's own
    copy chance when it is alone, and splits it by frequency when earlier occurrences disagree.

    How the two sources are weighted: w_i = 2^matched_i, times `own_weight` (2) for a match in the
    current request. A longer match is the likelier source (each matched token halves the odds of a
    coincidence); at equal length the current request's own text is the likelier one (outputs quote
    their own prompt more than they repeat another request), and among earlier requests frequency
    decides. Shared matches also need `min_shared_match` (2) tokens: a single token matches almost
    anywhere in millions. The rates are learnt separately: for own matches per request, as prompt
    lookup does; for shared ones over the drafter's lifetime, since whether traffic repeats is a
    property of the workload, not of one request.

    Learning needs no verdict: as in PromptLookupDrafter, each proposal's leading own and shared match
    is judged against the output as it arrives (what greedy verification would accept), so the
    drafter learns the same way whether the engine verified its draft, cut it, or a composite drafter
    merged it with others. A shared match judged right marks its sequence used (evicted last). The
    output arrives through the contexts of propose() and through observe(), whose verdict's tokens (as
    many as the step kept, `stats.new_tokens`) must be a prefix of what the step appended to the
    context: so the last step of a request, which no propose() follows, is indexed and judged too.

    `tree=False` proposes the trie's best path as a scored chain (the engine's gate cuts it on the cost
    curve); `tree=True` the trie's best nodes: `budget` of them, or as many as pay on `curve`.

    In a batch (`for_sequence`), sequences of one owner run side by side: each indexes its own request in an
    index of its own and reads the earlier requests from the owner's `SuffixMemory`, to which it adds its
    request when it ends (`end`); what is found in both is ranked as one index ranks it (longest match, then
    the current request's).
    """

    name = "suffix"
    batchable = True  # no model: one per sequence of a batch, its owner's memory shared (`for_sequence`)
    catches_up = False  # its index hears every step's tokens (`observe`), drafted or not

    def __init__(
        self,
        curve: CostCurve | None = None,
        tree: bool = False,
        budget: int | None = None,
        index: SuffixIndex | None = None,  # owned by this drafter; default: SuffixIndex()
        num_tokens: int = 32,
        min_match: int = 1,
        min_shared_match: int = 2,
        max_candidates: int = 16,
        include_prompts: bool = False,
        own_weight: float = 2.0,
        memory: SuffixMemory | None = None,  # the owner's earlier requests (a batched sequence's); None: in `index`
    ):
        check_budget(budget)
        if tree and curve is None and budget is None:
            raise UserError("a suffix tree draft needs the target's cost curve or a fixed budget")
        if budget is not None and not tree:
            raise UserError("a budget applies to token trees")
        self.index = index if index is not None else SuffixIndex()
        shortest, longest = min(min_match, min_shared_match), max(min_match, min_shared_match)
        if not self.index.keys[0] <= shortest <= longest <= self.index.max_match:
            raise UserError(f"suffix matches need {self.index.keys[0]} <= min_match <= {self.index.max_match}, "
                            f"got {min_match} and {min_shared_match}")
        if num_tokens < 1 or max_candidates < 1 or not own_weight > 0:
            raise UserError("suffix drafting needs num_tokens >= 1, max_candidates >= 1 and own_weight > 0")
        self.curve, self.tree, self.budget = curve, tree, budget
        self.num_tokens, self.max_candidates = num_tokens, max_candidates
        self.min_match, self.min_shared_match = min_match, min_shared_match
        self.include_prompts, self.own_weight = include_prompts, own_weight
        self.memory = memory
        self._earlier = memory.index if memory is not None else self.index  # where earlier requests are found
        # matches into earlier requests: learnt over the drafter's lifetime (a batched sequence's: its owner's)
        self._shared = memory.rates if memory is not None else CopyAcceptance()
        self._own = CopyAcceptance()  # matches into this request: learnt per request
        self._judgments: list[_Judgment] = []
        self._prompt_length = 0
        self._seen: list[int] = []  # the current request's tokens so far (the index may hold fewer: the cap)
        self._behind = False  # a verdict carried fewer tokens than its step added: the next context brings them

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        """Close the previous request's sequence and open this one's, indexing the prompt at once. With
        `forget`, drop everything learnt from earlier requests first (the index and the shared rates),
        e.g. between a benchmark's repeats, so that a prompt is not drafted from its own earlier run."""
        if forget:
            self.index.clear()
            self._earlier.clear()
            self._shared = CopyAcceptance()
            if self.memory is not None:
                self.memory.rates = self._shared
        else:
            self.end()
        self.index.open()
        self.index.extend(prompt_ids)
        self._prompt_length = len(prompt_ids)
        self._seen = list(prompt_ids)
        self._behind = False
        self._own = CopyAcceptance()
        self._judgments = []

    def end(self) -> None:
        """Close the request's sequence, keeping its output and, unless `include_prompts`, only the last
        `max_match` tokens of its prompt; a batched sequence's goes into its owner's memory."""
        if self.index.open_id is None:
            return
        drop = 0 if self.include_prompts else max(self._prompt_length - self.index.max_match, 0)
        if self.memory is None:
            self.index.close(drop_first=drop)
            return
        kept = self.index.tokens_of(self.index.open_id)[drop:]
        self.index.clear()
        if kept.size:
            self._earlier.open()
            self._earlier.extend(kept)
            self._earlier.close()

    def for_sequence(self, memory: Memory | None = None) -> SuffixDrafter:
        index = self.index

        def like() -> SuffixIndex:  # an index of this drafter's settings
            return SuffixIndex(index.capacity, index.keys, index.max_match, index.max_walk)

        part = (memory or Memory()).part("suffix", lambda: SuffixMemory(like()))
        return SuffixDrafter(self.curve, self.tree, self.budget, like(), self.num_tokens, self.min_match,
                             self.min_shared_match, self.max_candidates, self.include_prompts, self.own_weight,
                             memory=part)

    def _sync(self, context: list[int]) -> None:
        """Take in the context's new tokens; a context that does not extend the request begun is
        indexed as a new request."""
        known = len(self._seen)
        if self.index.open_id is None or len(context) < known or context[:known] != self._seen:
            self.begin(list(context))
        else:
            self._absorb(context[known:])
        self._behind = False

    def _absorb(self, tokens: list[int]) -> None:
        self._seen.extend(tokens)
        self.index.extend(tokens)
        self._judge()

    def observe(self, outcome: Outcome) -> None:
        """Take in the step's tokens (see the class docstring): those its verdict carries. A verdict may carry fewer
        than the step added (a composite's, for a source it did not ask or whose proposal fell short of the tokens
        accepted); the rest then comes with the next draft's context (`_sync`), and no later verdict is taken in before
        it: absorbed after such a gap, a later step's tokens would index a text the request never had."""
        if self.index.open_id is None or self._behind:
            return
        tokens = list(outcome.verdict.tokens[: outcome.stats.new_tokens])
        self._absorb(tokens)
        self._behind = len(tokens) < outcome.stats.new_tokens

    def _judge(self) -> None:
        """Compare the open judgments with the output so far; record those decided."""
        seen, waiting = self._seen, []
        for judgment in self._judgments:
            judged = min(len(judgment.tokens), len(seen) - judgment.at)
            right = 0
            while right < judged and judgment.tokens[right] == seen[judgment.at + right]:
                right += 1
            if right < judged or judged == len(judgment.tokens):
                (self._own if judgment.own else self._shared).record(judgment.bucket, right, judged)
                if right and not judgment.own:
                    self._earlier.touch(judgment.sequence)
            else:
                waiting.append(judgment)
        self._judgments = waiting

    def _lookup(self, ids: np.ndarray, limit: int) -> tuple[list[Match], list[bool]]:
        """The matches of the context's suffix long enough to draft from, and whether each is in this request."""
        shortest, own_sequence = min(self.min_match, self.min_shared_match), self.index.open_id
        found = [(m, m.sequence == own_sequence) for m in self.index.lookup(ids, shortest, self.max_candidates, limit)]
        if self._earlier is not self.index:  # a batched sequence: the earlier requests in its owner's memory
            found += [(m, False) for m in self._earlier.lookup(ids, shortest, self.max_candidates, limit)]
            found = sorted(found, key=lambda pair: -pair[0].matched)[: self.max_candidates]  # own first at ties
        kept = [(m, o) for m, o in found if m.matched >= (self.min_match if o else self.min_shared_match)]
        return [m for m, _ in kept], [o for _, o in kept]

    def propose(self, context, max_tokens, params: SamplingParams, generator) -> Draft:
        self._sync(list(context))
        limit = min(self.num_tokens, max_tokens)
        if limit <= 0 or len(context) == 0:
            return Draft.empty()
        # the lookups read the context's last `max_match` tokens only (a long context converted whole each step cost
        # more than the lookup)
        ids = np.asarray(context[-max(self.index.max_match, self._earlier.max_match):], dtype=np.int64)
        matches, own = self._lookup(ids, limit)
        if not matches:
            return Draft.empty()
        # 1. Each match's chance of being the right source, and of its continuation's tokens being right.
        weights = np.array([(self.own_weight if o else 1.0) * 2.0 ** m.matched for m, o in zip(matches, own)])
        weights /= weights.sum()
        chances = []
        for match, is_own, weight in zip(matches, own, weights.tolist()):
            first, run = (self._own if is_own else self._shared).rates(CopyAcceptance.bucket(match.matched))
            chances.append(weight * first * run ** np.arange(match.continuation.shape[0]))  # [len]
        # 2. The continuations merged into a trie; a node's score sums the chances through it.
        trie = build_trie(stack([m.continuation for m in matches]), stack(chances, 0.0, np.float64))
        tokens, parents = torch.from_numpy(trie.tokens), torch.from_numpy(trie.parents)
        scores = torch.from_numpy(trie.weights).float()  # [n]
        # 3. Judge the leading own and shared match once the output is known.
        for source in (True, False):
            leading = next((m for m, o in zip(matches, own) if o == source), None)
            if leading is not None:
                self._judgments.append(_Judgment(source, CopyAcceptance.bucket(leading.matched),
                                                 leading.continuation[:JUDGED].tolist(), len(context),
                                                 leading.sequence))
        # 4. The best path as a scored chain, or the best nodes as a tree.
        if not self.tree:
            path = best_path(parents, scores)
            return Draft(tokens=tokens[path], scores=scores[path])
        keep = prune(parents, scores, self.curve, self.budget)
        if not keep.numel():  # no node pays on this cost curve: a plain step
            return Draft.empty()
        return Draft(tokens=tokens[keep], parents=structure.select(parents, keep), scores=scores[keep])


def build_suffix(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> Drafter:
    """The `suffix` method: no draft model; a chain gated by the engine, or (options.tree) a tree sized
    on the target's cost curve. Its index lives as long as the drafter, so reuse one drafter across
    requests (a benchmark's prompts, one owner's requests to a server) to learn across them; a server
    keeps one per owner (`Method.remembers`), never one for all its clients."""
    if not options.tree:
        return SuffixDrafter()
    return SuffixDrafter(target.cost_curve(), tree=True, budget=options.budget)
