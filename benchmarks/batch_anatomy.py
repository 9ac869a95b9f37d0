"""What a batch of N sequences spends its time on, per method, in-process: the server's batch engine
(`engine.batch.BatchEngine`) on the default pair, N slots refilled from the prompts as answers end (as N clients
each sending the next prompt when its answer is in), the methods interleaved round by round.

    python benchmarks/batch_anatomy.py [--slots 2] [--methods auto,ar,pld] [--part tuning] [--per-category 2]
                                       [--max-new-tokens 64] [--rounds 2] [--dtype auto] [--chunk-seconds 1.0,0.25]
                                       [--chunk-policy turns,every] [--prefixes shared,fed]

Methods: any that batches, and "copies": `auto` without its trained head (its copy sources alone). `--chunk-policy
every` (`BatchEngine`'s `chunk_policy`, the server's `--chunk-policy`): a long prompt's chunk goes into every step while
the prompt is fed, the decoding sequences riding in it, instead of taking turns with steps of decoding alone
(`engine.pacing.PrefillShare`).
`--prefixes fed`: every sequence feeds its whole prompt, none taking a prefix another holds (`BatchEngine`'s
`share_prefixes`; the chat template's system prompt begins every prompt here).

Per method (the least wall time of the rounds, and that round's figures): output tokens per second; the time between a
sequence's tokens (from its first on, a step's gap spread over the tokens it brought), median, p95 and mean; the steps
that feed prompt tokens and their share of the wall time; the decoding steps' mean time, their forward's mean width,
draft tokens and accepted tokens per sequence-step, and where a decoding step's time goes: the target's forward, the
drafters' drafting, the rest of the host's work (the gate, the inputs and mask, verification, appending, learning); in
the steps that feed prompt tokens, the sequences that decode beside them and their drafted and accepted tokens; over
the whole run, the seconds of the target's forwards and of the rest (drafting and the host's other work, every step's);
the prompt tokens a sequence took from another instead of feeding them (`--prefixes`); and whether every answer is
token for token the in-process single-sequence greedy answer.

Not a served measurement (`serve_concurrency.py` is): the same engine without the server's threads and streaming, so
that a change to the batch's work shows in its own figures. Use the tuning part for decisions.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from specdecode.api import load_models
from specdecode.bench.samples import sample_tasks
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine.batch import BatchEngine, final_layer
from specdecode.engine.pacing import CHUNK_POLICIES
from specdecode.methods import choose
from specdecode.models.costs import CHUNK_SECONDS
from specdecode.serve.worker import own_cache

CATEGORIES = "code,code-edit,summarisation,qa,math,rag,translation,multi-turn"


@dataclasses.dataclass
class Tally:
    """One method's run."""

    wall: float = 0.0
    tokens: int = 0
    forwards: float = 0.0  # the target's forwards of every step
    feeding_steps: int = 0
    feeding_seconds: float = 0.0
    steps: int = 0  # decoding steps (no prompt token fed)
    seconds: float = 0.0
    forward: float = 0.0
    drafting: float = 0.0
    width: int = 0  # tokens the decoding steps' forwards carried
    sequence_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    identical: int = 0
    answers: int = 0
    prompt_tokens: int = 0
    shared: int = 0  # prompt tokens not fed: a prefix another sequence held
    gaps: list[float] = dataclasses.field(default_factory=list)  # time between a sequence's tokens, per token
    beside: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0])  # feeding steps: sequence-steps,
    # their drafted and accepted tokens (the sequences that decode beside a prompt's tokens)


