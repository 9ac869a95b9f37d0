"""scripts/gpu-check's replay part: a recording of `specdecode bench --record-acceptance` (benchmarks/acceptance/)
replayed on random-weight models of the recorded pair's shapes, on the static path (`bench.replay_acceptance`).

Per method: tokens/s and the speedup over plain decoding at the recorded acceptance, the runs of every method
and of plain decoding interleaved in rounds (each round's ratio of sums over the recorded prompts; the median
over rounds), next to the cost curve's prediction from the replayed steps (`metrics.stepwise_speedup`): each
step costs its verify forward's relative cost at its width (the static path's curve, measured here after a
context of the prompts' median length; a width between buckets costs its bucket's) plus its drafting's seconds
(each proposal waited for, in a separate pass) over a one-token forward's. Both leave out each run's first
step (the prompt's prefill and first token). Every figure is labelled "replayed acceptance".
"""

from __future__ import annotations

import statistics
import traceback

from gpu_check_parts import LABEL, RECORDINGS, decode_seconds, forward_seconds, method_drafter, static_model

BUCKET_WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def recording_runs(check) -> tuple[list[str], list[str], list]:
    """(the recordings' paths, the commands that recorded them, the runs to replay): --recording's, else every
    recording in benchmarks/acceptance/ (the same pair's, each its methods'), their first repeat's; with --small one
    run per method, its ids folded into the tiny vocabulary."""
    from specdecode.bench import acceptance

    paths = [check.args.recording] if check.args.recording else sorted(RECORDINGS.glob("*.json*"))
    if not paths:
        raise FileNotFoundError(f"no recording in {RECORDINGS} (specdecode bench --record-acceptance FILE)")
    commands, runs = [], []
    for path in paths:
        settings, recorded = acceptance.load(path)
        commands.append(settings.get("command"))
        runs += [run for run in recorded if run.repeat == 0]
    if check.args.small:
        vocab = check.model(check.plan.targets[0]).vocab_size
        firsts = {}
        for run in runs:
            firsts.setdefault(run.method, run)
        runs = list(firsts.values())
        for run in runs:
            run.prompt_ids = [t % vocab for t in run.prompt_ids]
            run.output_ids = [t % vocab for t in run.output_ids]
    return [str(path) for path in paths], commands, runs


def prepared(check, runs, target, draft) -> tuple[dict, dict, list]:
    """(the drafter of each method, the continuation each run replays, the methods that could not be built)."""
    from specdecode.bench.replay_acceptance import settled_continuation

    drafters, continuations, failed = {}, {}, []
    for method in dict.fromkeys(run.method for run in runs):
        try:
            drafters[method] = method_drafter(check, method, target, draft)
        except Exception as error:  # reported; the other methods still replay
            failed.append({"method": method, "error": f"{type(error).__name__}: {error}"})
    for i, run in enumerate(runs):
        if run.method in drafters and check.left() > 60:
            continuations[i] = settled_continuation(target, lambda run=run: drafters[run.method], run)
        elif run.method in drafters:
            failed.append({"method": run.method, "task_id": run.task_id, "error": "budget: not replayed"})
    return drafters, continuations, failed


def predicted_costs(check, target, drafter, run, continuation, curve: dict, one: float) -> dict:
    """A replay with every proposal waited for: its steps' tokens, verify costs and drafting costs (in
    one-token forwards), the first step left out; and how far it reproduced the recording."""
    from specdecode import devices
    from specdecode.bench.replay_acceptance import agreement, relative_cost, replay_config, replay_engine

    engine, replayer = replay_engine(target, drafter, run, continuation, devices.clock(check.device))
    result = engine.generate(run.prompt_ids, replay_config(run))
    seconds = replayer.draft_seconds + [0.0] * (len(result.steps) - len(replayer.draft_seconds))
    steps = list(zip(result.steps, seconds))[1:]
    return {"tokens": [s.new_tokens for s, _ in steps],
            "verify": [relative_cost(curve, s.forward_tokens) for s, _ in steps],
            "draft": [d / one for _, d in steps], **agreement(run, replayer)}


def timed_rounds(check, runs, engines: dict, continuations: dict) -> dict:
    """Each run's engines (plain decoding first in round 0, the order turned every round) in `plan.rounds`
    rounds: {(run index, row): [(seconds, tokens) per round]}."""
    from specdecode.bench.replay_acceptance import replay_config

    samples: dict = {}
    for round_ in range(check.plan.rounds):
        if round_ and check.left() < 20:
            break
        for i, run in enumerate(runs):
            if i not in continuations:
                continue
            rows = ["ar", run.method]
            for row in rows[round_ % 2:] + rows[: round_ % 2]:
                seconds, tokens, _ = decode_seconds(check.device, engines[(i, row)], run.prompt_ids,
                                                    replay_config(run))
                samples.setdefault((i, row), []).append((seconds, tokens))
    return samples


