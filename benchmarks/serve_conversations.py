"""Served conversations: clients that carry on conversations with `specdecode serve`, each turn's request the
conversation so far, against two servers, one that keeps ended requests' contexts copied out of its batch's cache
(`--prefix-cache-gib`, 1 by default) and one that keeps none (0: contexts stay only while they are in the cache).

    python benchmarks/serve_conversations.py [--clients 4] [--per-category 16] [--part held-out] [--max-tokens 64]
                                             [--repeats 2] [--method auto] [--dtype auto] [--out DIR]
    python benchmarks/serve_conversations.py --render DIR   # the report again, from DIR's kept records

Both servers run side by side as child processes (an idle one costs no compute); each repeat sends its own
conversations (--per-category of them, none sent in another repeat: a conversation sent again would find its own
earlier copy) to each, the one to go first alternating. `clients` threads each take the next conversation and send
its turns one after another, each the moment the last answer is in (as an agent's loop does), over
/v1/chat/completions (greedy, streamed), each turn's messages the conversation so far with each answer as its
text. Per server: output tokens per second over the run's wall clock; per turn, the median time to the first token,
prompt tokens and those taken from the cache (`usage.prompt_tokens_details.cached_tokens`); and how many answers are
token for token the same on both servers and in-process greedy decoding of the same messages (plain decoding,
after the servers stop). Writes records.jsonl, settings.json and report.md to --out (default
benchmarks/reports/serve-conversations-<date>).
"""

from __future__ import annotations

import argparse
import json
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
SERVERS = {"copies kept": "1", "none kept": "0"}  # name -> --prefix-cache-gib


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--per-category", type=int, default=16,
                        help="conversations (of the multi-turn category) a repeat")
    parser.add_argument("--part", default="held-out", choices=["held-out", "tuning"],
                        help="which part of the conversations: tuning for decisions, held-out for reports")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--method", default="auto")
    return parse_run_arguments(parser, argv, "serve-conversations")


def chat(url: str, messages: list[dict], method: str, max_tokens: int) -> dict:
    """One greedy streamed chat request: its time to the first token and in all, its tokens, and its usage."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "method": method, "stream_options": {"include_usage": True}}
    first, ids, text, usage = None, [], [], {}
    sent = time.perf_counter()
    for arrived, payload in streamed(url, "/v1/chat/completions", body):
        usage = payload.get("usage") or usage
        tokens = [t["id"] for t in payload.get("specdecode", {}).get("tokens", [])]
        if tokens and first is None:
            first = arrived - sent
        ids += tokens
        text += [c["delta"].get("content") or "" for c in payload.get("choices", [])]
    seconds = time.perf_counter() - sent
    return {"ttft": first if first is not None else seconds, "seconds": seconds, "token_ids": ids,
            "text": "".join(text), "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def run_conversations(url: str, conversations: list[list[str]], clients: int, method: str, max_tokens: int
                      ) -> tuple[float, list[dict]]:
    """Every conversation once, from `clients` threads, each taking the next conversation when its last is done:
    (wall seconds, one record per turn)."""
    queue, lock = list(range(len(conversations))), threading.Lock()

    def client(number: int) -> list[dict]:
        done = []
        while True:
            with lock:
                if not queue:
                    return done
                index = queue.pop(0)
            messages: list[dict] = []
            for turn, text in enumerate(conversations[index]):
                messages.append({"role": "user", "content": text})
                reply = chat(url, messages, method, max_tokens)
                done.append({"conversation": index, "turn": turn + 1, "client": number, "messages": list(messages),
                             **reply})
                messages.append({"role": "assistant", "content": reply["text"]})

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        records = [r for part in pool.map(client, range(clients)) for r in part]
    return time.perf_counter() - start, records


def references(args: argparse.Namespace, records: list[dict]) -> None:
    """Each served answer's in-process greedy decoding of the same messages (plain decoding), into its record."""
    import torch

    from specdecode.api import load_models
    from specdecode.engine import GenerationConfig, SpeculativeEngine

    torch.set_num_threads(args.threads)
    models = load_models(dtype=args.dtype, progress=False)
    plain, config, known = SpeculativeEngine(models.target, models.tokenizer), GenerationConfig(
        max_new_tokens=args.max_tokens), {}
    for record in records:
        key = json.dumps(record["messages"])
        if key not in known:
            known[key] = plain.generate(models.encode_chat(record["messages"]), config).token_ids
        record["greedy"] = record["token_ids"] == known[key]


