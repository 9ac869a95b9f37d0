"""Served against in-process: the same methods through `specdecode serve` and in the benchmark's own process,
one client, one interleaved `specdecode bench` run.

    python benchmarks/serve_speed.py [--methods ar,pld] [--categories code,qa] [--per-category 2]
                                     [--max-new-tokens 64] [--repeats 2] [--dtype auto] [--out DIR]

Starts `specdecode serve --methods M1,M2 --dtype D` on a free loopback port (its default method the last
of them) and runs `specdecode bench --methods M1,M2` with one `--engine served-M` row per
method (`extra_body={"method": M}`, token ids over /v1/completions, so both sides decode the very same
prompt ids), so each prompt runs in-process and served, method after method, in one interleaved order. The
server process idles while the bench decodes in-process, and the bench only reads a socket while the server
decodes. Both sides keep nothing between prompts (`bench --memory prompt`): the server keeps no memory for
requests without an owner, so methods that learn across prompts (suffix, auto) start each prompt afresh on both,
and every served request says `cache_prompt: false`, so that the server feeds every prompt whole, as the bench's own
engine does (not taking it from an earlier request's context: the same prompts come again, method after method).
Prints, per method, tokens per second served over in-process (whole requests, from the engines' own token counts)
and the inter-token pace, and writes the bench's usual report to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from specdecode.bench.server_process import ServerProcess, free_port
from specdecode.errors import UserError

SPECDECODE = [sys.executable, "-m", "specdecode"]


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ar,pld", help="run in-process and served (pld: the server's default)")
    parser.add_argument("--categories", default="code,code-edit,summarisation,qa,math,rag")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="the target's path, on both sides")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the bench and of the server")
    parser.add_argument("--out", type=Path, default=None, help="default: results/serve-speed-<time>")
    args = parser.parse_args(argv)
    args.out = args.out or Path("results") / time.strftime("serve-speed-%Y%m%d-%H%M%S")
    return args


def summarise(records: Path, methods: list[str]) -> list[str]:
    """Lines of the table: per method, in-process and served tokens per second (the mean of the requests'
    rates) and inter-token pace, and served over in-process."""
    rates: dict[str, list[float]] = defaultdict(list)
    paces: dict[str, list[float]] = defaultdict(list)
    for line in records.read_text().splitlines():
        record = json.loads(line)
        tokens = sum(record["turn_lengths"])
        if record["repeat"] < 0 or record["error"] or not record["seconds"] or tokens < 2:
            continue
        rates[record["method"]].append(tokens / record["seconds"])
        if record["prefill_seconds"] is not None:  # after the first token of each turn
            after = tokens - len(record["turn_lengths"])
            paces[record["method"]].append((record["seconds"] - record["prefill_seconds"]) / max(after, 1))
    lines = ["| method | in-process tok/s | served tok/s | served / in-process | inter-token ms (in / served) |",
             "|---|---|---|---|---|"]
    for method in methods:
        mine, served = rates.get(method), rates.get(f"served-{method}")
        if not mine or not served:
            lines.append(f"| {method} | (no records) | | | |")
            continue
        pace = [statistics.mean(paces[m]) * 1000 if paces.get(m) else float("nan")
                for m in (method, f"served-{method}")]
        lines.append(f"| {method} | {statistics.mean(mine):.2f} | {statistics.mean(served):.2f} | "
                     f"{statistics.mean(served) / statistics.mean(mine):.2f} | {pace[0]:.0f} / {pace[1]:.0f} |")
    return lines


def run(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise UserError("--methods names no method")
    port = free_port()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server's torch threads, as the bench's --threads
    serve = [*SPECDECODE, "serve", "--methods", ",".join(methods), "--method", methods[-1], "--dtype", args.dtype,
             "--port", str(port)]
    with ServerProcess("specdecode serve", serve, port) as server:
        print(f"starting {shlex.join(serve)}", flush=True)
        server.wait_until_up(timeout=1800)
        engines = [f"served-{m}=openai:{server.url}/v1;extra_body={json.dumps({'method': m, 'cache_prompt': False})}"
                   f";reference={m}" for m in methods]
        bench = [*SPECDECODE, "bench", "--methods", ",".join(methods), "--categories", args.categories,
                 "--per-category", str(args.per_category), "--max-new-tokens", str(args.max_new_tokens),
                 "--repeats", str(args.repeats), "--dtype", args.dtype, "--threads", str(args.threads),
                 "--memory", "prompt",
                 "--out", str(args.out), *(word for engine in engines for word in ("--engine", engine))]
        print(shlex.join(bench), flush=True)
        status = subprocess.run(bench, check=False).returncode
    if status == 0:
        table = "\n".join(summarise(args.out / "records.jsonl", methods))
        print(table)
        (args.out / "served-vs-in-process.md").write_text(table + "\n")
    return status


def main(argv: list[str] | None = None) -> None:
    try:
        sys.exit(run(arguments(argv)))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