def replay(check) -> dict:
    """The replay part (module docstring)."""
    from specdecode import metrics
    from specdecode.bench.replay_acceptance import replay_engine
    from specdecode.engine import SpeculativeEngine

    plan = check.plan
    paths, commands, runs = recording_runs(check)
    target, draft = static_model(check, plan.targets[0]), static_model(check, plan.draft)
    drafters, continuations, failed = prepared(check, runs, target, draft)
    context = int(statistics.median(len(run.prompt_ids) for run in runs))
    seconds = forward_seconds(check, target, context, BUCKET_WIDTHS, plan.repeats)
    curve = {n: s / seconds[1] for n, s in seconds.items()}
    engines, costs = {}, {}
    for i, run in enumerate(runs):
        if i not in continuations:
            continue
        engines[(i, "ar")] = SpeculativeEngine(target, None, None, gate=False, step_aside=False)
        engines[(i, run.method)], _ = replay_engine(target, drafters[run.method], run, continuations[i])
        try:
            costs[i] = predicted_costs(check, target, drafters[run.method], run, continuations[i], curve, seconds[1])
        except Exception:
            failed.append({"method": run.method, "task_id": run.task_id, "error": traceback.format_exc()[-600:]})
    samples = timed_rounds(check, runs, engines, continuations)
    rows = []
    for method in drafters:
        mine = [i for i, run in enumerate(runs) if run.method == method and i in costs and (i, method) in samples]
        if mine:
            rows.append(_row(method, runs, mine, samples, costs, metrics))
    return {"label": LABEL, "recordings": paths, "recorded": commands, "shape": plan.targets[0],
            "draft_shape": plan.draft, "context": context, "curve": curve, "forward_seconds": seconds[1],
            "rows": rows, "failed": failed}


def _row(method: str, runs, mine: list[int], samples: dict, costs: dict, metrics) -> dict:
    """A method's figures over its runs: tokens/s and speedup per round (ratios of sums over the runs), their
    medians, the prediction, and the replay's agreement with the recording."""
    rounds = min(len(samples[(i, row)]) for i in mine for row in ("ar", method))
    rates, speedups = [], []
    for r in range(rounds):
        tokens = sum(samples[(i, method)][r][1] for i in mine)
        took = sum(samples[(i, method)][r][0] for i in mine)
        plain = sum(samples[(i, "ar")][r][1] for i in mine) / sum(samples[(i, "ar")][r][0] for i in mine)
        rates.append(tokens / took)
        speedups.append(tokens / took / plain)
    predicted = metrics.stepwise_speedup([t for i in mine for t in costs[i]["tokens"]],
                                         [v for i in mine for v in costs[i]["verify"]],
                                         [d for i in mine for d in costs[i]["draft"]])
    measured = statistics.median(speedups)
    steps = sum(len(costs[i]["tokens"]) for i in mine)
    return {"method": method, "runs": len(mine), "rounds": rounds,
            "recorded_tokens_per_step": statistics.mean(runs[i].tokens_per_step for i in mine),
            "replayed_tokens_per_step": statistics.mean(costs[i]["replayed_tokens_per_step"] for i in mine),
            "runs_exact": sum(costs[i]["exact"] for i in mine),
            "recorded_drafted_per_step": statistics.mean(costs[i]["recorded_drafted_per_step"] for i in mine),
            "proposed_per_step": statistics.mean(costs[i]["proposed_per_step"] for i in mine),
            "tokens_per_s": statistics.median(rates), "speedup": measured, "speedup_range": [min(speedups),
                                                                                             max(speedups)],
            "predicted_speedup": predicted, "measured_over_predicted": measured / predicted if predicted else None,
            "verify_cost_per_step": sum(v for i in mine for v in costs[i]["verify"]) / steps,
            "draft_cost_per_step": sum(d for i in mine for d in costs[i]["draft"]) / steps}


def replay_summary(result: dict) -> list[str]:
    cells = [f"{r['method']} {r['speedup']:.2f}x (predicted {r['predicted_speedup']:.2f}x, "
             f"{r['replayed_tokens_per_step']:.2f} tokens/step)" for r in result["rows"]]
    failed = [f"{f['method']} failed" for f in result["failed"]]
    return [f"- {LABEL} on {result['shape']}, speedup over plain decoding: " + ", ".join(cells + failed)]


def replay_markdown(result: dict, table) -> list[str]:
    recorded = "; ".join(f"`{command}` ({path})" for command, path in zip(result["recorded"], result["recordings"]))
    lines = [f"**{LABEL.capitalize()}**: the steps recorded by {recorded}, "
             f"replayed on random-weight models of the shapes {result['shape']} (target) and {result['draft_shape']} "
             "(draft model), on the static path: the real drafter drafts in full every step, then the target "
             "verifies a draft of the recorded shape that it accepts exactly as recorded (`bench.replay_acceptance`). "
             "Tokens/s and speedup over plain decoding after each run's first step, medians over interleaved "
             "rounds of the ratio of sums over the recorded prompts. Predicted: the cost curve's speedup for the "
             "replayed steps (`metrics.stepwise_speedup`: tokens over the sum of each step's verify cost at its "
             "width, relative to a one-token forward, plus its drafting seconds over a one-token forward's), "
             f"with the static path's curve after {result['context']} tokens: "
             + ", ".join(f"{n}: {c:.2f}" for n, c in result["curve"].items()) + ".", ""]
    lines += table(["method", "runs", "exact", "recorded tokens/step", "replayed tokens/step", "drafted/step",
                    "real drafter's/step", "tokens/s", "speedup", "range", "predicted", "measured/predicted",
                    "verify cost/step", "draft cost/step"],
                   [[r["method"], r["runs"], f"{r['runs_exact']}/{r['runs']}", r["recorded_tokens_per_step"],
                     r["replayed_tokens_per_step"], r["recorded_drafted_per_step"], r["proposed_per_step"],
                     r["tokens_per_s"], r["speedup"], f"{r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f}",
                     r["predicted_speedup"], r["measured_over_predicted"], r["verify_cost_per_step"],
                     r["draft_cost_per_step"]] for r in result["rows"]])
    if result["failed"]:
        lines += ["", "Failed: " + "; ".join(f"{f['method']}: {f['error'][-300:]}" for f in result["failed"])]
    return lines
