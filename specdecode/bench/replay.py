"""Replay a model-free drafter against plain greedy outputs already recorded, without running the target.

Under greedy decoding, verification accepts a draft token exactly when it equals the token plain
decoding produced there, so the target's recorded greedy output is all a replay needs: each step the
drafter proposes after the context so far, the engine's gate cuts the draft on the cost curve, and the
accepted tokens are the draft's agreement with the recorded output (down the tree, for a tree draft).
The predicted speedup prices every step's target forward on the cost curve. It is exact for drafters
that need no model (prompt lookup, retrieval, suffix caches), up to near-ties where batched numerics
flip an argmax, and takes seconds instead of an hour of model time, which is what tuning their
policies (priors, gates, budgets) needs. `benchmarks/copy_acceptance.py` uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.drafters.base import Drafter, Outcome
from specdecode.models.costs import CostCurve
from specdecode.tree import structure
from specdecode.tree.budget import cut_chain
from specdecode.types import Draft, SamplingParams, StepStats, Verdict


@dataclass(frozen=True)
class ReplayStep:
    drafted: int
    accepted: int
    forward_tokens: int  # what the step's target forward carried (pending context + draft)
    cost: float  # that forward on the cost curve, in single-token forwards


def _accept(draft: Draft, reference: list[int]) -> tuple[int, ...]:
    """The accepted nodes: the longest path of the draft that agrees with the reference tokens."""
    parents = draft.parents if draft.parents is not None else torch.arange(len(draft)) - 1
    tokens = draft.tokens.tolist()
    children = structure.children(parents)  # [i + 1]: node i's; [0]: the context's
    path: list[int] = []
    while len(path) < len(reference):
        candidates = children[path[-1] + 1 if path else 0]
        node = next((i for i in candidates if tokens[i] == reference[len(path)]), None)
        if node is None:
            break
        path.append(node)
    return tuple(path)


def replay(
    drafter: Drafter | None, prompt: list[int], output: list[int], curve: CostCurve, gate: bool = True,
    max_new_tokens: int | None = None,
) -> list[ReplayStep]:
    """The steps speculative decoding with `drafter` takes to produce `output` (plain greedy decoding's
    recorded output after `prompt`); None replays plain decoding. `max_new_tokens`: the generation's
    budget, which is the drafter's room as in the engine (it cannot know the output ends early, at an
    end-of-sequence token); None: the output's length."""
    budget = len(output) if max_new_tokens is None else max(max_new_tokens, len(output))
    params = SamplingParams()
    if drafter is not None:
        drafter.begin(list(prompt))
    steps: list[ReplayStep] = []
    done, cached = 0, 0
    while done < len(output):
        context = prompt + output[:done]
        room = budget - done - 1
        draft = drafter.propose(context, room, params, None) if drafter is not None and room > 0 else Draft.empty()
        pending = len(context) - cached
        if gate:
            draft = cut_chain(draft, curve, pending)
        path = _accept(draft, output[done:])  # nothing past the output's end is accepted
        verdict = Verdict(num_drafted=len(draft), num_accepted=len(path),
                          tokens=tuple(output[done : done + len(path) + 1]), path=path,
                          bonus=(not structure.children(draft.parents)[path[-1] + 1]
                                 if draft.parents is not None and path else None))
        forward_tokens = pending + len(draft)
        steps.append(ReplayStep(len(draft), len(path), forward_tokens, curve(forward_tokens)))
        if drafter is not None:
            stats = StepStats(len(draft), len(path), len(path) + 1, 0.0, 0.0, forward_tokens)
            drafter.observe(Outcome(draft, verdict, stats, num_pending=pending))
        cached = len(context) + len(path)
        done += len(path) + 1
    return steps


def predicted_speedup(method: list[list[ReplayStep]], plain: list[list[ReplayStep]]) -> float:
    """Plain decoding's total cost over the method's, for the same outputs."""
    return sum(s.cost for run in plain for s in run) / sum(s.cost for run in method for s in run)
