"""Replaying a recorded acceptance (`bench.acceptance`) on other models of the same shapes: how fast a method runs
at the acceptance it has on real text, on a machine that cannot hold the real models (random weights there
accept nothing). Every figure made this way is labelled "replayed acceptance".

At every step the real drafter runs in full (its whole cost is paid: its model's forwards, its tree's growth),
then its proposal is replaced by a draft of the recorded step's shape whose tokens make the target accept
exactly the recorded number (`replayed_draft`): along the recorded accepted path, the target's own greedy
continuation of the prompt (`reference_continuation`); everywhere else a token certainly rejected (the
continuation's token at that depth, plus one). The real drafter then observes the step's outcome as if it had
drafted it: what drafters read there (the verdict, the accepted path, the target's hidden states of the fed
draft) all describe the replayed draft, so their state follows the replayed run. A recorded plain step (the
step-aside switch's) is replayed as one, without asking the drafter. The engine's gate and step-aside switch
are off: the recorded shape is what the target verified after the gate.

What this does not replay: the real drafter decides what it drafts from the machine it runs on (its length, its
tree, from that machine's cost curve), so it may pay for more or fewer tokens than it drafted where the run was
recorded (`Replayer.proposed` has its sizes); a draft model drafting on the host path (`stops_early`) keeps its
own tokens as what it has seen, so it feeds the accepted replayed tokens again at the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specdecode.bench.acceptance import RecordedRun, RecordedStep, Wrapped
from specdecode.drafters.base import Drafter, Outcome
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.models.base import CausalLM
from specdecode.tree import structure
from specdecode.types import Draft, SamplingParams


def replayed_draft(step: RecordedStep, ahead: list[int], vocab: int, max_depth: int) -> Draft:
    """A draft of `step`'s shape (its nodes deeper than `max_depth` or than `ahead` reaches left out) that a
    greedy target whose own continuation is `ahead` accepts exactly along the step's accepted path."""
    parents = list(step.parents) if step.parents is not None else list(range(-1, step.drafted - 1))
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    keep = [node for node, depth in enumerate(depths) if depth <= min(max_depth, len(ahead))]
    path = set(step.accepted_path)
    tokens = [ahead[depths[node] - 1] if node in path else (ahead[depths[node] - 1] + 1) % vocab for node in keep]
    ids = torch.tensor(tokens, dtype=torch.long, device="cpu")  # [kept]
    if step.parents is None:
        return Draft(tokens=ids)
    kept = structure.select(torch.tensor(parents, dtype=torch.long, device="cpu"),
                            torch.tensor(keep, dtype=torch.long, device="cpu"))
    return Draft(tokens=ids, parents=kept)


