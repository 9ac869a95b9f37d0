"""Medusa (Cai et al. 2024): extra decoding heads on the target's last hidden state.

The target's feature f_t (its last hidden state after the final norm, what its LM head reads) gives
token t + 1 through the LM head. Medusa head k (k = 1..K) maps the same feature through one residual
block, f_t + SiLU(W_k f_t + b_k), and the target's frozen LM head, to a guess at token t + 1 + k: all
K guesses come from one feature at once, with no autoregression among them, so a draft of K tokens
costs K small matrix products and K LM-head rows. Each block starts as the identity (W_k = 0), i.e.
as the target's own next-token prediction, and is trained to predict the target's distribution k
positions further on (`training.medusa`).

After each verification the drafter keeps the feature of the last accepted position (the one whose
logits gave the step's correction or bonus token, the newest context token): the heads then guess the
tokens after it. The draft is a chain of each head's top token, or (tree form) a token tree of the
heads' top-k choices, grown best-first by the product of the heads' probabilities (the heads guess
independently, so a path's chance is taken as the product) and cut to the budget that pays on the
target's cost curve. Drafts are deterministic: verification treats them as one-hot, so Medusa is
lossless under exact verification, greedy or sampled. Typical acceptance (`verify.typical`, method
`medusa-typical`) is the paper's lossy alternative.

The LM head the heads share can be the target's whole vocabulary or only the most frequent tokens of
the training data (the head's `vocab_ids`), a tenth of the cost on a CPU; a token outside it is never
drafted.

In a batch each sequence has a drafter of its own (`for_sequence`), and their heads run in one call a step
(`BatchedHeads`): the heads read all their weights for a few rows as for one, so a batch of sequences drafts
for about what one does.

Off the CPU, under greedy decoding or seeded sampling (`sampling.matched`) and outside a batch, a draft is read
with its verdict rather than before it (`reads_late`): the chain verified whole, the tree made on the device
(`tree.growth.top_paths`: the same best nodes as `best_first`) and pruned there to as many nodes as paid in the tree
before, so a step waits for the device once.

On a static target (`models.static`) the heads' call on one feature runs through the target's runner
(`models.graphs`: captured as a CUDA graph for each depth on a GPU), and so does a tree read late (`growth.best_paths`:
one graph for each depth and budget, in place of some eighty small operations launched one at a time); a batch's
call, whose row count varies, runs as written.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode import devices
from specdecode.drafters.base import Drafter, Memory, Needs, Outcome, late_values
from specdecode.drafters.heads import check_fits, for_drafting, head_folder, lm_head_rows, load_head, save_head
from specdecode.errors import UserError
from specdecode.models.costs import lower_median
from specdecode.models.graphs import Runner, make_runner
from specdecode.models.static import StaticCausalLM
from specdecode.tree.budget import MAX_BUDGET, Calibration, best_budget
from specdecode.tree import growth
from specdecode.types import DeviceLayout, Draft, SamplingParams
from specdecode.sampling import matched

WEIGHTS, CONFIG = "medusa.safetensors", "medusa.json"
TIMINGS = 5  # latest timings of the heads' call whose lower median prices a draft


class MedusaHeads(nn.Module):
    """K residual blocks on the target's feature: [..., d] -> [..., K, d], each read by the LM head."""

    vocab_ids: torch.Tensor  # a buffer (register_buffer), declared for the type checker

    def __init__(self, hidden_size: int, num_heads: int, vocab_ids: torch.Tensor):
        super().__init__()
        if num_heads < 1:
            raise UserError(f"Medusa needs at least one head, got {num_heads}")
        blocks = [nn.Linear(hidden_size, hidden_size) for _ in range(num_heads)]
        for block in blocks:  # each head starts as the target's own next-token prediction
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.blocks = nn.ModuleList(blocks)
        self.num_features = hidden_size
        self.register_buffer("vocab_ids", vocab_ids.long().clone(), persistent=True)  # draft index -> token id

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @property
    def hidden_size(self) -> int:
        return self.num_features  # set with the blocks: a ModuleList's items are typed as Module

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.stack([features + F.silu(block(features)) for block in self.blocks], dim=-2)

    def save(self, folder: Path, record: dict) -> None:
        shape = {"hidden_size": self.hidden_size, "num_heads": self.num_heads}
        save_head(self, folder, WEIGHTS, CONFIG, shape, record)

    @classmethod
    def load(cls, folder: Path, dtype: torch.dtype = torch.bfloat16,
             device: torch.device | str = "cpu") -> tuple[MedusaHeads, dict]:
        shape, weights, record = load_head(folder, WEIGHTS, CONFIG, "Medusa")
        heads = cls(shape["hidden_size"], shape["num_heads"], weights["vocab_ids"])
        heads.load_state_dict(weights)
        return heads.to(device=device, dtype=dtype).eval(), record


