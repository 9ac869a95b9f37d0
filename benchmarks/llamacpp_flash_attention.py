"""The llama.cpp backend with llama.cpp's flash attention (`auto`, its default) or without (`off`, ours): plain decoding
and `pld-tree` on the default pair, greedy, each prompt twice; whether each method's answers are the same every time,
whether `pld-tree`'s equal plain decoding's, and each method's tokens per second (the second round). Run it once a
process, the two settings in turns, several times (the machine's pace drifts between processes):

    for mode in auto off auto off; do python benchmarks/llamacpp_flash_attention.py $mode; done

(docs/backends.md, the llama.cpp backend, has what it measured.)
"""

from __future__ import annotations

import argparse
import json
import time

import llama_cpp

from specdecode.api import load_models
from specdecode.engine import GenerationConfig

PROMPTS = ["Write a Python function that parses a CSV file and returns a list of dicts, with error handling.",
           "Explain the difference between a process and a thread, with an example in Python.",
           "Write a short story about a robot who learns to paint, in about 150 words."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["auto", "off"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.mode == "auto":  # the context made as the backend makes it, but with llama.cpp's default
        init = llama_cpp.llama_init_from_model

        def with_flash_attention(model, params):
            params.flash_attn_type = -1
            return init(model, params)

        llama_cpp.llama_init_from_model = with_flash_attention
    models = load_models(backend="llamacpp", progress=False)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    answers: dict[tuple[str, int], set] = {}
    speed: dict[str, list[float]] = {"ar": [], "pld-tree": []}
    for round_ in range(2):
        for method in speed:
            engine = models.engine(method)
            for i, prompt in enumerate(PROMPTS):
                ids = models.encode(prompt, chat=True)
                start = time.perf_counter()
                result = engine.generate(ids, config)
                seconds = time.perf_counter() - start
                answers.setdefault((method, i), set()).add(tuple(result.token_ids))
                if round_:  # (the first round warms up)
                    speed[method].append(len(result.token_ids) / seconds)
    print(args.mode, json.dumps({
        "answers a method gave a prompt": {f"{m}/{i}": len(seen) for (m, i), seen in answers.items()},
        "pld-tree = ar": [answers[("ar", i)] == answers[("pld-tree", i)] for i in range(len(PROMPTS))],
        "tokens/s": {m: round(sum(v) / len(v), 2) for m, v in speed.items()}}))


if __name__ == "__main__":
    main()
