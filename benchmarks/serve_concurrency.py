"""Served concurrency: `specdecode serve` at 1, 2, 4 and 8 concurrent clients, the methods interleaved.

    python benchmarks/serve_concurrency.py [--clients 1,2,4,8] [--methods auto,ar,pld] [--per-category 2]
                                           [--part tuning] [--max-tokens 64] [--repeats 1] [--dtype auto] [--out DIR]
    python benchmarks/serve_concurrency.py --render DIR   # the report again, from DIR's kept records

Starts `specdecode serve --methods M1,M2,... --max-batch N --prefix-cache-gib 0` as a child process on a free
loopback port (no copies of ended contexts: the same prompts come again at every level, and each would find its own).
At every level each method is sent the same prompts (a seeded sample of the held-out part of each category, or of the
tuning part with --part tuning, chat-templated token ids over /v1/completions, greedy, streamed): `clients` threads,
each taking the next prompt when its answer is in. Levels and repeats follow one another; within each, the methods run
in the next row of a balanced Latin square (`run_order`, `bench.harness.method_order`), so neither a drifting machine
nor what one method leaves behind favours another.

--variant "NAME=SERVE OPTIONS" (repeatable) starts one server per variant, each with its options added (e.g.
--variant "1 s=--chunk-seconds 1" --variant "0.25 s=--chunk-seconds 0.25"), and runs every method on each, all
interleaved; a row is then `method [NAME]`, compared with `ar [NAME]`.

Per method and level: the total output tokens per second over the run's wall clock; each request's tokens per second
(from sending it to its last token); time to first token; time between tokens (a streamed chunk's gap spread evenly
over its tokens: a step that brings three tokens after 90 ms counts 30 ms three times) and the gaps between chunks
(what a client waits: 90 ms once), median and 95th percentile; and how many answers are token for token what greedy
decoding of the same prompt ids gives in-process (`SpeculativeEngine`, plain decoding, before the server starts).
Writes to --out (default benchmarks/reports/serve-concurrency-<date>): records.jsonl (one line per request, with
every chunk's time and token count, and one per run), settings.json (command, machine, date), report.md (the table,
the ratios the issue asks for, the answers that differ) and throughput.png (tokens per second against clients).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specdecode.bench.server_process import ServerProcess, free_port, parse_run_arguments, run_settings, streamed

SPECDECODE = [sys.executable, "-m", "specdecode"]
CATEGORIES = "code,code-edit,summarisation,qa,math,rag,translation,multi-turn"


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--methods", default="auto,ar,pld", help="the first is the server's default")
    parser.add_argument("--categories", default=CATEGORIES)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--part", default="held-out", choices=["held-out", "tuning"],
                        help="which part of each category's prompts: tuning for decisions, held-out for reports")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=OPTIONS",
                        help="a server of its own with these serve options added (repeatable)")
    args = parse_run_arguments(parser, argv, "serve-concurrency")
    for variant in args.variant:
        if "=" not in variant or not variant.partition("=")[0].strip():
            parser.error(f"--variant {variant!r}: NAME=SERVE OPTIONS, e.g. \"0.25 s=--chunk-seconds 0.25\"")
    names = [variant.partition("=")[0].strip() for variant in args.variant]
    if len(set(names)) < len(names):
        parser.error(f"--variant names must differ: {', '.join(names)}")
    return args


def baseline(label: str) -> str:
    """The `ar` row a row is compared with: `ar`, or `ar [NAME]` on a variant's server."""
    return "ar" + label[label.index(" "):] if " " in label else "ar"


# --- A streamed request, timed -----------------------------------------------------------------------------