def run(models, target, prototype, method: str, prompts: list[list[int]], slots: int, config: GenerationConfig,
        references: list[list[int]], chunk_seconds: float = CHUNK_SECONDS, policy: str = "turns",
        prefixes: str = "shared") -> Tally:
    """The prompts through a batch of `slots`, refilled as answers end, each sequence's drafter made from
    `prototype` (None: plain decoding), built once beforehand as the server builds it."""
    engine = BatchEngine(target, models.tokenizer, chunk_seconds=chunk_seconds, share_prefixes=prefixes == "shared",
                         keep_ended=slots, chunk_policy=policy)  # (as the server keeps them)
    tally, forward_seconds = Tally(), [0.0]
    original = target.forward

    def timed_forward(*a, **k):
        start = time.perf_counter()
        out = original(*a, **k)
        forward_seconds[0] += time.perf_counter() - start
        return out

    target.forward = timed_forward
    queue, owner, last = list(range(len(prompts))), {}, {}
    start = time.perf_counter()
    try:
        while queue or engine.members:
            while queue and len(engine) < slots:
                p = queue.pop(0)
                drafter = None if prototype is None else prototype.for_sequence(None)
                owner[engine.add(prompts[p], config, drafter, method=method)] = p
            # (a sequence decoding feeds one token a step: its last; more is a prompt's)
            feeding = any(len(m.slots) < len(m.progress.context) - 1 for m in engine.members.values())
            forward_seconds[0], step_start = 0.0, time.perf_counter()
            events = engine.step()
            seconds = time.perf_counter() - step_start
            tally.forwards += forward_seconds[0]
            stepped = [e for _, e, _ in events if e.token_ids and e.stats.forward_tokens]
            if feeding:
                tally.feeding_steps, tally.feeding_seconds = tally.feeding_steps + 1, tally.feeding_seconds + seconds
                tally.beside = [tally.beside[0] + len(stepped), tally.beside[1] + sum(e.stats.drafted for e in stepped),
                                tally.beside[2] + sum(e.stats.accepted for e in stepped)]
            else:
                tally.steps, tally.seconds, tally.forward = tally.steps + 1, tally.seconds + seconds, \
                    tally.forward + forward_seconds[0]
                tally.drafting += sum(e.stats.draft_seconds for e in stepped)
                tally.width += sum(e.stats.forward_tokens for e in stepped)
                tally.sequence_steps += len(stepped)
                tally.drafted += sum(e.stats.drafted for e in stepped)
                tally.accepted += sum(e.stats.accepted for e in stepped)
            now = time.perf_counter()
            for ident, event, result in events:
                if event.token_ids and ident in last:  # (from its first token on, as a streaming client sees it)
                    tally.gaps += [(now - last[ident]) / len(event.token_ids)] * len(event.token_ids)
                if event.token_ids:
                    last[ident] = now
                if result is not None:
                    p = owner.pop(ident)
                    tally.tokens += len(result.token_ids)
                    tally.answers += 1
                    tally.prompt_tokens, tally.shared = tally.prompt_tokens + len(prompts[p]), \
                        tally.shared + result.cached_tokens
                    tally.identical += result.token_ids == references[p]
    finally:
        target.forward = original
    tally.wall = time.perf_counter() - start
    return tally


def prototype(models, method: str):
    """The method's drafter the sequences' are made from; "copies": `auto` without its trained head (prompt lookup
    and the suffix cache, merged as `auto` merges them)."""
    if method != "copies":
        return models.drafter_for(choose(method))
    from specdecode.drafters.auto import compose, copy_sources
    from specdecode.drafters.options import DrafterOptions

    target = models.target
    return compose(copy_sources(target, DrafterOptions()), target.cost_curve(), final_layer(target), target.device)


