"""A composite drafter: several drafters asked in turn, their proposals merged into one token tree.

Cheap drafters (prompt lookup, retrieval, a suffix cache) cost next to nothing but often find nothing;
a draft model finds something every step but costs draft forwards. The composite asks its sources in
the order given, each with a cost class:

- *free* sources are always asked;
- an *expensive* source is asked only when what the sources asked before it promise (the expected
  accepted tokens of the draft the composite would submit now) is below `fallback_below` (default: one
  token). So with [prompt lookup (free), draft model (expensive)] the draft model is not run while a
  copy is running, and takes over when the copy ends.

Merging. Every proposal, chain or tree, goes into one trie from the context: a node per distinct path,
so shared prefixes are verified once. A node's score estimates the chance that its path is accepted:
the sub-draft's own scores when it sent them, else rate^depth split evenly among siblings, with `rate`
the per-token acceptance the composite has seen for that source. Where several sources propose the same
path their scores combine by `max` (the default) or by noisy-or. Max, because the scores estimate one
event (the target's continuation going that way) from sources that mostly read the same evidence:
prompt lookup and a suffix cache find the same n-gram in the same context, and noisy-or, which assumes
independent evidence, would turn two 0.6 guesses of one match into 0.84. Max never overstates what one
source believes; where sources truly agree it understates a little, which costs a little speed, never
correctness. The composite keeps no calibration of its own: its sources learn theirs from the output
whether or not their nodes were verified (prompt lookup and the suffix cache judge every proposal; an
unscored source's rate counts its translated verdicts' accepted and rejected tokens), while a factor
learnt only from verified drafts can talk itself into submitting nothing and never hear otherwise.
Under either rule a child never scores above its parent (enforced after merging), and the tree is
pruned to the budget: a fixed node count, or the count that maximises expected tokens per unit of time
on the target's cost curve (`tree.budget.best_budget`). With `tree=False` the trie's best path is
submitted as a scored chain instead, for backends without tree attention.

Sampling. The merged nodes are submitted without distributions (probs None): the tree verifier treats
them as fixed in advance (one-hot), which is lossless for any fixed set of children, and a token a
draft model sampled is fixed by the time the verifier draws its own randomness, so conditioned on the
draft the output follows the target's distribution exactly, hence unconditionally too. The price: a
sampled draft token x is accepted with probability p(x) instead of min(1, p(x) / q(x)).

What each sub-drafter learns. `observe()` gives every source the verdict its own proposal would have
received had it been verified alone against this step's output (the accepted tokens and the
correction or bonus token, `verdict.tokens`): its accepted nodes are the longest path of its draft that
follows the output, and a rejection is reported when that path stops at a node whose children all
differ from the next output token. Under greedy decoding that is exactly what verifying its draft alone
would have decided, even for nodes the composite pruned, since the output token at every depth is the
target's argmax after the path so far; under sampling it is the natural estimate. When its draft
predicted the whole output, correction included, nothing of it was rejected and what follows is
unknown: it hears of len(output) - 1 accepted tokens and no rejection. A source not asked this step (or
proposing nothing) hears of a step with no draft. So a source's verdict tokens are a prefix of what the
step appended to the context, not always all of it; its StepStats carry its own drafted and accepted
counts, the step's new_tokens and timings. A source that needs the target's logits (`Needs.logits`)
gets, as its outcome's draft, the nodes of its proposal that were verified, and their rows (the verdict
still judges its whole proposal, and so indexes it: the two agree on the accepted count); the others get
their whole proposal.

Sources that read the target's hidden states (trained heads: Medusa's final-norm state, EAGLE-3's layer
inputs) get them every step, asked or not: the composite asks the forward for the union of what they need
(`hidden_request`; the final-norm state is transformers' last hidden state, index `final_layer` of a layer
tuple), and each hears its own columns with the accepted path of the draft that was fed (`Outcome.fed_path`),
so its features follow the context whatever source drafted it, while its verdict judges its own proposal.

Off the CPU. A source that keeps its tree on the device (a trained head's, pruned there and read with the verdict:
`Draft.layout`) is not merged, which would read it first: its tree goes beside the merged nodes as one forest
(`merging.beside`), verified on the device, so a step waits for the device once. A path both propose is then verified
twice (the deeper accepted copy wins); the tree's tokens and structure come back with the verdict, and its source
hears its verdict as any other does.

What pays. Each source's drafting is timed and weighed against the tokens it adds beyond the sources asked
before it, per request (`drafters.source_payoff`). The timing does not wait for the device (`devices.stopwatch`:
on CUDA between events); its seconds are in by the step's verdict, whose read on the host waited for the drafting
(a source's seconds not in by then count as nothing). A token's worth of time is a plain step of the target for a
sequence alone, and in a batch the batch's seconds a token (`Drafter.batch_pace`): there every sequence of the step
waits for each one's drafting. One that does not pay is not asked until the text changes character. Where nothing is
asked or nothing pays on the cost curve, the draft is empty and the step is the target's plain one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from specdecode import devices
from specdecode.drafters.base import Drafter, Memory, Needs, Outcome, RunningAcceptance
from specdecode.drafters.options import DrafterOptions, check_budget
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.merging import (  # (re-exported: the composite's pure part)
    COMBINE, DROPPED, Merged, beside, default_scores, merge, parents_of, select, surviving, translate,
)
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.retrieval import build_retrieval
from specdecode.drafters.source_payoff import Payoff
from specdecode.drafters.sources import Source, columns, hidden_request
from specdecode.errors import UserError
from specdecode.models.costs import CostCurve
from specdecode.tree import structure
from specdecode.types import Draft, SamplingParams, Verdict

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM

__all__ = ["COMBINE", "DROPPED", "CompositeDrafter", "Merged", "Source", "build_composite", "default_scores",
           "default_sources", "merge", "parents_of", "select", "translate"]


class CompositeDrafter(Drafter):
    """Asks its sources in order (free ones always, expensive ones only when the others promise fewer
    than `fallback_below` accepted tokens) and merges their proposals into one tree (see the module
    docstring)."""

    name = "composite"

    def __init__(
        self,
        sources: Sequence[Source | Drafter],
        curve: CostCurve,
        tree: bool = True,
        budget: int | None = None,
        fallback_below: float = 1.0,
        combine: str = "max",
        final_layer: int | None = None,
        clock: Callable[[], float] | None = None,
        device: torch.device | str | None = None,
    ):
        """`device`: where the sources draft (the target's), for timing them; `clock`: a fixed clock instead (a
        test's)."""
        self.sources = [s if isinstance(s, Source) else Source(s) for s in sources]
        if not self.sources:
            raise UserError("a composite drafter needs at least one source")
        check_budget(budget)
        if budget is not None and not tree:
            raise UserError("a budget applies to token trees")
        if combine not in COMBINE:
            raise UserError(f"scores combine by one of {', '.join(COMBINE)}, got {combine!r}")
        if math.isnan(fallback_below) or fallback_below < 0:
            raise UserError(f"fallback_below must be >= 0 expected tokens, got {fallback_below}")
        self.curve, self.tree, self.budget = curve, tree, budget
        self.fallback_below, self.combine = fallback_below, combine
        self.final_layer, self.device, self.clock = final_layer, device, clock
        self.hidden, self._blocks = hidden_request([s.drafter.needs.hidden for s in self.sources], final_layer)
        self.needs = Needs(logits=any(s.drafter.needs.logits for s in self.sources), hidden=self.hidden)
        self.catches_up = any(s.drafter.catches_up for s in self.sources)
        # in a batch only the sources that can join it draft (`for_sequence`)
        self.batchable = all(s.drafter.batchable for s in self.sources)
        self.stopwatch = devices.stopwatch(device, clock)
        self.payoff = Payoff(len(self.sources))  # per request
        self._costs = [0.0] * len(self.sources)  # this step's drafting, per source, in plain steps
        # What the composite learns describes its sources and the target, not one request: kept across requests
        # (one owner's: a `forget` drops it, as a server's engine for requests without an owner does before each)
        self._acceptance = [RunningAcceptance() for _ in self.sources]  # per source
        self._proposals: list[Draft | None] = []  # this step's, per source (None: not asked)
        self._merged: Merged | None = None
        self._draft: Draft | None = None  # this step's, as submitted
        self._submitted: dict[int, int] = {}  # merged node -> its index in the draft verified
        self._pace: float | None = None  # seconds a token of the batch it drafts in (`batch_pace`; None: alone)
        self._beside: int | None = None  # the source whose tree made on the device goes beside the merge this step
        # this step's latest merge, by the proposals it took, and its choice (`_merge`, `_choose`)
        self._memo: tuple[tuple, Merged, tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def memory_bytes(self) -> int:
        """What its sources hold (a server keeps one composite per owner where a source remembers)."""
        return sum(source.drafter.memory_bytes() for source in self.sources)

    def rate(self, source: int) -> float:
        """Running per-token acceptance of a source's proposals (prior 2/3), for drafts without scores."""
        return self._acceptance[source].value

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        for source in self.sources:
            source.drafter.begin(list(prompt_ids), forget)
        if forget:
            self._acceptance = [RunningAcceptance() for _ in self.sources]
        self.payoff.begin()
        self._proposals, self._merged, self._draft, self._submitted, self._beside = [], None, None, {}, None

    def batch_pace(self, seconds_per_token: float | None) -> None:
        self._pace = seconds_per_token

    def for_sequence(self, memory: Memory | None = None) -> CompositeDrafter:
        """A composite of its sources' own drafters for one sequence of a batch (`Drafter.for_sequence`), of
        those that can join it: not a draft model, nor a head with a cache of its own (EAGLE's)."""
        sources = [Source(s.drafter.for_sequence(memory), s.cost) for s in self.sources if s.drafter.batchable]
        twin = CompositeDrafter(sources, self.curve, self.tree, self.budget, self.fallback_below, self.combine,
                                self.final_layer, self.clock, self.device)
        twin.name, twin.weighs_itself = self.name, self.weighs_itself
        return twin

    def end(self) -> None:
        for source in self.sources:
            source.drafter.end()

    def _merged_proposals(self) -> list[tuple[int, Draft]]:
        """(source, proposal) of what the merge takes: the proposals asked for, but a tree kept on the device."""
        return [(i, d) for i, d in enumerate(self._proposals) if d is not None and d.layout is None]

    def _merge(self, depth: int) -> Merged:
        asked = self._merged_proposals()
        key = (depth, tuple(i for i, _ in asked))
        if self._memo is None or self._memo[0] != key:  # (a step merges the same proposals twice: `propose`)
            scores = [d.scores if d.scores is not None else default_scores(d, self.rate(i)) for i, d in asked]
            self._memo = (key, merge([d for _, d in asked], scores, self.combine, max_depth=depth), None)
        return self._memo[1]

    def _choose(self, merged: Merged) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept nodes, their scores) of a merged trie."""
        if self._memo is not None and self._memo[1] is merged and self._memo[2] is not None:
            return self._memo[2]
        scores = torch.tensor(merged.scores, dtype=torch.float32, device="cpu")  # [n]
        parents = torch.tensor(merged.parents, dtype=torch.long, device="cpu")
        keep = select(parents, scores, self.curve, self.budget, self.tree)
        if self._memo is not None and self._memo[1] is merged:
            self._memo = (self._memo[0], merged, (keep, scores[keep]))
        return keep, scores[keep]

    def promised(self, merged: Merged) -> float:
        """The expected accepted tokens of the draft the composite would submit from `merged`."""
        return float(self._choose(merged)[1].sum())

    def propose(self, context, max_tokens, params: SamplingParams, generator) -> Draft:
        self._proposals, self._merged, self._draft, self._submitted, self._beside = [], None, None, {}, None
        self._memo = None
        if max_tokens <= 0:
            return Draft.empty()
        # 1. Ask the sources in order, but those that have not paid on this request; an expensive one only
        #    while the others promise too little. Each one's drafting is timed, in tokens' worth of time.
        step: float = getattr(self.curve, "seconds", 0.0) if self._pace is None else self._pace  # (`batch_pace`)
        self._costs = [0.0] * len(self.sources)
        for i, source in enumerate(self.sources):
            if not self.payoff.asks(i) or (
                    source.cost == "expensive" and self.promised(self._merge(max_tokens)) >= self.fallback_below):
                self._proposals.append(None)
                continue
            start = self.stopwatch.mark()
            self._proposals.append(source.drafter.propose(context, max_tokens, params, generator))
            self.stopwatch.measure(start, self.stopwatch.mark(), functools.partial(_cost, self._costs, i, step))
        # 2. Merge into one trie and keep the nodes that pay; a tree kept on the device goes beside them unread.
        merged = self._merged = self._merge(max_tokens)
        keep, scores = self._choose(merged)
        auxiliary = next((d.auxiliary for d in self._proposals if d is not None and d.auxiliary is not None), None)
        tree = next(((i, d) for i, d in enumerate(self._proposals) if d is not None and d.layout is not None), None)
        self._beside = None if tree is None else tree[0]
        first = 0 if tree is None else len(tree[1])  # (its nodes come first)
        self._submitted = {node: first + i for i, node in enumerate(keep.tolist())}
        tokens = torch.tensor(merged.tokens, dtype=torch.long, device="cpu")[keep]
        # 3. Deterministic nodes, no probs: lossless under sampling (see the module docstring).
        all_parents = torch.tensor(merged.parents, dtype=torch.long, device="cpu")
        parents = structure.select(all_parents, keep) if self.tree else None
        self._draft = Draft(tokens=tokens, parents=parents, scores=scores, auxiliary=auxiliary)
        if tree is not None:
            self._draft = beside(tree[1], self._draft)
        return self._draft

    def _verified_part(self, source: int, draft: Draft) -> tuple[Draft, list[int]]:
        """The nodes of a source's draft that were verified, as a draft, and their submitted indices."""
        assert self._merged is not None, "observed a step whose proposals were never merged"
        mapping = self._merged.mappings[[i for i, _ in self._merged_proposals()].index(source)]
        nodes = [n for n, m in enumerate(mapping) if m in self._submitted]  # closed under ancestors
        keep = torch.tensor(nodes, dtype=torch.long, device="cpu")
        parents = structure.select(parents_of(draft), keep) if draft.is_tree else None
        return Draft(tokens=draft.tokens[keep], parents=parents), [self._submitted[mapping[n]] for n in nodes]

    def _rows(self, source: int, proposal: Draft, draft: Draft, logits: torch.Tensor) -> tuple[Draft, torch.Tensor]:
        """The verified part of a source's proposal and its rows of the logits [len(draft) + 1 (+ aux),
        vocab]: the context's, its verified nodes' (and the auxiliary tokens', if they were its own)."""
        part, rows = self._verified_part(source, proposal)
        own_auxiliary = proposal.auxiliary is not None and proposal.auxiliary is draft.auxiliary
        part.auxiliary = proposal.auxiliary if own_auxiliary else None
        picked = [logits[:1], logits[[r + 1 for r in rows]]]
        if own_auxiliary:
            picked.append(logits[len(draft) + 1 :])
        return part, torch.cat(picked)

    def observe(self, outcome: Outcome) -> None:
        """Each source hears how its own proposal would have fared verified alone (see the module
        docstring), with its rows of the logits if it needs them."""
        draft, verdict, stats = outcome.draft, outcome.verdict, outcome.stats
        if self._beside is not None:
            self._read_beside(draft)
        # the engine's gate may have cut a chain, or a batch's gate a tree: only the nodes it kept were verified
        cut = draft.is_tree and not draft.forced and self._draft is not None and len(draft) < len(self._draft)
        if cut:
            assert self._draft is not None
            where = surviving(self._draft, draft)
            self._submitted = {node: where[i] for node, i in self._submitted.items() if i in where}
        else:
            self._submitted = {node: i for node, i in self._submitted.items() if i < len(draft)}
        # per source, what its proposal alone would have had accepted (of a cut tree, of its verified nodes: a
        # source is worth its drafting for what the forward could take of it)
        accepted: list[int | None] = []
        for i, source in enumerate(self.sources):
            proposal = self._proposals[i] if i < len(self._proposals) else None
            depth = None  # the longest path of its tree, if it drafted one
            if proposal is None or not len(proposal):
                own = Verdict(num_drafted=0, num_accepted=0, tokens=verdict.tokens[:1])
            else:
                own = translate(proposal, verdict.tokens)
                self._acceptance[i].record(own)
                if own.num_drafted and proposal.parents is not None:
                    depth = int(structure.depths(proposal.parents).max())
            if proposal is not None and cut and len(proposal) and i != self._beside:
                accepted.append(translate(self._verified_part(i, proposal)[0], verdict.tokens).num_accepted)
            else:
                accepted.append(None if proposal is None else own.num_accepted)
            own_stats = dataclasses.replace(stats, drafted=own.num_drafted, accepted=own.num_accepted,
                                            draft_depth=depth)
            seen, logits = proposal if proposal is not None else Draft.empty(), None
            if source.drafter.needs.logits and proposal is not None and outcome.logits is not None:
                seen, logits = self._rows(i, proposal, draft, outcome.logits)
            hidden, blocks = None, self._blocks[i]
            if blocks is not None and outcome.hidden is not None:  # its columns, rows of the draft fed
                hidden = columns(outcome.hidden, blocks, 1 if self.hidden is True else len(self.hidden or ()))
            source.drafter.observe(Outcome(seen, own, own_stats, logits, hidden, outcome.num_pending,
                                           fed_path=verdict.path if hidden is not None else None))
        if self._proposals:  # a step the composite drafted (not one the engine played plain)
            self.stopwatch.settle()  # the sources' seconds (the verdict's read waited for their drafting)
            self.payoff.record(accepted, self._costs, verdict.num_accepted)
        self._proposals, self._merged, self._draft, self._submitted, self._beside = [], None, None, {}, None

    def _read_beside(self, verified: Draft) -> None:
        """The tree that went beside the merge, on the host: its drafter's riders and its tokens and parents came
        with the verdict when the forest was verified as submitted (else they are read now, at a wait)."""
        assert self._beside is not None and self._draft is not None
        tree = self._proposals[self._beside]
        assert tree is not None and tree.parents is not None
        first, riders = len(tree), len(tree.riders)
        if verified is self._draft and verified.read is not None and verified.parents is not None:
            tree.read, tokens = verified.read[:riders], verified.read[riders][:first]
            parents = verified.parents[:first].tolist()  # (on the host: verification's copy)
        else:  # (a grammar cut the forest, or nothing of it was verified)
            tokens, parents = devices.to_host(tree.tokens, tree.parents)
        self._proposals[self._beside] = Draft(tokens=torch.tensor(tokens, dtype=torch.long, device="cpu"),
                                              parents=torch.tensor(parents, dtype=torch.long, device="cpu"))


def _cost(costs: list[float], source: int, token_time: float, seconds: float) -> None:
    """A source's drafting seconds, in tokens' worth of time (`token_time` seconds; 0: unknown, nothing)."""
    costs[source] = seconds / token_time if token_time > 0 else 0.0


def default_sources(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> list[Source]:
    """What `build_composite` composes, in the order asked: prompt lookup (with the reference document,
    if any), retrieval (the datastore given, or the default one when the tokenizer is known), then the
    draft model when there is one. Add a source by adding a line (a free one before the draft model)."""
    sources = [Source(PromptLookupDrafter(reference_ids=options.reference_ids), "free")]
    if options.datastore is not None or options.tokenizer is not None:  # retrieval, as `rest` has it
        retrieval = build_retrieval(target, None, dataclasses.replace(options, tree=False, budget=None))
        sources.append(Source(retrieval, "free"))
    if draft is not None:
        sources.append(Source(DraftModelDrafter.for_models(draft, target), "expensive"))
    return sources


def build_composite(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> Drafter:
    """The `composite` method: `default_sources` merged into a tree sized on the target's cost curve
    (options.tree; options.budget fixes its size), or into its best chain."""
    return CompositeDrafter(default_sources(target, draft, options), target.cost_curve(),
                            tree=options.tree, budget=options.budget, device=target.device)
