"""Whether one tenant's long prompt, or its new memory owner, holds up another tenant's short request.

    python benchmarks/serve_fairness.py [--url URL --key-a KEY --key-b KEY] [--repeats 3] [--lengths 3000,12000]
                                        [--methods pld,auto]

Without --url it serves the default models itself (dtype auto) with two API keys, on loopback, keeping no copies of
ended requests' contexts (B's short request comes again and again; with --url, start the server with
`--prefix-cache-gib 0`). Cases, each against key B's short request (a 2-token greedy completion, in each of
--methods: `pld`, and `auto`, the server's default) measured alone first (median of --repeats):

1. key A sends a prompt of each --lengths token ids (max_tokens 16) and disconnects after --leave-after
   seconds; B's request is sent --offset seconds after A's, while A's prompt is being fed. Reported: B's
   latency, and (own server only) how long after A left the server dropped A's prompt.
2. key A sends a prompt of --timeout-length token ids to a server whose request timeout is --timeout
   seconds (own server: set for this case only; with --url, start the server with --request-timeout):
   the seconds until A's answer and its finish reason.
3. key A sends a request with `user` set to a new name and method `eagle3-online` (a new memory owner: its
   learning head is built for it), B's request --owner-offset seconds later. Reported: A's seconds, B's
   latency, and B's alone just before.
4. key A streams a long answer (--long-tokens, the same method as B's) and B's request is sent --offset seconds
   later, while A's answer is under way: B joins the batch at the next step. Reported: B's latency against its
   latency alone, in seconds and in plain steps (a plain-decoding step of B's, measured), and how much of A's
   answer was still to come when B's was in.

Also reported: a step of B's alone (its 10-token form less its 2-token form, over 8 tokens), the chunk a
prefill forward feeds at a prompt's start (own server: `costs.prefill_chunk` of the target's curve) and the
CPU. Prints a markdown table; --out writes it to a file too. B deep into a long prompt, rather than near
its start: `--lengths 12000 --offset 120 --leave-after 125 --repeats 1`.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import platform
import secrets
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

MODEL = "default"


@dataclasses.dataclass
class Target:
    """Where the requests go."""

    url: str
    key_a: str
    key_b: str


def post(target: Target, key: str, body: dict, timeout: float = 600) -> tuple[float, dict]:
    """(seconds, JSON answer) of a POST to /v1/completions; a streamed answer is read to its end, and its answer
    is the last event's JSON."""
    connection = http.client.HTTPConnection(target.url.removeprefix("http://"), timeout=timeout)
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", body=json.dumps(body),
                       headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    response = connection.getresponse()
    text = response.read().decode()
    seconds = time.perf_counter() - start
    if body.get("stream") and response.status == 200:
        events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: {")]
        text = events[-1] if events else "{}"
    answer = json.loads(text)
    connection.close()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {answer}")
    return seconds, answer


def short(target: Target, max_tokens: int = 2, method: str = "pld") -> float:
    """Seconds of key B's short request."""
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0, "method": method}
    return post(target, target.key_b, body)[0]


def beside_a_stream(target: Target, method: str, tokens: int, offset: float) -> tuple[float, float, float]:
    """Key B's short request `offset` seconds into key A's streamed answer of `tokens` tokens (greedy, `method`):
    (B's seconds, A's seconds, seconds of A's answer after B's was in)."""
    body = {"model": MODEL, "prompt": "def quicksort(items):", "max_tokens": tokens, "temperature": 0, "method": method,
            "stream": True}
    with ThreadPoolExecutor(1) as pool:
        a = pool.submit(post, target, target.key_a, body)
        time.sleep(offset)
        b = short(target, 2, method)
        b_done = time.perf_counter()
        a_seconds = a.result()[0]
        a_done = time.perf_counter()
    return b, a_seconds, a_done - b_done


def leaving(target: Target, key: str, body: dict, after: float) -> threading.Thread:
    """Send a request and close the connection `after` seconds later, unread (a client that gives up)."""
    payload = json.dumps(body).encode()
    host, port = target.url.removeprefix("http://").rsplit(":", 1)
    connection = socket.create_connection((host, int(port)))
    connection.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                        f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload)
    timer = threading.Timer(after, connection.close)
    timer.start()
    return timer