class Replayer(Wrapped):
    """Wraps the real drafter of a replayed run (module docstring). `continuation`: the target's greedy output
    after the prompt; `clock`: read before and after each real proposal (`devices.clock(device)` waits for the
    device at every reading, so the seconds are the drafting's whole cost). Per step it keeps the real
    proposal's size (`proposed`), its seconds (`draft_seconds`), the replayed verdict's accepted count
    (`accepted`) and the count the replayed draft was made for (`expected`: the recorded one, less what a draft
    cut to the room left could not hold, as when the recorded run ended at an EOS within a step)."""

    def __init__(self, inner: Drafter, steps: list[RecordedStep], continuation: list[int], vocab: int,
                 clock: Callable[[], float] = time.perf_counter):
        super().__init__(inner)
        self.steps, self.continuation, self.vocab, self.clock = steps, continuation, vocab, clock
        self._prompt = self._index = self._expected = 0
        self.proposed: list[int] = []
        self.draft_seconds: list[float] = []
        self.accepted: list[int] = []
        self.expected: list[int] = []

    def begin(self, prompt_ids: list[int], forget: bool = False) -> None:
        self._prompt, self._index, self._expected = len(prompt_ids), 0, 0
        self.proposed, self.draft_seconds, self.accepted, self.expected = [], [], [], []
        super().begin(prompt_ids, forget)

    def propose(self, context: list[int], max_tokens: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        step = self.steps[self._index] if self._index < len(self.steps) else None
        self._index += 1
        if step is None or step.aside:  # past the recording (the replay parted from it), or a plain step
            self.proposed.append(0)
            self.draft_seconds.append(0.0)
            return Draft.empty()
        start = self.clock()
        real = self.inner.propose(context, max_tokens, params, generator)
        self.draft_seconds.append(self.clock() - start)
        self.proposed.append(len(real))
        if step.drafted == 0:
            return Draft.empty()
        ahead = self.continuation[len(context) - self._prompt:]
        self._expected = min(step.accepted, max_tokens, len(ahead))  # the path's nodes the cut draft keeps
        return replayed_draft(step, ahead, self.vocab, max_tokens)

    def observe(self, outcome: Outcome) -> None:
        self.accepted.append(outcome.verdict.num_accepted)
        self.expected.append(self._expected)
        self._expected = 0
        super().observe(outcome)


def reference_continuation(target: CausalLM, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """The target's plain greedy output after the prompt (EOS ignored)."""
    engine = SpeculativeEngine(target, None, None, gate=False, step_aside=False)
    return engine.generate(prompt_ids, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)).token_ids


def replay_engine(target: CausalLM, drafter: Drafter, run: RecordedRun, continuation: list[int],
                  clock: Callable[[], float] = time.perf_counter) -> tuple[SpeculativeEngine, Replayer]:
    """An engine replaying `run` with the real `drafter` (gate and step-aside off), and its Replayer."""
    replayer = Replayer(drafter, run.steps, continuation, target.vocab_size, clock)
    return SpeculativeEngine(target, None, replayer, method=run.method, gate=False, step_aside=False), replayer


def replay_config(run: RecordedRun) -> GenerationConfig:
    """As many new tokens as the recorded run made (EOS ignored: a random-weight target has none to stop at)."""
    return GenerationConfig(max_new_tokens=max(len(run.output_ids), 1), ignore_eos=True)


def settled_continuation(target: CausalLM, make_drafter: Callable[[], Drafter], run: RecordedRun,
                         tries: int = 2) -> list[int]:
    """The continuation the replay reproduces: the plain greedy one, or, where a forward over a draft rounds
    otherwise than one-token forwards (bfloat16: a near-tie of the target's two best logits), the replayed
    run's own output, replayed again, `tries` times at most."""
    config = replay_config(run)
    continuation = reference_continuation(target, run.prompt_ids, config.max_new_tokens)
    for _ in range(tries):
        engine, _ = replay_engine(target, make_drafter(), run, continuation)
        output = engine.generate(run.prompt_ids, config).token_ids
        if output == continuation:
            break
        continuation = output
    return continuation


def agreement(run: RecordedRun, replayer: Replayer) -> dict:
    """How far a replay reproduced its recording: steps, tokens per step, the steps whose accepted count matched,
    and the drafts' sizes (recorded, replayed, and what the real drafter proposed)."""
    recorded = [s.accepted for s in run.steps]
    steps = max(len(replayer.accepted), 1)
    return {"steps_recorded": len(recorded), "steps_replayed": len(replayer.accepted),
            "steps_equal": sum(a == b for a, b in zip(replayer.expected, replayer.accepted)),
            # every step accepted what its replayed draft was made for, and the recording's steps were all replayed
            "exact": replayer.expected == replayer.accepted and len(recorded) == len(replayer.accepted),
            "recorded_tokens_per_step": run.tokens_per_step,
            "replayed_tokens_per_step": len(run.output_ids) / steps,  # the replay makes as many tokens
            "recorded_drafted_per_step": sum(s.drafted for s in run.steps) / max(len(run.steps), 1),
            "proposed_per_step": sum(replayer.proposed) / steps}


def relative_cost(curve: dict[int, float], width: int) -> float:
    """A forward's cost at `width` new tokens relative to one token's, from a curve measured at some widths: the
    narrowest measured width that holds it (the static path pads to its bucket), past the widest in proportion."""
    wider = [w for w in curve if w >= width]
    if wider:
        return curve[min(wider)]
    widest = max(curve)
    return curve[widest] * width / widest
