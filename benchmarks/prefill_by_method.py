"""Does a method's prompt cost more to feed than plain decoding's? The time to the first token of one long prompt,
method after method in interleaved rounds, and how much of it the target's forwards take.

    python benchmarks/prefill_by_method.py [--methods ar,pld,auto] [--paragraphs 40] [--rounds 4] [--dtype int4]
                                           [--category long-context/4k]

Each run feeds the same chat-templated prompt (a summarisation request over `--paragraphs` repeated paragraphs, or
with `--category` the first turn of that benchmark category's first task) and generates two tokens, so what it
measures is the prompt's chunks and the first step. The methods take turns in the benchmark's balanced order
(`bench.harness.method_order`), so that none always follows the same one. Prints per method the
median over rounds of the whole run, of the time inside `target.forward`, and of the rest (the drafter's
`begin`, the suffix index, the hidden states a head reads), and the forwards' shapes of the first round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.api import load_models
from specdecode.bench.samples import sample_tasks
from specdecode.bench.harness import method_order
from specdecode.engine import GenerationConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ar,pld,auto")
    parser.add_argument("--paragraphs", type=int, default=40, help="the prompt's length (about 20 tokens each)")
    parser.add_argument("--category", default=None, help="a benchmark category (long-context/4k...): its first task")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = load_models(dtype=args.dtype, drafter=None, progress=False)
    engines = {name: models.engine(name.strip()) for name in args.methods.split(",") if name.strip()}
    if args.category:
        task = sample_tasks([args.category], per_category=1)[0]
        prompt = models.encode_chat([{"role": "user", "content": task.turns[0]}])
    else:
        text = " ".join(f"Paragraph {i}: the committee met again and discussed the budget, the roads and the school."
                        for i in range(args.paragraphs))
        prompt = models.encode("Summarise this text:\n" + text, chat=True)
    print(f"prompt: {len(prompt)} tokens; chunk: {next(iter(engines.values())).prefill_chunk} tokens")

    forward, spent = models.target.forward, []

    def timed(*positional, **named):  # the target's forwards: (tokens fed, hidden states asked, seconds)
        start = time.perf_counter()
        out = forward(*positional, **named)
        spent.append((positional[0].shape[-1], named.get("output_hidden"), time.perf_counter() - start))
        return out

    models.target.forward = timed  # type: ignore[method-assign]
    config = GenerationConfig(max_new_tokens=2)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        for name in method_order(list(engines), round_):
            engine = engines[name]
            engine.forget()
            spent.clear()
            start = time.perf_counter()
            engine.generate(prompt, config)
            runs[name].append((time.perf_counter() - start, sum(seconds for _, _, seconds in spent)))
            whole, forwards = runs[name][-1]
            print(f"round {round_} {name}: {whole:.2f} s, in forwards {forwards:.2f} s", flush=True)
            if round_ == 0:
                print(f"{name}: forwards (tokens, hidden asked): {[(n, h) for n, h, _ in spent]}")
    print("| method | to the first token (s) | in the target's forwards (s) | the rest (s) |")
    print("|---|---|---|---|")
    for name, values in runs.items():
        whole, forwards = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        rest = statistics.median(v[0] - v[1] for v in values)
        print(f"| {name} | {whole:.3f} | {forwards:.3f} | {rest:.3f} |")


if __name__ == "__main__":
    main()
