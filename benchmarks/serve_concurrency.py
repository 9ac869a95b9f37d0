"""Throughput and latency of `specdecode serve` at 1, 2, 4, 8 concurrent clients, with and without
speculation, on the default models (bf16, 2 threads), through the official `openai` client on loopback.

    python benchmarks/serve_concurrency.py [--clients 1,2,4,8,16] [--methods ar,pld] [--prompts 16]

Every level sends the same prompts (a seeded sample of the benchmark's categories, interleaved,
chat-templated, greedy) from `clients` threads, each taking the next prompt when its answer is in; every
method runs in turn. Per method and level: output tokens per second over the wall clock, mean and
90th-percentile request latency, mean accepted tokens per target forward, draft tokens verified per
batched forward (the batch gate's choice), and how many answers equal plain decoding's with one client
(no batching); where one differs, the target's top-1/top-2 margin at the first differing token (bf16
results depend on the batch's shape, so near-ties may flip). Writes a markdown table to --out.
"""

from __future__ import annotations

import argparse
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import torch

from specdecode.api import load_models
from specdecode.bench.samples import sample_tasks
from specdecode.bench.exactness import diagnose
from specdecode.bench.scripts import save_report
from specdecode.serve.app import Server, ServerThread, create_app

CATEGORIES = ["code", "code-edit", "summarisation", "qa", "math", "rag"]


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics") as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,2,4,8,16")
    parser.add_argument("--methods", default="ar,pld")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/serve_concurrency.md"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    levels = [int(c) for c in args.clients.split(",")]
    methods = args.methods.split(",")

    models = load_models(dtype="bfloat16", progress=False)
    server = Server(models, "default", default_method=methods[0], max_batch=max(levels), methods=methods)
    running = ServerThread(create_app(server))
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=3600)
    needed = args.prompts
    by_category = [sample_tasks([c], -(-needed // len(CATEGORIES)), seed=0) for c in CATEGORIES]
    prompts = [t.turns[0] for group in zip(*by_category) for t in group][:needed]  # categories interleaved

    def ask(method: str, prompt: str) -> tuple[float, str, dict]:
        start = time.perf_counter()
        response = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
            temperature=0, extra_body={"method": method})
        return time.perf_counter() - start, response.choices[0].message.content, response.model_extra["speculative"]

    for method in methods:  # warm-up: cost curve, datastore, first forwards
        ask(method, prompts[0])
    rows, reference, differing = [], {}, []
    for clients in levels:
        batch = prompts
        for method in methods:
            batched = -metric(running.url, "specdecode_batch_forwards_total")
            drafted = -metric(running.url, "specdecode_batch_drafted_tokens_total")
            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                answers = list(pool.map(lambda p: ask(method, p), batch))
            wall = time.perf_counter() - start
            batched += metric(running.url, "specdecode_batch_forwards_total")
            drafted += metric(running.url, "specdecode_batch_drafted_tokens_total")
            tokens = sum(len(models.tokenizer.encode(text, add_special_tokens=False)) for _, text, _ in answers)
            latencies = sorted(seconds for seconds, _, _ in answers)
            forwards = sum(s["target_forwards"] for _, _, s in answers)
            generated = sum(s["target_forwards"] * s["mean_accepted_tokens"] for _, _, s in answers)
            for prompt, (_, text, _) in zip(batch, answers):
                reference.setdefault(prompt, text)
            same = sum(reference[p] == text for p, (_, text, _) in zip(batch, answers))
            differing += [(clients, method, p, text) for p, (_, text, _) in zip(batch, answers) if reference[p] != text]
            rows.append({
                "clients": clients, "method": method, "requests": len(batch), "tokens": tokens,
                "throughput": tokens / wall, "latency": statistics.mean(latencies),
                "p90": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
                "accepted": generated / forwards if forwards else float("nan"),
                "drafted_per_forward": drafted / batched if batched else None,
                "identical": f"{same}/{len(batch)}",
            })
            row = rows[-1]
            print(f"{clients} clients {method}: {row['throughput']:.2f} tok/s, latency {row['latency']:.1f}s "
                  f"(p90 {row['p90']:.1f}s), {row['accepted']:.2f} tokens/forward, identical {row['identical']}",
                  flush=True)
    running.stop()
    notes = []
    for clients, method, prompt, text in differing:  # the server is down: the target is ours again
        ids = models.encode(prompt, chat=True)
        ours, theirs = (models.tokenizer.encode(t, add_special_tokens=False) for t in (reference[prompt], text))
        divergence = diagnose(models.target, ids, ours, theirs)
        notes.append(f"- {clients} clients, {method}, prompt {prompt[:40]!r}: "
                     + (divergence.describe() if divergence else "same tokens, different text"))

    lines = ["# specdecode serve: throughput and latency by concurrency", "",
             f"- default models, bf16, {torch.get_num_threads()} threads, greedy, {args.max_tokens} tokens per "
             f"answer, the same {len(prompts)} chat prompts at every level (from {', '.join(CATEGORIES)})",
             "- speedup: throughput over `ar`'s at the same concurrency", "",
             "| clients | method | tokens/s | speedup | mean latency (s) | p90 latency (s) | tokens per forward | "
             "draft tokens per batched forward | identical to plain, 1 client |", "|---" * 9 + "|"]
    for row in rows:
        base = next(r for r in rows if r["clients"] == row["clients"] and r["method"] == methods[0])
        drafted = "-" if row["drafted_per_forward"] is None else f"{row['drafted_per_forward']:.1f}"
        lines.append(f"| {row['clients']} | {row['method']} | {row['throughput']:.2f} | "
                     f"{row['throughput'] / base['throughput']:.2f}x | {row['latency']:.1f} | {row['p90']:.1f} | "
                     f"{row['accepted']:.2f} | {drafted} | {row['identical']} |")
    lines += ["", "Answers that differ from plain decoding with one client:", ""] + (notes or ["- none"])
    save_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
