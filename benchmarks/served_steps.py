"""`auto`'s steps in-process and through the server, in one process: whether serving changes what a step costs or
what the engine decides. The server runs on a thread (`serve.app.ServerThread`) beside an in-process engine of the
same method on the same models; each round runs the prompts in-process, then served (the client waits on one
response), then served streamed, and prints per mode the wall time and, from the engine's own steps (the prompt's
feeding left out), how many steps, their drafting and verifying times and the tokens drafted a step.

    python benchmarks/served_steps.py [--method auto] [--categories summarisation,qa,code,rag] [--per-category 2]
                                      [--part tuning] [--rounds 2] [--max-new-tokens 64] [--dtype int4]

The client is in the server's process here (a separate client process is `serve_speed.py`'s setting): what this
separates is the serving path itself (worker thread, event loop, streaming) from a second process on the cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import urllib.request

import torch

from specdecode.api import load_models
from specdecode.bench.samples import sample_tasks
from specdecode.engine import GenerationConfig
from specdecode.engine import loop
from specdecode.engine.batch import BatchEngine
from specdecode.models.registry import DEFAULT_TARGET
from specdecode.serve.app import Server, ServerThread, create_app

MODES = ("in-process", "served", "streamed")


@dataclasses.dataclass
class Step:
    """What the table reads of one verified step of a sequence, whichever engine ran it."""

    num_pending: int  # context tokens the forward fed (1 once the prompt is in)
    drafted: int
    draft_seconds: float
    verify_seconds: float


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="auto")
    parser.add_argument("--categories", default="summarisation,qa,code,rag")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--part", default="tuning", help="which part of each category's prompts (bench.samples)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = load_models(DEFAULT_TARGET, None, dtype=args.dtype, progress=True)
    # (no copies of ended contexts: the same prompts come again, round after round)
    server = Server(models, "target", args.method, methods=["ar", args.method], prefix_cache=0)
    thread = ServerThread(create_app(server))
    steps: list[Step] = []  # every verified step of any engine in this process: the single-sequence engine's
    original, batched = loop.SpeculativeEngine.step, BatchEngine.step  # (in-process), the batch's (served)

    def recording(self, *a, **k):
        out = original(self, *a, **k)
        steps.append(Step(out.num_pending, len(out.draft), out.draft_seconds, out.verify_seconds))
        return out

    def recording_batch(self, *a, **k):
        out = batched(self, *a, **k)
        steps.extend(Step(e.stats.forward_tokens - e.stats.drafted - e.stats.auxiliary_tokens, e.stats.drafted,
                          e.stats.draft_seconds, e.stats.verify_seconds) for _, e, _ in out if e.token_ids)
        return out

    loop.SpeculativeEngine.step = recording  # type: ignore[method-assign]
    BatchEngine.step = recording_batch  # type: ignore[method-assign]
    tasks = sample_tasks([c.strip() for c in args.categories.split(",") if c.strip()], args.per_category,
                         part=args.part)
    prompts = [models.encode_chat([{"role": "user", "content": t.turns[0]}]) for t in tasks]
    engine = models.engine(args.method)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)

    def served(ids: list[int], stream: bool) -> None:
        body = {"model": "target", "prompt": ids, "max_tokens": args.max_new_tokens, "temperature": 0,
                "method": args.method, "stream": stream}
        request = urllib.request.Request(f"{thread.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1800) as response:
            for _ in response:
                pass

    served(prompts[0], False)  # warm-up, both ways
    engine.generate(prompts[0], GenerationConfig(max_new_tokens=8))
    print("| round | mode | wall s | steps | drafting ms (median / mean) | verifying ms (median / mean) "
          "| drafted / step |")
    print("|---|---|---|---|---|---|---|")
    for round_ in range(args.rounds):
        for mode in MODES:
            steps.clear()
            start = time.perf_counter()
            for ids in prompts:
                if mode == "in-process":
                    engine.forget()  # as the server forgets before each request without a memory owner
                    engine.generate(ids, config)
                else:
                    served(ids, stream=mode == "streamed")
            wall = time.perf_counter() - start
            decoding = [s for s in steps if s.num_pending == 1]
            draft = [s.draft_seconds * 1e3 for s in decoding]
            verify = [s.verify_seconds * 1e3 for s in decoding]
            print(f"| {round_} | {mode} | {wall:.1f} | {len(decoding)} | {statistics.median(draft):.2f} / "
                  f"{statistics.mean(draft):.2f} | {statistics.median(verify):.1f} / {statistics.mean(verify):.1f} | "
                  f"{statistics.mean(s.drafted for s in decoding):.2f} |", flush=True)
    thread.stop()


if __name__ == "__main__":
    main()