def token_ids(n: int, seed: int) -> list[int]:
    return torch.randint(1000, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running `specdecode serve` (default: serve the default models here)")
    parser.add_argument("--key-a", help="with --url: the first tenant's key")
    parser.add_argument("--key-b", help="with --url: the second tenant's key")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", default="3000,12000")
    parser.add_argument("--offset", type=float, default=1.0, help="seconds between A's long prompt and B's request")
    parser.add_argument("--owner-offset", type=float, default=1.0, help="seconds between A's new owner and B's request")
    parser.add_argument("--leave-after", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=6.0)
    parser.add_argument("--timeout-length", type=int, default=6000)
    parser.add_argument("--methods", default="pld,auto", help="B's short request's methods (and A's long answer's)")
    parser.add_argument("--long-tokens", type=int, default=256, help="the tokens of A's long answer (case 4)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    state = running = None
    if args.url:
        target = Target(args.url.rstrip("/"), args.key_a, args.key_b)
    else:
        from specdecode.api import load_models
        from specdecode.serve.app import Server, ServerThread, create_app
        from specdecode.serve.guard import Guard

        keys = (f"probe-a-{secrets.token_hex(12)}", f"probe-b-{secrets.token_hex(12)}")
        models = load_models(progress=False)
        # (no copies of ended contexts: B's short request comes again and again)
        state = Server(models, MODEL, default_method="auto", methods=["pld", "auto", "ar", "eagle3-online"],
                       prefix_cache=0)
        running = ServerThread(create_app(state, Guard(api_keys=keys)))
        target = Target(running.url, *keys)
    rows: list[tuple[str, str]] = []

    def note(case: str, figure: str) -> None:
        rows.append((case, figure))
        print(f"{case}: {figure}", flush=True)

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    note("CPU", f"{cpu}, torch capability {torch.backends.cpu.get_cpu_capability()}, "
                f"{torch.get_num_threads()} threads")
    if state is not None:
        from specdecode.models.costs import prefill_chunk

        curve = state.models.target.cost_curve()
        chunk = prefill_chunk(curve)
        note("prefill chunk", f"{chunk} tokens (curve's prefill {curve.prefill * 1000:.1f} ms a token at 256)")

    methods = args.methods.split(",")
    alone_by = {}
    for method in [*methods, "ar"]:
        for _ in range(2):  # warm-up
            short(target, 2, method)
        alone_by[method] = statistics.median(short(target, 2, method) for _ in range(args.repeats))
        note(f"B alone ({method})", f"{alone_by[method]:.2f} s")
    step = (statistics.median(short(target, 10, "ar") for _ in range(args.repeats)) - alone_by["ar"]) / 8
    note("a step (B's 10-token form's time less the 2-token's, over 8, plain decoding)", f"{step:.2f} s")
    for method in methods:  # case 4: B beside A's long answer, in the batch
        tries = [beside_a_stream(target, method, args.long_tokens, args.offset) for _ in range(args.repeats)]
        for number, (b, a, after) in enumerate(tries, 1):
            note(f"B while A streams {args.long_tokens} tokens ({method}, try {number})",
                 f"{b:.2f} s (alone {alone_by[method]:.2f} s); A's {a:.1f} s, {after:.1f} s of it after B's was in")
        median = statistics.median(b for b, _, _ in tries)
        over = median - alone_by[method]
        note(f"B while A streams, median ({method})",
             f"{median:.2f} s: {over:.2f} s over alone, {over / step:.1f} steps")
    alone = alone_by["pld"] if "pld" in methods else alone_by[methods[0]]

    for n in (int(x) for x in args.lengths.split(",")):
        with_long = []
        for repeat in range(args.repeats):
            body = {"model": MODEL, "prompt": token_ids(n, repeat), "max_tokens": 16, "temperature": 0}
            sent = time.perf_counter()
            timer = leaving(target, target.key_a, body, args.leave_after)
            time.sleep(args.offset)
            with_long.append(short(target))
            timer.join()
            left = time.perf_counter()
            dropped = ""
            if state is not None:  # until the worker holds no sequence
                while len(state.worker.batch) > 0:
                    time.sleep(0.01)
                dropped = f", A's prompt dropped {time.perf_counter() - left:.2f} s after A left"
            note(f"B while A sends {n} tokens (try {repeat + 1})",
                 f"{with_long[-1]:.2f} s (A left at {left - sent:.1f} s{dropped})")
        note(f"B while A sends {n} tokens, median", f"{statistics.median(with_long):.2f} s (alone {alone:.2f} s)")

    if state is not None:
        kept = state.limits
        state.limits = dataclasses.replace(kept, request_seconds=args.timeout)
    body = {"model": MODEL, "prompt": token_ids(args.timeout_length, 99), "max_tokens": 16, "temperature": 0}
    seconds, answer = post(target, target.key_a, body)
    note(f"A's {args.timeout_length}-token prompt, request timeout {args.timeout:g} s",
         f"answered after {seconds:.2f} s, finish_reason {answer['choices'][0]['finish_reason']}, "
         f"{answer['usage']['completion_tokens']} tokens")
    if state is not None:
        state.limits = kept

    for repeat in range(args.repeats):
        before = short(target)  # B alone just before, as the machine is now
        owner = f"probe-owner-{secrets.token_hex(6)}"
        body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0,
                "method": "eagle3-online", "user": owner}
        with ThreadPoolExecutor(1) as pool:
            owners = pool.submit(post, target, target.key_a, body)
            time.sleep(args.owner_offset)
            b = short(target)
            seconds = owners.result()[0]
        note(f"B while A's new eagle3-online owner is built (try {repeat + 1})",
             f"{b:.2f} s (alone just before {before:.2f} s); A's request {seconds:.2f} s")

    if running is not None:
        running.stop()
    table = "| case | figure |\n|---|---|\n" + "\n".join(f"| {case} | {figure} |" for case, figure in rows) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