def best_first(probs: torch.Tensor, top_k: int, max_nodes: int) -> tuple[list[int], list[int], list[float]]:
    """The `max_nodes` most likely paths through the heads' top-k choices, as a tree.

    probs: [depth, V] each head's distribution. A node at depth d takes one of head d's top-k tokens;
    its score is the product of its path's probabilities. Nodes come out best first (so every prefix of
    the list is closed under ancestors): (draft indices, parents, scores). The heads' top-k reach the host
    in one transfer; the rest is host work (`best_first_of`)."""
    top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)  # [depth, k]
    p, index = devices.to_host(top.values, top.indices)
    return best_first_of(p, index, max_nodes)


def best_first_of(p: list[list[float]], index: list[list[int]], max_nodes: int
                  ) -> tuple[list[int], list[int], list[float]]:
    """`best_first` of the heads' top-k on the host: p, index [depth][k], each head's best probabilities and their
    draft indices, most likely first."""
    depth, k = len(p), len(p[0])
    # heap items: (-score, ranks along the path, parent score); popping a node pushes its first child
    # and its next sibling, which enumerates the products in decreasing order
    heap: list[tuple[float, tuple[int, ...], float]] = [(-p[0][0], (0,), 1.0)]
    node_of: dict[tuple[int, ...], int] = {}
    ids: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    while heap and len(ids) < max_nodes:
        negative, ranks, parent_score = heapq.heappop(heap)
        d, r = len(ranks) - 1, ranks[-1]
        node_of[ranks] = len(ids)
        ids.append(index[d][r])
        parents.append(node_of.get(ranks[:-1], -1))
        scores.append(-negative)
        if d + 1 < depth:
            heapq.heappush(heap, (negative * p[d + 1][0], ranks + (0,), -negative))
        if r + 1 < k:
            heapq.heappush(heap, (-parent_score * p[d][r + 1], ranks[:-1] + (r + 1,), parent_score))
    return ids, parents, scores


class BatchedHeads:
    """The heads drafting for the sequences of a batch (each its own `MedusaDrafter`, `for_sequence`) in one call:
    the first sequence asked after a step computes the distributions of every sequence whose feature is new and
    that was asked at its last step too (the heads of a composite that benched them, or whose copies run long,
    cost nothing), stacked [sequences, d], and reads their top-k in one transfer; the others find theirs ready (off
    the CPU a batch's step then waits for the heads once, not once a sequence). That call runs eagerly, even for a
    static target: its row count varies from step to step, a shape no graph replays (a lone sequence's call goes through
    the runner, `MedusaDrafter.distributions`)."""

    def __init__(self) -> None:
        self.members: weakref.WeakSet[MedusaDrafter] = weakref.WeakSet()

    def distributions(self, asking: MedusaDrafter, depth: int) -> torch.Tensor:
        """[depth, V'] the asking sequence's first `depth` heads' distributions over the draft vocabulary."""
        if asking._probs is None or len(asking._probs) < depth:
            due = [asking] + [m for m in self.members if m is not asking and m._probs is None and m.wanted]
            start = asking.stopwatch.mark()
            if len(due) == 1:  # as the drafter computes them alone, row for row
                asking._probs = asking.distributions(asking.feature, depth)
            else:
                features = torch.stack([m.feature for m in due])  # [sequences, d]
                probs = asking.distributions(features, asking.heads.num_heads)  # [sequences, heads, V']
                top = probs.topk(min(asking.top_k, probs.shape[-1]), dim=-1)  # [sequences, heads, k] (twins' k)
                for member, rows, values, indices in zip(due, probs, *devices.to_host(top.values, top.indices)):
                    member._probs, member._top = rows, (values, indices)
            # each sequence's share of the call prices its tree (the twins share their timings)
            asking.stopwatch.measure(start, asking.stopwatch.mark(),
                                     lambda seconds: asking._timings.appendleft(seconds / len(due)))
        assert asking._probs is not None
        return asking._probs[:depth]