def render(out: Path) -> str:
    settings = json.loads((out / "settings.json").read_text())
    lines = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    runs = [r for r in lines if r["kind"] == "run"]
    requests = [r for r in lines if r["kind"] == "request"]
    turns = sorted({r["turn"] for r in requests})
    rows = [f"Served conversations: {settings['conversations']} conversations a repeat ({settings['part']} part of "
            f"multi-turn), {settings['clients']} clients, `{settings['method']}`, {settings['max_tokens']} tokens an "
            f"answer at most, {settings['repeats']} repeats; {settings['date']}, {settings['machine']}, commit "
            f"{settings['commit']}.", "", f"    {settings['command']}", "",
            "| server | tokens/s, per repeat | " + " | ".join(
                f"turn {t}: TTFT median (s) / prompt tokens / taken" for t in turns) + " | = both servers | = greedy |",
            "|---|---|" + "---|" * len(turns) + "---|---|"]
    answers: dict[tuple, dict[str, list[int]]] = {}
    for r in requests:
        answers.setdefault((r["repeat"], r["conversation"], r["turn"]), {})[r["server"]] = r["token_ids"]
    for server in SERVERS:
        mine = [r for r in requests if r["server"] == server]
        rates = [sum(len(q["token_ids"]) for q in mine if q["repeat"] == run["repeat"]) / run["wall"]
                 for run in runs if run["server"] == server]
        cells = []
        for t in turns:
            at = [r for r in mine if r["turn"] == t]
            cells.append(f"{statistics.median(r['ttft'] for r in at):.2f} / "
                         f"{statistics.median(r['prompt_tokens'] for r in at):.0f} / "
                         f"{statistics.median(r['cached'] for r in at):.0f}")
        same = sum(len(set(map(tuple, a.values()))) == 1 for a in answers.values())
        greedy = sum(bool(r.get("greedy")) for r in mine)
        rows.append(f"| {server} | {', '.join(f'{x:.1f}' for x in rates)} | {' | '.join(cells)} | "
                    f"{same}/{len(answers)} | {greedy}/{len(mine)} |")
    report = "\n".join(rows) + "\n"
    (out / "report.md").write_text(report)
    return report


def run(args: argparse.Namespace) -> None:
    from specdecode.bench.samples import sample_tasks

    tasks = sample_tasks(["multi-turn"], args.per_category * args.repeats, part=args.part)
    if len(tasks) < args.per_category * args.repeats:
        raise SystemExit(f"the {args.part} part holds {len(tasks)} conversations: fewer repeats or per repeat")
    conversations = [task.turns for task in tasks]
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    commands, processes = {}, {}
    for name, gib in SERVERS.items():
        port = free_port()
        commands[name] = [*SPECDECODE, "serve", "--method", args.method, "--dtype", args.dtype, "--port", str(port),
                          "--max-batch", "8", "--model-name", "default", "--prefix-cache-gib", gib]
        processes[name] = ServerProcess(f"specdecode serve ({name})", commands[name], port)
    settings = {**run_settings(), "serve": {k: shlex.join(v) for k, v in commands.items()},
                "clients": args.clients, "method": args.method, "conversations": args.per_category,
                "part": args.part, "max_tokens": args.max_tokens, "repeats": args.repeats}
    (args.out / "settings.json").write_text(json.dumps(settings, indent=1))
    records: list[dict] = []
    with processes["copies kept"] as kept, processes["none kept"] as none:
        servers = {"copies kept": kept, "none kept": none}
        for server in servers.values():
            server.wait_until_up(timeout=1800)
            chat(server.url, [{"role": "user", "content": "Warm up."}], args.method, 8)
        for repeat in range(args.repeats):
            for name in list(servers)[:: 1 if repeat % 2 == 0 else -1]:
                mine = conversations[repeat * args.per_category : (repeat + 1) * args.per_category]
                wall, done = run_conversations(servers[name].url, mine, args.clients, args.method, args.max_tokens)
                records.append({"kind": "run", "repeat": repeat, "server": name, "wall": wall})
                records += [{"kind": "request", "repeat": repeat, "server": name, **r} for r in done]
                tokens = sum(len(r["token_ids"]) for r in done)
                print(f"repeat {repeat}, {name}: {tokens / wall:.1f} tokens/s", flush=True)
    references(args, [r for r in records if r["kind"] == "request"])
    (args.out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print(render(args.out))


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if args.render is not None:
        print(render(args.render))
        return
    run(args)


if __name__ == "__main__":
    main()
