"""A conversation's turns in the server's batch engine, in-process, with shared prompt prefixes and without: each turn's
prompt resends the conversation so far (the chat template over every message, each answer as its text, as a client
sends it), once to an engine that keeps the last ended sequence's context for the next prompt to take a prefix of
(`BatchEngine(keep_ended=1)`, as the server keeps them) and once to one that feeds every prompt whole
(`share_prefixes=False`), the two in turns, the first to go alternating.

    python benchmarks/conversation_prefixes.py [--categories multi-turn] [--per-category 4] [--part held-out]
                                               [--max-new-tokens 128] [--dtype auto] [--threads 2]

Plain decoding (`ar`) in both: the time to the first token is the prompt's prefill, whatever the method. Per turn:
the prompt's tokens, those taken from the cache, the time to the first token with the prefix shared and fed, and
whether the two answers are the same tokens (both are greedy decoding's). Then, per turn of the conversations, the
medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.api import load_models
from specdecode.bench.samples import sample_tasks
from specdecode.engine import GenerationConfig, GenerationResult
from specdecode.engine.batch import BatchEngine
from specdecode.serve.worker import own_cache


def answer(engine: BatchEngine, prompt: list[int], config: GenerationConfig) -> tuple[float, GenerationResult]:
    """One request alone in the engine: (seconds to its first token, its result)."""
    start, first = time.perf_counter(), None
    engine.add(prompt, config)
    while True:
        for _, event, result in engine.step():
            if event.token_ids and first is None:
                first = time.perf_counter() - start
            if result is not None:
                return first if first is not None else time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--categories", default="multi-turn")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--part", default="held-out", choices=["tuning", "held-out"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = load_models(dtype=args.dtype, progress=False)
    tasks = sample_tasks(args.categories.split(","), args.per_category, part=args.part)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    engines = {"shared": BatchEngine(own_cache(models.target), models.tokenizer, keep_ended=1),
               "fed": BatchEngine(own_cache(models.target), models.tokenizer, share_prefixes=False)}
    for engine in engines.values():  # warm-up (first forwards), leaving nothing to take a prefix of
        answer(engine, models.tokenizer("Warm up.")["input_ids"], GenerationConfig(max_new_tokens=4))
    print("| conversation | turn | prompt tokens | taken from the cache | TTFT shared (s) | TTFT fed (s) | "
          "same answer |")
    print("|---|---|---|---|---|---|---|")
    by_turn: dict[int, list[tuple[float, float, int, int]]] = {}
    runs = 0
    for number, task in enumerate(tasks):
        messages: list[dict] = []
        for turn, text in enumerate(task.turns):
            messages.append({"role": "user", "content": text})
            prompt = models.encode_chat(messages)
            order = ["shared", "fed"] if runs % 2 == 0 else ["fed", "shared"]
            runs += 1
            done = {name: answer(engines[name], prompt, config) for name in order}
            (shared, kept), (fed, plain) = done["shared"], done["fed"]
            same = kept.token_ids == plain.token_ids
            print(f"| {number} ({task.category}) | {turn + 1} | {len(prompt)} | {kept.cached_tokens} | {shared:.2f} | "
                  f"{fed:.2f} | {'yes' if same else 'NO'} |", flush=True)
            by_turn.setdefault(turn + 1, []).append((shared, fed, kept.cached_tokens, len(prompt)))
            messages.append({"role": "assistant", "content": models.tokenizer.decode(kept.token_ids,
                                                                                     skip_special_tokens=True)})
    print(f"\n{len(tasks)} conversations ({args.part} part of {args.categories}), {args.max_new_tokens} tokens an "
          f"answer at most, plain decoding; medians per turn\n")
    print("| turn | conversations | prompt tokens | taken from the cache | TTFT shared (s) | TTFT fed (s) |")
    print("|---|---|---|---|---|---|")
    for turn, rows in sorted(by_turn.items()):
        median = [statistics.median(column) for column in zip(*rows)]
        print(f"| {turn} | {len(rows)} | {median[3]:.0f} | {median[2]:.0f} | {median[0]:.2f} | {median[1]:.2f} |")


if __name__ == "__main__":
    main()