class MedusaDrafter(Drafter):
    """Drafts with Medusa heads: a chain of each head's top token, or (tree=True) the best-first tree of
    their top-k choices. Scores (path probabilities times the running ratio of accepted tokens to
    predicted ones) let the engine cut a chain, and set a tree's size, to what pays on the target's cost
    curve."""

    name = "medusa"
    needs = Needs(hidden=True)
    catches_up = False  # it reads the last token's state, which every forward returns
    batchable = True  # its heads run for a batch's sequences in one call (`BatchedHeads`)

    def __init__(self, heads: MedusaHeads, target_model, curve=None, tree: bool = False, top_k: int = 8,
                 max_nodes: int = 64, budget: int | None = None, full_vocabulary: bool = False,
                 draft_cost: float | None = None, clock: Callable[[], float] | None = None, runner: str | None = None,
                 backend: str = "inductor"):
        if tree and curve is None and budget is None:
            raise ValueError("a Medusa tree needs the target's cost curve or a fixed budget")
        if top_k < 1 or max_nodes < 1:
            raise UserError(f"Medusa needs top_k >= 1 and max_nodes >= 1; got {top_k}, {max_nodes}")
        lm_head = target_model.get_output_embeddings()
        device = target_model.get_input_embeddings().weight.device  # the target's
        vocab_ids = torch.arange(lm_head.out_features, device="cpu") if full_vocabulary else heads.vocab_ids.cpu()
        # draft index -> token id: on the device for chains (drafted there), on the host for trees (built there)
        self.vocab_ids, self.host_vocab_ids = vocab_ids.to(device), vocab_ids
        # the heads as they draft: float32 on the target's device, on the quantized kernels where that is a
        # CPU that has them; float layers where their call runs through a static target's runner (the quantized
        # kernels are the CPU's dynamic path's, and no graph traces them)
        rows = lm_head.weight.detach() if full_vocabulary else lm_head_rows(target_model, vocab_ids)  # [V', d]
        self.heads, self.lm_head = for_drafting(heads, rows, quantize=runner is None)
        # `runner`: a static target's (`build_medusa`; "eager", "compile" or CUDA "graphs", `models.graphs`), which
        # runs the heads' call on one feature, a shape fixed for each depth; None: the call as written
        self.runner: Runner | None = None if runner is None else make_runner(runner, self._distributions,
                                                                              device, backend)
        # a tree read late, made from the heads' distributions (`growth.best_paths`): through the runner too
        self.tree_runner = make_runner(runner or "eager", growth.best_paths, device, backend)
        self.dtype = torch.float32
        self.curve, self.tree, self.top_k, self.max_nodes, self.budget = curve, tree, top_k, max_nodes, budget
        if draft_cost is not None and not draft_cost >= 0:
            raise UserError(f"draft cost must be at least 0, got {draft_cost}")
        # What the heads' call costs, for a tree's budget: the lower median of its latest timings over the
        # target's one-token time, where the curve has that time (a measured one); before the first timing,
        # or on a curve without it, `draft_cost` (None: free). Timed without waiting for the device
        # (`devices.stopwatch`); `clock`: a fixed clock instead (a test's).
        self.draft_cost = draft_cost
        self.stopwatch = devices.stopwatch(device, clock)
        self._timings: deque[float] = deque(maxlen=TIMINGS)  # shared with the batch's twins (`for_sequence`)
        self._calibration = Calibration()
        self._batched: BatchedHeads | None = None  # the heads' call shared by a batch's sequences (`for_sequence`)
        # Off the CPU, greedy or seeded and outside a batch, a draft after a sequence's first is read with its
        # verdict (`Draft.riders`): a chain verified whole, a tree made and pruned on the device (`tree.growth`) to
        # as many nodes as paid in the one before (a composite verifies such a tree beside its merged sources)
        self.reads_late = device.type != "cpu"
        self.begin([])

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self._feature: torch.Tensor | None = None  # the target's feature at the context's last-but-one token
        self._valid_for = -1  # the context length that feature belongs to
        self._length = len(prompt_ids)  # the context's length, followed from the verdicts
        self._scores = torch.empty(0, device="cpu")
        self._calibration.reset()
        self._probs: torch.Tensor | None = None  # [heads, V'] from the feature, once computed (`BatchedHeads`)
        self._top: tuple[list, list] | None = None  # their top-k on the host, [heads][k] each, read with a batch's
        self._asked = self.wanted = False  # asked at this step; at the last one
        self.late_budget: int | None = None  # nodes of the next tree read late (None: read this one first)
        self._late: Draft | None = None  # the draft read late, before its observe

    def for_sequence(self, memory: Memory | None = None) -> MedusaDrafter:
        if self._batched is None:
            self._batched = BatchedHeads()
        twin = copy.copy(self)  # the heads, the LM head's rows and their batched call shared
        twin._calibration = Calibration()
        twin.begin([])
        self._batched.members.add(twin)
        return twin

    def end(self) -> None:
        if self._batched is not None:
            self._batched.members.discard(self)

    @property
    def feature(self) -> torch.Tensor:
        assert self._feature is not None, "no feature before the first verification"
        return self._feature

    def observe(self, outcome: Outcome) -> None:
        # the row whose logits gave the verdict's last token: the deepest accepted node, else the last
        # context token fed; the context then gains the accepted nodes and that token
        path, pending = outcome.accepted_path, outcome.num_pending
        row = pending + path[-1] if path else pending - 1
        self._feature = outcome.require_hidden()[row].to(self.dtype)  # [d]
        self._probs, self._top, self.wanted, self._asked = None, None, self._asked, False
        self._length += len(path) + 1
        self._valid_for = self._length
        if self._late is not None:  # its scores came with the verdict (else they are read now)
            draft, self._late = self._late, None
            read = late_values(draft)
            factor = self._calibration.factor
            self._scores = torch.tensor([min(s * factor, 1.0) for s in read[0]], device="cpu")
            if self.tree:  # the next tree's size: what would have paid of this one's best nodes
                ranked = [min(s * factor, 1.0) for s in read[1]]
                self.late_budget = max(self.budget or best_budget(ranked, self.curve, self.price(),
                                                                  cap=MAX_BUDGET - 1), 1)
        self._calibration.record_verdict(self._scores, outcome.verdict)

    def price(self) -> float:
        """A draft's price in one-token target forwards (see `__init__`)."""
        target = getattr(self.curve, "seconds", 0.0)
        if not self._timings or not target > 0:
            return self.draft_cost or 0.0
        return lower_median(self._timings) / target

    @torch.inference_mode()
    def distributions(self, feature: torch.Tensor, depth: int) -> torch.Tensor:
        """[..., depth, V'] the first `depth` heads' distributions over the draft vocabulary, from features [..., d]:
        one feature [d] through the runner where there is one (`__init__`), several (a batch's) as written."""
        if self.runner is not None and feature.dim() == 1:
            return self.runner((feature,), (depth,))
        return self._distributions(feature, depth)

    def _distributions(self, feature: torch.Tensor, depth: int) -> torch.Tensor:
        states = self.heads(feature)[..., :depth, :]  # [..., depth, d]
        return torch.softmax(self.lm_head(states).float(), dim=-1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Run the heads' call on one feature once for each depth (captured or compiled, by the runner), so that
        drafting does not pay for it."""
        feature = torch.zeros(self.heads.hidden_size, dtype=self.dtype, device=self.vocab_ids.device)
        for depth in range(1, self.heads.num_heads + 1):
            self.distributions(feature, depth)

    def propose(self, context: list[int], max_tokens: int, params: SamplingParams, generator) -> Draft:
        if self._feature is None or self._valid_for != len(context) or max_tokens <= 0:
            return Draft.empty()
        depth = min(self.heads.num_heads, max_tokens)
        self._asked = True
        if self._batched is not None and self in self._batched.members:
            probs = self._batched.distributions(self, depth)
        else:
            start = self.stopwatch.mark()
            probs = self.distributions(self._feature, depth)
            self.stopwatch.measure(start, self.stopwatch.mark(), self._timings.appendleft)
        factor = self._calibration.factor
        late = self.reads_late and matched(params, generator) and self._batched is None
        if late and (not self.tree or self.late_budget is not None):
            return self._read_late(probs, depth)
        if not self.tree and self._top is not None:  # each head's best, read with the batch's (`BatchedHeads`)
            best = torch.tensor([row[0] for row in self._top[0][:depth]], dtype=probs.dtype, device="cpu")
            self._scores = (torch.cumprod(best, 0) * factor).clamp(max=1.0)
            index = torch.tensor([row[0] for row in self._top[1][:depth]], dtype=torch.long, device="cpu")
            return Draft(tokens=self.host_vocab_ids[index], scores=self._scores)
        if not self.tree:
            p, index = probs.max(dim=-1)  # [depth] each
            # the scores reach the host in one transfer (the engine cuts the chain by them); the tokens stay
            scores = (torch.cumprod(p, 0) * factor).clamp(max=1.0)
            self._scores = torch.tensor(devices.to_host(scores)[0], dtype=scores.dtype, device="cpu")
            return Draft(tokens=self.vocab_ids[index], scores=self._scores)
        if self._top is not None:  # read with the batch's other sequences' (`BatchedHeads`)
            ids, parents, raw = best_first_of(self._top[0][:depth], self._top[1][:depth], self.max_nodes)
        else:
            ids, parents, raw = best_first(probs, self.top_k, self.max_nodes)
        node_scores = [min(s * factor, 1.0) for s in raw]  # best first, so already descending
        n = self.budget or best_budget(node_scores, self.curve, self.price(), cap=MAX_BUDGET)
        n = min(n, len(ids))
        if late:
            self.late_budget = max(min(n, MAX_BUDGET - 1), 1)
        if n == 0:
            return Draft.empty()
        self._scores = torch.tensor(node_scores[:n], device="cpu")
        return Draft(tokens=self.host_vocab_ids[torch.tensor(ids[:n], device="cpu")],
                     parents=torch.tensor(parents[:n], device="cpu"), scores=self._scores)


    def _read_late(self, probs: torch.Tensor, depth: int) -> Draft:
        """The draft made on the device and read with its verdict (`__init__`): a chain of each head's top token,
        verified whole; or the heads' tree (`tree.growth.top_paths`), its `late_budget` best nodes kept there and
        verified there (`Draft.layout`). Its scores come back with the verdict (`observe`)."""
        if not self.tree:
            p, index = probs.max(dim=-1)  # [depth] each
            self._late = Draft(tokens=self.vocab_ids[index], riders=(torch.cumprod(p, 0),))
            return self._late
        assert self.late_budget is not None
        kept_ids, kept_parents, kept_scores, above, depths, best = self.tree_runner(
            (probs,), (self.top_k, self.max_nodes, self.late_budget))
        self._late = Draft(tokens=self.vocab_ids[kept_ids], parents=kept_parents,
                           scores=(kept_scores * self._calibration.factor).clamp(max=1.0),
                           layout=DeviceLayout(above, depths), riders=(kept_scores, best))
        return self._late

def build_medusa(target, draft, options) -> Drafter:
    """The `medusa` method: the heads trained for the target (`specdecode train medusa`): `options.head`, else
    those shipped for the default target; a chain of their top tokens, or their tree with `options.tree`."""
    model, folder = head_folder(target, "medusa", options.head)
    heads, record = MedusaHeads.load(folder, dtype=model.dtype, device=model.device)
    vocab_ids: torch.Tensor = heads.vocab_ids
    check_fits(folder, "medusa", record, heads.hidden_size, int(vocab_ids.max()) + 1, model.config)
    # on a static target (`models.static`) the heads' call runs through its runner, as its forwards do
    static = isinstance(target, StaticCausalLM)
    runner, backend = (target.runner_name, target.backend) if static else (None, "inductor")
    if options.tree:
        return MedusaDrafter(heads, model, target.cost_curve(), tree=True, budget=options.budget, runner=runner,
                             backend=backend)
    return MedusaDrafter(heads, model, runner=runner, backend=backend)


def build_medusa_tree(target, draft, options) -> Drafter:
    """`medusa-typical`: Medusa's tree, always (typical acceptance judges paths through a tree)."""
    return build_medusa(target, draft, dataclasses.replace(options, tree=True))
