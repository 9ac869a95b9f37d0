"""The draft model grows a token tree instead of a chain: EAGLE-2's dynamic tree, or a fixed shape.

Dynamic (EAGLE-2, Li et al. 2024): every node scores the product of the draft probabilities along its
path, an estimate of the chance that verification accepts it. Starting from the context's top-k tokens,
each round feeds the `width` best-scoring nodes of the newest layer through the draft model in one
forward (a tree attention mask over the draft's own cache) and adds each one's top-k tokens as children.
Rounds stop at `max_depth`, or earlier once the accepted tokens another round could add are worth less
than the draft forward costs. Then the best nodes by score are kept: a fixed number (`budget`), or the
number that maximises expected tokens per unit of time on the target's measured cost curve.

Both decisions leave out the drafting already spent in the step (sunk: it is paid whatever follows). It
used to count, and it includes the draft model catching up on the context (the whole prompt at a
sequence's first step, the skipped tokens after plain steps), so after a long catch-up any tree looked
cheap beside it, and trees far wider than paid were verified at those steps for a token or two
(docs/results/int4-target.md).

Where the tree grows: on the host where the draft runs on the CPU (each round's top tokens read there, and the
decision whether another round pays made on this step's scores: reading costs nothing on a CPU), else on the
device (`tree.growth`): every round queued without a read, and the number of rounds chosen before it starts,
from the tree before: as many as the same rule says paid there, one more where all did. A sequence's first such
tree is read whole and pruned on the host as above; under greedy decoding or seeded sampling (`sampling.matched`)
every later one is also pruned on the device, to as many nodes as paid in the tree before, and goes to the engine
with its structure there (`Draft.layout`), verified there and read with its verdict, which brings this drafter the
scores it learns from too. So a step on a GPU waits for the device once, however deep the tree.

Fixed shape: the same rounds, but the nodes to expand and the ranks of their children come from a
Medusa/EAGLE "choices" list, for comparison with the dynamic tree.

Children are the draft's top-k tokens, fixed rather than sampled, so the tree verifier treats them as
one-hot proposals: lossless under sampling too, and the children of a node are accepted together with
the target's probability of any of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode import devices
from specdecode.drafters.base import Drafter, Outcome, late_values
from specdecode.drafters.draft_model import DraftModelDrafter, SyncedCache, late_start
from specdecode.drafters.options import DrafterOptions, check_budget
from specdecode.drafters.other_tokenizer import OtherTokenizerDrafter
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.models import costs
from specdecode.models.costs import CostCurve
from specdecode.sampling import logits_to_probs, matched
from specdecode.tree import structure
from specdecode.tree.budget import MAX_BUDGET, Calibration, best_budget, prune
from specdecode.tree import growth
from specdecode.tree.growth import DeviceTree, positive, read_tree
from specdecode.types import DeviceLayout, Draft, SamplingParams

FIRST_ROUNDS = 5  # growing rounds of a sequence's first tree grown on the device, before a tree says what pays


class _Growing:
    """The tree while it grows: parallel lists, one entry per node."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []  # product of the draft probabilities from the context to the node
        self.shape: list[int] = []  # the node's index in the fixed shape (-1 for dynamic trees)

    def add(self, token: int, parent: int, score: float, shape: int = -1) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.shape.append(shape)
        return len(self.tokens) - 1

    def score(self, node: int) -> float:
        return 1.0 if node == structure.ROOT else self.scores[node]

    def ancestors(self, node: int) -> set[int]:
        found = set()
        while node != structure.ROOT:
            found.add(node)
            node = self.parents[node]
        return found