def report(method: str, t: Tally) -> str:
    steps, seq = max(t.steps, 1), max(t.sequence_steps, 1)
    gaps = sorted(t.gaps) or [float("nan")]
    return (f"| {method} | {t.tokens / t.wall:.1f} | {t.wall:.1f} | {1e3 * statistics.median(gaps):.0f} / "
            f"{1e3 * gaps[int(0.95 * (len(gaps) - 1))]:.0f} / {1e3 * statistics.fmean(gaps):.0f} | {t.feeding_steps} / "
            f"{100 * t.feeding_seconds / t.wall:.0f}% | {t.steps} | {1e3 * t.seconds / steps:.1f} | "
            f"{t.width / steps:.1f} | {t.drafted / seq:.2f} / {t.accepted / seq:.2f} | "
            f"{1e3 * t.forward / steps:.1f} / {1e3 * t.drafting / steps:.1f} / "
            f"{1e3 * (t.seconds - t.forward - t.drafting) / steps:.1f} | "
            f"{t.beside[0]}: {t.beside[1]} / {t.beside[2]} | "
            f"{t.forwards:.1f} / {t.wall - t.forwards:.1f} | {t.shared} / {t.prompt_tokens} | "
            f"{t.identical}/{t.answers} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--methods", default="auto,ar,pld")
    parser.add_argument("--categories", default=CATEGORIES)
    parser.add_argument("--part", default="tuning", choices=["tuning", "held-out"])
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-seconds", default=str(CHUNK_SECONDS),
                        help="what a step's prompt tokens take at most (BatchEngine's chunk_seconds); several, "
                             "comma-separated: each method runs with each")
    parser.add_argument("--chunk-policy", default="turns",
                        help="when a long prompt's chunk goes into a step: turns (PrefillShare's: once the steps "
                             "since the last chunk took as long as it did) or every (every step while the prompt is "
                             "fed, the decoding sequences riding in it); both, comma-separated: each run with each")
    parser.add_argument("--prefixes", default="shared",
                        help="shared (a sequence takes a prefix of its prompt another holds: BatchEngine's "
                             "share_prefixes) or fed (every prompt fed whole); both, comma-separated: each run with "
                             "each")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = load_models(dtype=args.dtype, progress=False)
    tasks = sample_tasks(args.categories.split(","), args.per_category, part=args.part)
    prompts = [models.encode(task.turns[0], chat=True) for task in tasks]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    plain = SpeculativeEngine(models.target, models.tokenizer)
    references = [plain.generate(p, config).token_ids for p in prompts]
    target = own_cache(models.target)
    methods = args.methods.split(",")
    prototypes = {m: prototype(models, m) for m in methods}  # (built once, as the server does)
    chunks = [float(c) for c in args.chunk_seconds.split(",")]
    policies = args.chunk_policy.split(",")
    if not set(policies) <= set(CHUNK_POLICIES):
        parser.error(f"--chunk-policy takes {', '.join(CHUNK_POLICIES)}, not {args.chunk_policy}")
    prefixes = args.prefixes.split(",")
    if not set(prefixes) <= {"shared", "fed"}:
        parser.error(f"--prefixes takes shared and fed, not {args.prefixes}")
    runs = [(m, c, p, s) for m in methods for c in chunks for p in policies for s in prefixes]
    best: dict[tuple[str, float, str, str], Tally] = {}
    for round_ in range(args.rounds):
        for method, chunk, policy, shared in runs[round_ % len(runs):] + runs[: round_ % len(runs)]:
            name = "auto" if method == "copies" else method
            tally = run(models, target, prototypes[method], name, prompts, args.slots, config, references, chunk,
                        policy, shared)
            print(f"round {round_}, {method}, chunks of {chunk} s, {policy}, prefixes {shared}: "
                  f"{tally.tokens / tally.wall:.1f} tokens/s "
                  f"(forwards {tally.forwards:.2f} s, the rest {tally.wall - tally.forwards:.2f} s)", flush=True)
            if (method, chunk, policy, shared) not in best or tally.wall < best[(method, chunk, policy, shared)].wall:
                best[(method, chunk, policy, shared)] = tally
    print(f"\n{len(prompts)} prompts ({args.part}), {args.slots} slots, {args.max_new_tokens} tokens at most, "
          f"least wall of {args.rounds} rounds\n")
    print("| method | tokens/s | wall s | TBT median / p95 / mean ms | feeding steps / share of wall | "
          "decoding steps | ms a step | width | drafted / accepted a sequence-step | "
          "ms a step: forward / drafting / other host | beside prompts: sequence-steps: drafted / accepted | "
          "whole run s: forwards / the rest | prompt tokens shared / in all | = greedy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for method, chunk, policy, shared in runs:
        label = (f"`{method}`" + (f", {chunk} s chunks" if len(chunks) > 1 else "")
                 + (f", {policy}" if len(policies) > 1 else "") + (f", prefixes {shared}" if len(prefixes) > 1 else ""))
        print(report(label, best[(method, chunk, policy, shared)]))


if __name__ == "__main__":
    main()
