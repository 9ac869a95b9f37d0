"""How well copying drafters would do, replayed on plain greedy outputs a benchmark run recorded.

    specdecode bench --backend llamacpp --methods ar --per-category 5 --out runs/ar
    python benchmarks/copy_acceptance.py runs/ar [--backend llamacpp]

Prints (1) how prompt-lookup continuations fare by the kind of match behind them (what
`drafters.prompt_lookup.PRIOR_FIRST` and `PRIOR_RUN` are set from), and (2) each copying drafter's
predicted speedup per category on the backend's cost curve (see `specdecode.bench.replay`; no model runs,
except a first measurement of the curve), with an oracle that verifies exactly the copies that will
hold: the most that choosing which copies to verify can give.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from specdecode.bench.replay import predicted_speedup, replay
from specdecode.drafters.prompt_lookup import RESUME, PromptLookupDrafter, PromptLookupTreeDrafter
from specdecode.types import Draft


def load_turns(run: Path) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt, output) per turn of every `ar` record, by category."""
    turns = defaultdict(list)
    for line in (run / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["method"] != "ar" or r.get("error"):
            continue
        ends = [sum(r["turn_lengths"][: i + 1]) for i in range(len(r["turn_lengths"]))]
        for prompt, start, end in zip(r["prompt_ids"], [0, *ends[:-1]], ends):
            turns[r["category"]].append((prompt, r["token_ids"][start:end]))
    return turns


class Recording(PromptLookupDrafter):
    """Prompt lookup that logs how each of its proposals fared: (bucket, right tokens, judged tokens)."""

    def __init__(self, **kwargs):
        self.log: list[tuple[int, int, int]] = []
        super().__init__(**kwargs)

    def begin(self, prompt_ids, forget=False):
        super().begin(prompt_ids, forget)
        record = self._acceptance.record

        def logged(bucket: int, right: int, judged: int) -> None:
            self.log.append((bucket, right, judged))
            record(bucket, right, judged)

        self._acceptance.record = logged


class OracleGate(PromptLookupDrafter):
    """Prompt lookup's proposals, scored by an oracle that knows the output: 1 for each token that will be
    accepted, 0 after. The engine's gate then verifies exactly the copies that pay: the upper bound of
    what choosing which copies to verify can give on this curve."""

    def __init__(self, prompt: list[int], output: list[int]):
        super().__init__(ramp_up=False)  # the oracle knows how long each copy holds
        self.full = list(prompt) + list(output)

    def propose(self, context, max_tokens, params, generator):
        draft = super().propose(context, max_tokens, params, generator)
        future, right = self.full[len(context) :], 0
        while right < len(draft) and right < len(future) and int(draft.tokens[right]) == future[right]:
            right += 1
        return Draft(tokens=draft.tokens, scores=(torch.arange(len(draft)) < right).float())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a `specdecode bench` output folder with ar records")
    parser.add_argument("--backend", default="llamacpp", choices=["torch", "llamacpp"])
    parser.add_argument("--max-new-tokens", type=int, default=128, help="the run's budget (the drafter's room)")
    args = parser.parse_args()
    from specdecode.api import load_models

    curve = load_models(drafter=None, backend=args.backend).target.cost_curve()
    turns = load_turns(args.run)

    # 1. How copies fare by kind of match: every step's proposal, judged against the output.
    for label, categories in [("copy-heavy (code-edit, rag, summarisation)", ["code-edit", "rag", "summarisation"]),
                              ("the rest", [c for c in turns if c not in ("code-edit", "rag", "summarisation")]),
                              ("all (the priors)", list(turns))]:
        counts = defaultdict(lambda: [0, 0, 0, 0])  # proposals, first right, later right, later wrong
        for category in categories:
            for prompt, output in turns.get(category, []):
                drafter = Recording()
                replay(drafter, prompt, output, curve, max_new_tokens=args.max_new_tokens)
                for bucket, right, judged in drafter.log:
                    c = counts[bucket]
                    c[0] += 1
                    c[1] += right > 0
                    c[2] += max(right - 1, 0)
                    c[3] += 0 < right < judged
        print(f"{label}: chance the first copied token is right / each later one (given the earlier):")
        for bucket in sorted(counts):
            n, first, later, wrong = counts[bucket]
            kind = "resuming a copy" if bucket == RESUME else f"match {2 ** bucket}-{2 ** (bucket + 1) - 1} tokens"
            print(f"  {kind:<22} {first / n:.2f} / {later / max(later + wrong, 1):.3f}  ({n} proposals)")

    # 2. Predicted speedup per category on this backend's curve.
    drafters = {
        "pld (gated)": lambda prompt, output: PromptLookupDrafter(),
        "pld (10 tokens, ungated)": lambda prompt, output: PromptLookupDrafter(num_tokens=10),
        "pld-tree": lambda prompt, output: PromptLookupTreeDrafter(curve),
        "pld (oracle gate)": OracleGate,
    }
    print(f"\npredicted speedup over plain decoding on the {args.backend} curve:")
    print("  " + "method".ljust(26) + "".join(c[:12].rjust(13) for c in turns) + "overall".rjust(10))
    plain = {c: [replay(None, p, o, curve) for p, o in pairs] for c, pairs in turns.items()}
    for name, make in drafters.items():
        row, all_runs, all_plain = [], [], []
        for category, pairs in turns.items():
            runs = [replay(make(p, o), p, o, curve, gate=name != "pld (10 tokens, ungated)",
                           max_new_tokens=args.max_new_tokens) for p, o in pairs]
            row.append(predicted_speedup(runs, plain[category]))
            all_runs += runs
            all_plain += plain[category]
        print("  " + name.ljust(26) + "".join(f"{x:12.2f}x" for x in row)
              + f"{predicted_speedup(all_runs, all_plain):9.2f}x")


if __name__ == "__main__":
    main()