class DraftModelTreeDrafter(Drafter):
    name = "draft-tree"

    def __init__(
        self,
        model: CausalLM,
        curve: CostCurve,
        draft_cost: float | None = None,  # a draft forward in one-token target forwards (`for_models` measures it)
        top_k: int = 3,
        width: int = 3,
        max_depth: int = 20,
        budget: int | None = None,
        choices: Sequence[Sequence[int]] | None = None,
        draft_curve: CostCurve | None = None,
    ):
        if not (top_k >= 1 and width >= 1 and max_depth >= 1):
            raise UserError(f"a draft tree needs top_k, width and max_depth >= 1, got {top_k}, {width}, {max_depth}")
        check_budget(budget)
        if draft_cost is not None and not draft_cost > 0:
            raise UserError(f"draft cost must be positive, got {draft_cost}")
        if draft_cost is None and choices is None and model is not None:
            raise UserError("a draft tree grows while another round pays for its cost: "
                            f"{type(self).__name__}.for_models(draft, target) measures it on this machine; else "
                            "pass draft_cost (a draft forward in one-token target forwards), or a fixed shape "
                            "(choices)")
        self.model, self.curve, self.draft_cost = model, curve, draft_cost
        self.draft_curve = draft_curve or curve  # the draft model's own width costs, else the target's shape
        self.top_k, self.width, self.max_depth, self.budget = top_k, width, max_depth, budget
        self.shape_parents = self.shape_ranks = None
        if choices is not None:
            self.shape_parents, self.shape_ranks = structure.from_choices(choices)
            if model is not None and len(self.shape_ranks) and int(self.shape_ranks.max()) >= model.vocab_size:
                raise UserError(f"the tree's choices rank up to {int(self.shape_ranks.max())}, past the draft "
                                f"model's vocabulary of {model.vocab_size} tokens")
            self.shape_children = structure.children(self.shape_parents)
            self.max_depth = int(structure.depths(self.shape_parents).max())
        self._cache = SyncedCache(model, late_start(draft_cost, draft_curve, curve, range(0, max_depth + 1)))
        # on the host or on the device (module docstring); a head's drafter says where its head runs
        self.grows_on_host = model is None or model.device.type == "cpu"
        self.rounds = FIRST_ROUNDS  # growing rounds of the next tree grown on the device
        # how many nodes a tree grown on the device keeps, pruned there to be read with its verdict (greedy or seeded
        # sampling; a composite verifies it beside its merged sources); None: read this one and choose
        self.late_budget: int | None = None
        self._late: tuple[Draft, list[int], int] | None = None  # (a draft kept on the device, layer sizes, rounds)
        self._calibration = Calibration()
        self._predicted = 0.0  # the accepted tokens the last tree's scores predicted
        self.last_scores = torch.empty(0, device="cpu")

    @classmethod
    def for_models(cls, draft: CausalLM, target: CausalLM, **options) -> DraftModelTreeDrafter:
        """Priced from both models' cost curves, measured once per machine (`models.costs`), as
        `DraftModelDrafter.for_models` prices a chain."""
        return cls(draft, target.cost_curve(), draft_cost=costs.draft_cost(draft, target),
                   draft_curve=draft.cost_curve(), **options)

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self._cache.reset(len(prompt_ids))
        self._calibration.reset()
        self.rounds, self.late_budget, self._late = FIRST_ROUNDS, None, None

    def _distributions(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[rows, vocab] logits -> the draft's distributions the scores come from."""
        return logits.float().softmax(-1) if params.greedy else logits_to_probs(logits, params)

    def _root(self, start: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """`_start`'s output -> the draft's distribution after the context [1, vocab]."""
        return self._distributions(start, params)

    def _add_children(self, tree: _Growing, parents: list[int], probs: torch.Tensor) -> list[int]:
        """Add each parent's children (top-k, or the shape's ranks) given its distribution row (probs:
        [len(parents), vocab]); the top tokens of every row reach the host in one transfer."""
        wanted: list[tuple[Sequence[int], list[int]]] = []  # (ranks, shape nodes) of each parent
        for parent in parents:
            if self.shape_ranks is None:  # no fixed shape
                wanted.append((range(self.top_k), [-1] * self.top_k))
            else:
                shape_nodes = self.shape_children[tree.shape[parent] + 1 if parent != structure.ROOT else 0]
                wanted.append(([int(self.shape_ranks[s]) for s in shape_nodes], shape_nodes))
        k = max((max(ranks) + 1 for ranks, _ in wanted if ranks), default=0)
        if k == 0:
            return []
        top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)  # [parents, k]
        values, indices = devices.to_host(top.values, top.indices)
        new = []
        for parent, (ranks, shape_nodes), row_values, row_indices in zip(parents, wanted, values, indices):
            for rank, shape_node in zip(ranks, shape_nodes):
                p = row_values[rank]
                if p > 0:  # a token the processed distribution excludes would never be accepted
                    new.append(tree.add(int(row_indices[rank]), parent, tree.score(parent) * p, shape_node))
        return new

    def _to_expand(self, tree: _Growing, frontier: list[int], coverage: float) -> list[int]:
        """Which nodes of the newest layer the next round feeds ([] to stop growing)."""
        if self.shape_parents is not None:
            return [node for node in frontier if self.shape_children[tree.shape[node] + 1]]
        return self._paying(tree.scores, frontier, coverage)

    def _paying(self, scores: list[float], frontier: Sequence[int], coverage: float) -> list[int]:
        """The `width` best of `frontier` (nodes of a tree whose nodes so far score `scores`) where another round
        over them pays, else []. `coverage`: how much of its parents' score the newest layer carries."""
        best = sorted(frontier, key=lambda node: -scores[node])[: self.width]
        if not best:
            return best
        # Another round pays if what it may add, per what it costs, beats the tokens per cost that verifying
        # the tree as it stands would give (the drafting spent so far left out: it is paid either way).
        factor = self._calibration.factor
        ranked = sorted((factor * s for s in scores), reverse=True)
        n = self.budget or best_budget(ranked, self.curve, 0.0, cap=MAX_BUDGET)
        rate = (1 + sum(ranked[:n])) / self.curve(1 + n)
        gain = factor * coverage * sum(scores[node] for node in best)
        return best if gain > rate * self._round_cost(len(best)) else []

    def _round_cost(self, width: int) -> float:
        """What a growing round over `width` nodes costs, in one-token target forwards (no `draft_cost`: a
        head's tree before its rounds are timed, free)."""
        return (self.draft_cost or 0.0) * self.draft_curve(width)

    # -- the draft model's part of a step (an EAGLE head has its own: `drafters.eagle`) --------------

    def _start(self, context: list[int]) -> torch.Tensor | None:
        """Bring the draft's cache up to the context; what gives the distribution after it (`_root`): here the logits
        [1, vocab] (None: no draft)."""
        pending = self._cache.sync(context)
        logits = self.model.forward(torch.tensor(pending, device="cpu"), num_logits=1).logits  # [1, vocab]
        self._cache.seen.extend(pending)
        return logits

    def _feed(self, tree: _Growing, expand: list[int], fed: list[int], length: int, depth: int) -> torch.Tensor:
        """One draft forward over the nodes `expand` (of depth - 1), each attending to the context and its
        ancestors among `fed` (the nodes already in the draft cache, in order); their logits [width, vocab]."""
        mask = torch.zeros(len(expand), len(fed) + len(expand), dtype=torch.bool, device="cpu")  # [width, fed + width]
        for row, node in enumerate(expand):
            ancestors = tree.ancestors(node)
            mask[row, : len(fed)] = torch.tensor([f in ancestors for f in fed], dtype=torch.bool, device="cpu")
            mask[row, len(fed) + row] = True
        return self.model.forward(
            torch.tensor([tree.tokens[node] for node in expand], device="cpu"),
            # a node of depth d sits at length - 1 + d
            positions=torch.full((len(expand),), length + depth - 2, device="cpu"),
            tree_mask=mask,
        ).logits  # [width, vocab]

    def _grow_round(self, tokens: torch.Tensor, parent_rows: torch.Tensor | None, mask: torch.Tensor, length: int,
                    depth: int, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """One round of a tree grown on the device (`tree.growth`): the draft forward over the nodes `tokens` [w]
        (of depth - 1) under `mask` [w, fed + w] (the draft's cache holds the nodes fed before, in order), and
        their children: (probabilities, tokens) [w, k], on the device. `parent_rows`: a head's (`drafters.eagle`)."""
        logits = self.model.forward(tokens, positions=torch.full((tokens.numel(),), length + depth - 2, device="cpu"),
                                    tree_mask=mask).logits  # [w, vocab]
        return self._top(self._distributions(logits, params))

    def _top(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, vocab] distributions -> each row's top_k (probabilities, indices) [rows, k]."""
        top = torch.topk(probs, min(self.top_k, probs.shape[-1]), dim=-1)
        return top.values, top.indices

    def _end(self, length: int) -> None:
        self.model.crop(length)  # the draft cache keeps the context only

    def propose(self, context, max_tokens, params, generator) -> Draft:
        depth_limit = min(self.max_depth, max_tokens)
        if depth_limit <= 0 or not self._cache.ready(context, max_tokens):
            return Draft.empty()
        length = len(context)
        logits = self._start(context)
        if logits is None:
            return Draft.empty()
        on_device = not self.grows_on_host and self.shape_parents is None
        rounds = max(min(self.rounds, depth_limit - 1), 0)  # a tree grown on the device
        if on_device and matched(params, generator) and self.late_budget is not None:
            draft = self._late_draft(logits, params, length, rounds, self.late_budget)
            self._end(length)
            return draft
        tree = _Growing()
        if not on_device:
            self._grow_on_host(tree, logits, params, length, depth_limit)
        else:
            self._grow_on_device(tree, logits, params, length, rounds)
        self._end(length)
        if not tree.tokens:
            return Draft.empty()
        # 3. Keep the best nodes: the fixed budget, or the one that maximises expected tokens per cost.
        parents, scores = torch.tensor(tree.parents, device="cpu"), torch.tensor(tree.scores, device="cpu")
        budget = self.budget
        if budget is None and self.shape_parents is not None:
            budget = len(tree.tokens)  # a fixed shape is verified whole
        elif budget is None:
            ranked = sorted((self._calibration.factor * s for s in tree.scores), reverse=True)
            budget = max(best_budget(ranked, self.curve, 0.0, cap=MAX_BUDGET), 1)
        keep = prune(parents, scores, self.curve, budget)
        self.last_scores = scores[keep]  # [kept] the kept nodes' cumulative draft probabilities
        self._predicted = float(scores[keep].sum())
        # the scores as acceptance estimates (a composite merges trees by them; the engine verifies a tree whole)
        estimates = (self.last_scores * self._calibration.factor).clamp(max=1.0)
        return Draft(tokens=torch.tensor(tree.tokens, device="cpu")[keep], parents=structure.select(parents, keep),
                     scores=estimates)

    def _grow_on_host(self, tree: _Growing, logits: torch.Tensor, params: SamplingParams, length: int,
                      depth_limit: int) -> None:
        """Grow `tree` from the logits after the context, each round's top tokens read on the host."""
        frontier = self._add_children(tree, [structure.ROOT], self._root(logits, params))
        coverage = sum(tree.scores)  # how much of its parents' score a round of children carries
        fed: list[int] = []  # the nodes in the draft cache after the context, in order
        for depth in range(2, depth_limit + 1):  # the depth of the children this round adds
            expand = self._to_expand(tree, frontier, coverage)
            if not expand:
                break
            # 1. One draft forward over the chosen nodes, each attending to the context and its ancestors.
            logits = self._feed(tree, expand, fed, length, depth)
            fed.extend(expand)
            # 2. Their children form the next layer.
            frontier = self._add_children(tree, expand, self._distributions(logits, params))
            parents_score = sum(tree.scores[node] for node in expand)
            coverage = sum(tree.scores[node] for node in frontier) / parents_score if parents_score else 0.0

    def _grow_on_device(self, tree: _Growing, logits: torch.Tensor, params: SamplingParams, length: int,
                        rounds: int) -> None:
        """Grow `tree` from the logits after the context on the device (`tree.growth`) in `rounds` rounds, and read
        it once; then choose the next tree's rounds from this one."""
        grown, sizes = self._device_tree(logits, params, length, rounds)
        tree.tokens, tree.parents, tree.scores, starts = read_tree(*grown, sizes)
        tree.shape = [-1] * len(tree.tokens)
        self._learn(tree.scores, starts, rounds)

    def _late_draft(self, logits: torch.Tensor, params: SamplingParams, length: int, rounds: int,
                    budget: int) -> Draft:
        """A tree grown on the device and its `budget` best nodes kept there (`tree.growth.select`), as a draft whose
        structure the engine verifies on the device (`Draft.layout`): the tree is read with the verdict. The scores
        that choose the next tree's rounds and budget reach the host then (`observe`)."""
        (tokens, parents, scores), sizes = self._device_tree(logits, params, length, rounds)
        kept_tokens, kept_parents, kept_scores, above, depths = growth.select(tokens, parents, scores, budget,
                                                                             rounds + 1)
        estimates = (kept_scores * self._calibration.factor).clamp(max=1.0)
        draft = Draft(tokens=kept_tokens, parents=kept_parents, scores=estimates, layout=DeviceLayout(above, depths),
                      riders=(scores, kept_scores))
        self._late = (draft, sizes, rounds)
        return draft

    def _learn(self, scores: list[float], starts: list[int], rounds: int) -> None:
        """From a tree grown on the device in `rounds` rounds (its nodes' `scores`, its layers beginning at `starts`),
        the next one's rounds: as many as paid in this one, else one more than grew (a deeper tree may pay; a tree
        the room cut short says nothing against the rounds it did not grow), at most max_depth - 1; and its budget
        where it is kept without a read: the nodes that would pay of this one."""
        paid = self._rounds_paying(scores, starts, rounds)
        self.rounds = min(max(rounds + 1, self.rounds), self.max_depth - 1) if paid is None else paid
        budget = self.budget
        if budget is None:
            ranked = sorted((self._calibration.factor * s for s in scores), reverse=True)
            budget = best_budget(ranked, self.curve, 0.0, cap=MAX_BUDGET - 1)  # with a pending token: one bucket
        self.late_budget = max(budget, 1)

    def _device_tree(self, logits: torch.Tensor, params: SamplingParams, length: int, rounds: int
                     ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[int]]:
        """The tree's (tokens, parents, scores) [nodes] on the device after `rounds` rounds from the logits after the
        context [1, vocab], and its layers' sizes."""
        values, tokens = self._top(self._root(logits, params))  # [1, k] each
        grown = DeviceTree(values[0], tokens[0], self.width, rounds)
        sizes = [values.shape[1]]
        for depth in range(2, rounds + 2):  # the depth of the children this round adds
            node_tokens, parent_rows, mask = grown.expand()
            children = self._grow_round(node_tokens, parent_rows, mask, length, depth, params)
            grown.add(*children)
            sizes.append(children[0].numel())
        return grown.nodes(), sizes

    def _rounds_paying(self, scores: list[float], starts: list[int], grown: int) -> int | None:
        """How many of a tree's rounds paid by the host growth's rule (`_paying`), from its `scores` (its layers
        begin at `starts`; `grown` rounds grew it), asking of each layer whether a round over it pays, the newest
        too; None where every one did."""
        bounds = [*starts, len(scores)]
        coverage = sum(scores[bounds[0] : bounds[1]])
        for done in range(grown + 1):
            best = self._paying(scores[: bounds[done + 1]], range(bounds[done], bounds[done + 1]), coverage)
            if not best:
                return done
            if done < grown:
                parents_score = sum(scores[node] for node in best)
                coverage = sum(scores[bounds[done + 1] : bounds[done + 2]]) / parents_score if parents_score else 0.0
        return None

    def observe(self, outcome: Outcome) -> None:
        if self._late is not None:  # the tree kept on the device: its values came with the verdict (else read now)
            draft, sizes, rounds = self._late
            self._late = None
            scores, kept = late_values(draft)
            self.last_scores = torch.tensor(kept, device="cpu")
            self._predicted = float(sum(kept))
            self._learn(*positive(scores, sizes), rounds)
        if outcome.verdict.num_drafted:
            self._calibration.record(self._predicted, outcome.verdict.num_accepted)


def build_draft_model(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> Drafter:
    """The `draft` method: a chain (from a draft model with another tokenizer too) or a tree."""
    if draft is None:
        raise UserError("method 'draft' needs a draft model")
    if options.draft_tokenizer is not None:
        return OtherTokenizerDrafter.for_models(draft, target, target_tokenizer=options.tokenizer,
                                                draft_tokenizer=options.draft_tokenizer)
    if not options.tree:
        return DraftModelDrafter.for_models(draft, target)
    if not draft.grows_trees:
        raise UserError("draft-tree grows its tree in the draft model's own cache, which llama.cpp cannot hold: "
                        "use draft (its chain) there, or --backend torch")
    return DraftModelTreeDrafter.for_models(draft, target, budget=options.budget, choices=options.choices)
