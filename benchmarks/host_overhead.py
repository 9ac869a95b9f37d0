"""The host's work per engine step, the target's forward left out: what a step costs besides its forward where the
forward is fast (a GPU's graphed forward of the 1.5B shape takes about 3 ms, docs/results/gpu.md) and the host's
Python is not hidden behind it. Each method runs greedily on the tests' tiny random Qwen2 (tests/conftest.py: its
forward is timed and subtracted), on a GPU's policy where a drafter has one (the heads' trees kept on the device and
read with the verdict), over fixed prompts, some of which repeat themselves so that the copy drafters find copies.

    python benchmarks/host_overhead.py [--methods ar,pld,suffix-tree,medusa-tree,auto] [--repeats 3]
                                       [--prompt-tokens 60] [--batch N]
    python benchmarks/host_overhead.py --profile auto    # the functions the host spends its time in

--batch N runs the methods in the batch engine (the server's), N sequences at once, a drafter each from one
prototype: what a batch step's host work adds to the batch's forward.

The figures are this machine's host (its CPU), not a GPU host's; compare methods and commits in one run.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from conftest import FLAT, auto_prototype, random_medusa_heads, random_prompts, tiny_qwen2  # noqa: E402
from specdecode.drafters.medusa import MedusaDrafter  # noqa: E402
from specdecode.drafters.prompt_lookup import PromptLookupDrafter  # noqa: E402
from specdecode.drafters.suffix import SuffixDrafter  # noqa: E402
from specdecode.engine import GenerationConfig, SpeculativeEngine  # noqa: E402
from specdecode.engine.batch import BatchEngine  # noqa: E402
from specdecode.models.hf import HFCausalLM  # noqa: E402

METHODS = ("ar", "pld", "suffix-tree", "medusa-tree", "auto")


def drafter(method: str, target):
    """The method's drafter on the tiny target, priced on a GPU's flat cost curve, its head on a GPU's policy."""
    if method == "ar":
        return None
    if method == "pld":
        return PromptLookupDrafter()
    if method == "suffix-tree":
        return SuffixDrafter(FLAT, tree=True)
    if method == "medusa-tree":
        made = MedusaDrafter(random_medusa_heads(target, scale=0.5), target, FLAT, tree=True, top_k=2, max_nodes=8)
        made.reads_late = True
        return made
    if method == "auto":
        return auto_prototype(target, reads_late=True)
    raise SystemExit(f"unknown method {method!r}: one of {', '.join(METHODS)}")


LENGTH = 60  # the prompts' longest (`--prompt-tokens`)


def prompts() -> list[list[int]]:
    """Six random prompts of LENGTH / 2 to LENGTH tokens, and one that repeats itself (copies to find)."""
    repeated = random_prompts(1, seed=3, low=12, high=13)[0] * (LENGTH // 10)
    return random_prompts(6, seed=4, low=LENGTH // 2, high=LENGTH) + [repeated]


def timed_target(target) -> tuple[HFCausalLM, list[float]]:
    """The target, its forwards' seconds added up in the list returned (one number, for the caller to reset)."""
    lm = HFCausalLM(target)
    spent = [0.0]
    forward = lm.forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        spent[0] += time.perf_counter() - start
        return out

    lm.forward = timed  # type: ignore[method-assign]
    return lm, spent


def run(method: str, target, tokens: int) -> tuple[float, int, int]:
    """(host seconds outside the target's forward, steps, new tokens) of the method over the prompts."""
    lm, spent = timed_target(target)
    engine = SpeculativeEngine(lm, drafter=drafter(method, target))
    engine.curve = FLAT  # (the gate's curve fixed, not timed: the same drafts in every run)
    config = GenerationConfig(max_new_tokens=tokens)
    engine.generate(prompts()[0], config)  # first-use costs out
    spent[0], steps, new = 0.0, 0, 0
    start = time.perf_counter()
    for prompt in prompts():
        result = engine.generate(prompt, config)
        steps, new = steps + len(result.steps), new + len(result.token_ids)
    return time.perf_counter() - start - spent[0], steps, new


def run_batch(method: str, target, tokens: int, slots: int) -> tuple[float, int, int]:
    """`run` in the batch engine (`engine.batch`): `slots` sequences at once, each slot taking the next prompt when
    its answer ends (the prompts twice over, so that a full batch steps for a while); each sequence's drafter made
    from one prototype, as the server makes them."""
    lm, spent = timed_target(target)
    engine = BatchEngine(lm)
    engine.curve = FLAT  # (as `run`)
    prototype = drafter(method, target)
    config = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)

    def decode(queue: list[list[int]]) -> tuple[int, int]:
        live: set[int] = set()
        steps = new = 0
        while queue or live:
            while queue and len(live) < slots:
                sequence = None if prototype is None else prototype.for_sequence(None)
                live.add(engine.add(queue.pop(0), config, sequence, method))
            events = engine.step()
            steps += 1
            for ident, event, result in events:
                new += len(event.token_ids)
                if result is not None:
                    live.discard(ident)
        return steps, new

    decode(prompts()[:slots])  # first-use costs out
    spent[0] = 0.0
    start = time.perf_counter()
    steps, new = decode(prompts() * 2)
    return time.perf_counter() - start - spent[0], steps, new


def main() -> None:
    global LENGTH
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tokens", type=int, default=100, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=5, help="runs per method, interleaved; the least is shown")
    parser.add_argument("--profile", metavar="METHOD", help="profile one method's run instead")
    parser.add_argument("--prompt-tokens", type=int, default=LENGTH, help="the longest prompt (the contexts' size)")
    parser.add_argument("--batch", type=int, default=0, metavar="N",
                        help="in the batch engine, N sequences at once (0: the single-sequence engine)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    LENGTH = args.prompt_tokens
    target = tiny_qwen2(seed=0, layers=3, max_positions=max(512, 2 * (LENGTH + args.tokens)))
    if args.profile:
        profile = cProfile.Profile()
        if args.batch:
            profile.runcall(run_batch, args.profile, target, args.tokens, args.batch)
        else:
            profile.runcall(run, args.profile, target, args.tokens)
        pstats.Stats(profile).sort_stats("cumulative").print_stats("specdecode", 40)
        return
    methods = args.methods.split(",")
    runs: dict[str, list[tuple[float, int, int]]] = {method: [] for method in methods}
    for _ in range(args.repeats):
        for method in methods:
            runs[method].append(run_batch(method, target, args.tokens, args.batch) if args.batch
                                else run(method, target, args.tokens))
    where = f"the batch engine, {args.batch} sequences at once, " if args.batch else ""
    print(f"host work per step, the target's forward left out ({where}{torch.backends.cpu.get_cpu_capability()} CPU, "
          f"{args.repeats} runs, the least: the machine's noise only adds)")
    print("| method | steps | tokens a step | host ms a step | host ms a token |")
    print("|---|---|---|---|---|")
    for method, measured in runs.items():
        seconds = min(s for s, _, _ in measured)
        _, steps, new = measured[0]
        print(f"| `{method}` | {steps} | {new / steps:.2f} | {seconds / steps * 1e3:.2f} | {seconds / new * 1e3:.2f} |")


if __name__ == "__main__":
    main()
