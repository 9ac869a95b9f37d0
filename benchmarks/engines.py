"""Our server beside llama.cpp's llama-server three ways, as engines of one `specdecode bench` run, with one command.

    python benchmarks/engines.py [--categories code,math] [--per-category 2] [--max-new-tokens 64] [--repeats 1]
                                 [--method pld] [--dtype int4] [--out results/engines]        (or: make bench-engines)

Starts, each on a free loopback port, `specdecode serve --method M --dtype D` (row `ours`) and llama-server
serving the target's GGUF plain (`llama`), with the draft model's GGUF (`llama-draft`: `-md` with
`--spec-type draft-simple`) and with n-gram drafting (`llama-ngram`: `--spec-type ngram-simple`), waits until
each answers, then runs `specdecode bench` with the four as `--engine` rows and `ar` in the bench's own process.
The bench measures every row the same way from the client (tokens per second from the engines' token counts,
time to the first token, inter-token latency, the speculative figures each engine reports, greedy output
against a reference: `ar` for ours and plain llama-server, plain llama-server for its speculative modes, since
its Q4_K_M weights are not ours) and writes its usual report to --out (report.md, records.jsonl, plots). The
servers are stopped at the end, however the run ends. Needs `make models` and `make llama-server`.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import subprocess
import sys
import time
from pathlib import Path

from specdecode.bench.datasets import DEFAULT_CATEGORIES
from specdecode.bench.llamacpp_peers import engine_rows, server_binary
from specdecode.bench.server_process import ServerProcess, free_port
from specdecode.errors import UserError
from specdecode.models.loading import DEFAULT_DRAFTER, DEFAULT_TARGET, gguf_path
from specdecode.models.registry import get_model

SPECDECODE = [sys.executable, "-m", "specdecode"]


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--categories", default=",".join(DEFAULT_CATEGORIES))
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--method", default="pld", help="our server's method")
    parser.add_argument("--dtype", default="int4", help="our server's and ar's weights (int4: our fastest CPU path)")
    parser.add_argument("--threads", type=int, default=2, help="the bench's and each llama-server's")
    parser.add_argument("--out", type=Path, default=None, help="default: results/engines-<time>")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="ours and ar: a registered name or a model folder")
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER)
    parser.add_argument("--target-gguf", type=Path, default=gguf_path(get_model(DEFAULT_TARGET)), help="llama-server's")
    parser.add_argument("--draft-gguf", type=Path, default=gguf_path(get_model(DEFAULT_DRAFTER)))
    args = parser.parse_args(argv)
    args.out = args.out or Path("results") / time.strftime("engines-%Y%m%d-%H%M%S")
    return args


def check_prerequisites(args: argparse.Namespace) -> None:
    """One-line errors, before anything starts, for what `make llama-server` and `make models` provide."""
    server_binary()
    for option, path in (("--target-gguf", args.target_gguf), ("--draft-gguf", args.draft_gguf)):
        if not path.is_file():
            raise UserError(f"no GGUF file at {path}: run `make models` (or pass {option})")


def bench_command(args: argparse.Namespace, engines: list[str]) -> list[str]:
    return [*SPECDECODE, "bench", "--categories", args.categories, "--per-category", str(args.per_category),
            "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats), "--dtype", args.dtype,
            "--threads", str(args.threads), "--target", args.target, "--drafter", args.drafter, "--out", str(args.out),
            *(word for option in engines for word in ("--engine", option))]


def run(args: argparse.Namespace) -> int:
    """Start the four servers, run the bench over them, stop them; the bench's exit status."""
    check_prerequisites(args)
    port = free_port()
    serve = [*SPECDECODE, "serve", "--method", args.method, "--dtype", args.dtype, "--port", str(port),
             "--target", args.target, "--drafter", args.drafter]
    with contextlib.ExitStack() as servers:
        print(f"starting our server ({args.method}, {args.dtype}) and llama-server plain, draft, n-gram", flush=True)
        ours = servers.enter_context(ServerProcess("specdecode serve", serve, port))  # loads while llama-server starts
        # on two busy cores a llama-server took 3 minutes to answer, ours (int4) 12: generous limits
        llama = servers.enter_context(engine_rows(args.target_gguf, args.draft_gguf, args.threads, timeout=900))
        ours.wait_until_up(timeout=1800)
        # (no row takes a prompt from an earlier request's context: llama-server's are sent the same field)
        command = bench_command(args, [f'ours=openai:{ours.url}/v1;extra_body={{"cache_prompt":false}}',
                                       *llama.values()])
        print(shlex.join(command), flush=True)
        return subprocess.run(command, check=False).returncode


def main(argv: list[str] | None = None) -> None:
    try:
        sys.exit(run(arguments(argv)))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # the servers are stopped already
        sys.exit(130)


if __name__ == "__main__":
    main()