def stream(url: str, prompt_ids: list[int], method: str, max_tokens: int) -> dict:
    """One greedy streamed completion: when it was sent, each chunk's arrival and token ids, when it ended, and the
    prompt tokens the server took from its cache (`usage.prompt_tokens_details.cached_tokens`)."""
    body = {"model": "default", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "method": method, "stream_options": {"include_usage": True}}
    chunks: list[tuple[float, list[int]]] = []
    cached = 0
    sent = time.perf_counter()
    for arrived, payload in streamed(url, "/v1/completions", body):
        cached = ((payload.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", cached)
        ids = [t["id"] for t in payload.get("specdecode", {}).get("tokens", [])]
        if ids:
            chunks.append((arrived - sent, ids))
    ended = time.perf_counter() - sent
    return {"sent": sent, "chunks": [[t, ids] for t, ids in chunks], "seconds": ended,
            "token_ids": [i for _, ids in chunks for i in ids], "cached": cached}


def run_level(url: str, prompts: list[list[int]], method: str, clients: int, max_tokens: int) -> tuple[float, list]:
    """Every prompt once, from `clients` threads each taking the next when its answer is in: (wall seconds,
    per request (prompt index, client, its timings))."""
    queue = list(range(len(prompts)))
    lock = threading.Lock()

    def client(number: int) -> list:
        done = []
        while True:
            with lock:
                if not queue:
                    return done
                index = queue.pop(0)
            done.append((index, number, stream(url, prompts[index], method, max_tokens)))

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = [a for part in pool.map(client, range(clients)) for a in part]
    return time.perf_counter() - start, answers


def run_order(labels: list[str], repeats: int, levels: list[int]) -> list[tuple[int, int, list[str]]]:
    """(repeat, level, the labels' order) of every run: each (repeat, level) cell takes the next row of a balanced Latin
    square (`bench.harness.method_order`), so over the cells each label runs in each place as often, and after each
    other label as often (what one method leaves behind in the server, its pace and cost curve, favours none)."""
    from specdecode.bench.harness import method_order  # (torch and transformers: not for --render)

    cells = [(repeat, level) for repeat in range(repeats) for level in levels]
    return [(repeat, level, method_order(labels, row)) for row, (repeat, level) in enumerate(cells)]


# --- Figures from the records ------------------------------------------------------------------------------


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def gaps(request: dict) -> list[float]:
    """Each token's time between tokens, after the first chunk: its chunk's gap over its tokens."""
    out, previous = [], None
    for at, ids in request["chunks"]:
        if previous is not None:
            out += [(at - previous) / len(ids)] * len(ids)
        previous = at
    return out


def chunk_gaps(request: dict) -> list[float]:
    """The time between a request's streamed chunks, each gap once (what a client waits between two arrivals,
    whatever they carry: vLLM's inter-token latency); `gaps` spreads each over its tokens."""
    times = [at for at, _ in request["chunks"]]
    return [b - a for a, b in zip(times, times[1:])]


def figures(requests: list[dict], runs: list[dict]) -> dict:
    """A (level, method)'s figures over its runs and requests."""
    tokens = sum(len(r["token_ids"]) for r in requests)
    wall = sum(run["wall"] for run in runs)
    between, waits = [g for r in requests for g in gaps(r)], [g for r in requests for g in chunk_gaps(r)]
    first = [r["chunks"][0][0] for r in requests if r["chunks"]]
    rates = [len(r["token_ids"]) / r["seconds"] for r in requests if r["seconds"] > 0]
    return {"throughput": tokens / wall, "client": statistics.median(rates), "ttft": statistics.median(first),
            "ttft95": percentile(first, 0.95), "tbt": statistics.median(between) if between else float("nan"),
            "tbt95": percentile(between, 0.95), "gap": statistics.median(waits) if waits else float("nan"),
            "gap95": percentile(waits, 0.95), "identical": sum(r["identical"] for r in requests),
            "requests": len(requests), "cached": sum(r.get("cached", 0) for r in requests),
            "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in requests)}


def prompt_ratio(records: list[dict], method: str, prompt: int, levels: list[int], measure=gaps) -> float:
    """A prompt's median time between tokens (`gaps`, or `chunk_gaps`) at the most clients over at the fewest, under
    `method`."""
    def median(level: int) -> float:
        found = [g for r in records if r["kind"] == "request" and r["method"] == method and r["prompt"] == prompt
                 and r["clients"] == level for g in measure(r)]
        return statistics.median(found) if found else float("nan")

    return median(levels[-1]) / median(levels[0])


def repeat_rates(records: list[dict], level: int, method: str) -> dict[int, float]:
    """Per repeat, a method's output tokens per second at `level` clients (its run's tokens over its wall)."""
    tokens: dict[int, int] = {}
    for r in records:
        if r["kind"] == "request" and r["clients"] == level and r["method"] == method:
            tokens[r["repeat"]] = tokens.get(r["repeat"], 0) + len(r["token_ids"])
    return {r["repeat"]: tokens.get(r["repeat"], 0) / r["wall"] for r in records
            if r["kind"] == "run" and r["clients"] == level and r["method"] == method}


def noise_lines(records: list[dict], levels: list[int], methods: list[str]) -> list[str]:
    """Each method's throughput over `ar`'s, per level: the geometric mean of the repeats' ratios (a repeat's runs
    are interleaved, so each ratio pairs two runs of one moment) and its 90% interval; how wide the interval is
    says how small a difference these repeats could tell from noise."""
    from specdecode.bench.noise import interval, verdict

    lines = ["", "Throughput over `ar`, repeat by repeat (each repeat's runs interleaved; geometric mean, 90% interval "
                 "by Student's t over the repeats):", "",
             "| clients | method | repeats' ratios | geometric mean | 90% interval | verdict |",
             "|---|---|---|---|---|---|"]
    for level in levels:
        for method in methods:
            ar, rates = repeat_rates(records, level, baseline(method)), repeat_rates(records, level, method)
            logs = [math.log(rates[k] / ar[k]) for k in sorted(rates) if k in ar and method != baseline(method)]
            if not logs:
                continue
            mean, low, high = interval(logs)
            shown = "-" if len(logs) < 2 else f"{math.exp(low):.3f}-{math.exp(high):.3f}"
            lines.append(f"| {level} | `{method}` | {', '.join(f'{math.exp(x):.2f}' for x in logs)} | "
                         f"{math.exp(mean):.3f} | {shown} | {verdict(low, high) if len(logs) > 1 else '-'} |")
    return lines


def tbt_lines(table: dict, records: list[dict], levels: list[int], methods: list[str], prompts: int) -> list[str]:
    """The time between tokens at the most clients over at the fewest, by both measures (a chunk's gap spread over its
    tokens, `gaps`; the gaps between chunks, `chunk_gaps`): the medians' ratio, and per prompt its median's ratio over
    `ar`'s for the same prompt, the largest (one prompt of a few noisy ones: no interval)."""
    lines = ["", f"Time between tokens at {levels[-1]} clients over at {levels[0]}, spread over a chunk's tokens / as "
                 "the gaps between chunks (median; per prompt over `ar`'s, the largest):", ""]
    for method in methods:
        ratios = []
        for key, measure in (("tbt", gaps), ("gap", chunk_gaps)):
            worst = max(prompt_ratio(records, method, p, levels, measure)
                        / prompt_ratio(records, baseline(method), p, levels, measure)
                        for p in range(prompts)) if baseline(method) in methods else float("nan")
            ratios.append((table[(levels[-1], method)][key] / table[(levels[0], method)][key], worst))
        (spread, spread_worst), (chunk, chunk_worst) = ratios
        lines.append(f"- `{method}`: {spread:.2f}x / {chunk:.2f}x; per prompt, beyond `ar`'s: at most "
                     f"{spread_worst:.2f}x / {chunk_worst:.2f}x")
    return lines


def render(out: Path) -> str:
    """report.md and throughput.png from `out`'s records and settings."""
    settings = json.loads((out / "settings.json").read_text())
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    levels, methods = settings["clients"], settings["methods"]
    table = {(level, method): figures([r for r in records if r["kind"] == "request" and r["clients"] == level
                                       and r["method"] == method],
                                      [r for r in records if r["kind"] == "run" and r["clients"] == level
                                       and r["method"] == method])
             for level in levels for method in methods}
    lines = [f"# specdecode serve at {', '.join(map(str, levels))} concurrent clients", "",
             f"- {settings['date']}, {settings['machine']}, commit {settings.get('commit', 'not recorded')}",
             f"- `{settings['command']}`",
             f"- {settings['prompts']} prompts ({settings.get('part', 'held-out')} part of {settings['categories']}), "
             f"{settings['max_tokens']} tokens at most, "
             f"greedy, streamed; {settings['repeats']} interleaved round(s); while it ran: {settings['beside']}", "",
             "| clients | method | tokens/s | over `ar` | a client's tokens/s | TTFT median / p95 (s) | "
             "TBT median / p95 (ms) | chunk gap median / p95 (ms) | = in-process greedy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (level, method), row in table.items():
        ar = table.get((level, baseline(method)))
        over = f"{row['throughput'] / ar['throughput']:.2f}x" if ar else "-"
        lines.append(f"| {level} | `{method}` | {row['throughput']:.1f} | {over} | {row['client']:.1f} | "
                     f"{row['ttft']:.2f} / {row['ttft95']:.2f} | {row['tbt'] * 1000:.0f} / {row['tbt95'] * 1000:.0f} | "
                     f"{row['gap'] * 1000:.0f} / {row['gap95'] * 1000:.0f} | {row['identical']}/{row['requests']} |")
    if any(row["prompt_tokens"] for row in table.values()):  # (recorded since the batch shares prefixes)
        lines += ["", "Prompt tokens taken from the server's cache (a shared prefix), not fed, of all:", ""]
        lines += [f"- {level} clients, `{method}`: {row['cached']} of {row['prompt_tokens']}"
                  for (level, method), row in table.items()]
    if len(levels) > 1:  # (one level has nothing to compare its gaps with)
        lines += tbt_lines(table, records, levels, methods, settings["prompts"])
    if any(baseline(method) in methods for method in methods):
        lines += noise_lines(records, levels, methods)
    differing = [r for r in records if r["kind"] == "request" and not r["identical"]]
    lines += ["", "Answers that differ from in-process greedy decoding:", ""] + [
        f"- {r['clients']} clients, `{r['method']}`, prompt {r['prompt']}: first differs at token "
        f"{r['first_difference']}" for r in differing] + ([] if differing else ["- none"])
    plot(table, levels, methods, out / "throughput.png", settings)
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def plot(table: dict, levels: list[int], methods: list[str], path: Path, settings: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for method in methods:
        axes.plot(levels, [table[(level, method)]["throughput"] for level in levels], marker="o", label=method)
    axes.set_xscale("log", base=2)
    axes.set_xticks(levels, [str(level) for level in levels])
    axes.set_xlabel("concurrent clients")
    axes.set_ylabel("output tokens per second, all clients")
    axes.set_title(f"specdecode serve, {settings['date']}: {settings['prompts']} prompts, "
                   f"{settings['max_tokens']} tokens at most", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# --- The run -----------------------------------------------------------------------------------------------


def prompts_and_references(args: argparse.Namespace) -> tuple[list[list[int]], list[str], list[list[int]]]:
    """The prompts' token ids (chat-templated), their categories, and greedy decoding's answers in-process."""
    import torch

    from specdecode.api import load_models
    from specdecode.bench.samples import sample_tasks
    from specdecode.engine import GenerationConfig, SpeculativeEngine

    torch.set_num_threads(args.threads)
    models = load_models(dtype=args.dtype, progress=False)
    tasks = sample_tasks(args.categories.split(","), args.per_category, part=args.part)
    prompts = [models.encode(task.turns[0], chat=True) for task in tasks]
    plain = SpeculativeEngine(models.target, models.tokenizer)
    config = GenerationConfig(max_new_tokens=args.max_tokens)
    references = [plain.generate(p, config).token_ids for p in prompts]
    return prompts, [task.category for task in tasks], references


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                None if len(ours) == len(theirs) else min(len(ours), len(theirs)))


def run(args: argparse.Namespace) -> None:
    levels = [int(c) for c in args.clients.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    prompts, categories, references = prompts_and_references(args)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    # (no copies of ended contexts: every method and level sends the same prompts, and a copy would hand a prompt its
    # own earlier answer's context; prefixes of live and just-ended requests are shared, as they were before copies)
    variants = [(name.strip(), options) for name, _, options in (v.partition("=") for v in args.variant)]
    commands, ports = {}, {}  # variant name -> its server's command line, port
    for name, options in variants or [("", "")]:
        port = ports[name] = free_port()
        commands[name] = [
            *SPECDECODE, "serve", "--methods", ",".join(methods), "--method", methods[0], "--dtype", args.dtype,
            "--port", str(port), "--max-batch", str(max(levels)), "--model-name", "default",
            "--prefix-cache-gib", "0", *shlex.split(options)]
    labels = {(f"{m} [{name}]" if name else m): (name, m) for name in commands for m in methods}
    settings = {**run_settings(), "serve": " ; ".join(shlex.join(c) for c in commands.values()), "clients": levels,
                "methods": list(labels), "prompts": len(prompts), "part": args.part, "categories": args.categories,
                "max_tokens": args.max_tokens, "repeats": args.repeats,
                "beside": os.environ.get("BESIDE", "not recorded (set BESIDE to say)")}
    (args.out / "settings.json").write_text(json.dumps(settings, indent=1))
    records = (args.out / "records.jsonl").open("w")
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, command in commands.items():
            server = stack.enter_context(ServerProcess("specdecode serve", command, ports[name]))
            print(f"starting {shlex.join(command)}", flush=True)
            server.wait_until_up(timeout=1800)
            urls[name] = server.url
            for method in methods:  # warm-up: first forwards, the batch's path at the widest level
                run_level(server.url, prompts[: max(levels)], method, max(levels), 8)
        for repeat, level, order in run_order(list(labels), args.repeats, levels):
            for label in order:
                name, method = labels[label]
                wall, answers = run_level(urls[name], prompts, method, level, args.max_tokens)
                records.write(json.dumps({"kind": "run", "repeat": repeat, "clients": level, "method": label,
                                          "wall": wall}) + "\n")
                for prompt, client, request in answers:
                    difference = first_difference(request["token_ids"], references[prompt])
                    records.write(json.dumps({"kind": "request", "repeat": repeat, "clients": level,
                                              "method": label, "prompt": prompt, "category": categories[prompt],
                                              "client": client, "identical": difference is None,
                                              "prompt_tokens": len(prompts[prompt]),
                                              "first_difference": difference, **request}) + "\n")
                records.flush()
                tokens = sum(len(a[2]["token_ids"]) for a in answers)
                print(f"{level} clients, {label}: {tokens / wall:.1f} tokens/s", flush=True)
    records.close()
    print(render(args.out))


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if args.render is not None:
        if not (args.render / "records.jsonl").is_file() or not (args.render / "settings.json").is_file():
            raise SystemExit(f"{args.render} holds no run of this script (its records.jsonl and settings.json)")
        print(render(args.render))
        return
    run(args)


if __name__ == "__main__":
    main()
