"""What the quantized target paths cost in quality, against the float model, on the benchmark's prompts.

    python benchmarks/quantized_quality.py [--paths int8,int4,llamacpp] [--reference bfloat16|float32]
        [--per-category 2] [--categories a,b] [--max-new-tokens 64] [--out results/quantized-quality.json]

Paths: the torch backend's int8 and int4 targets (`--dtype`), and llama.cpp on the target's shipped GGUF
(Q4_K_M for the default target), the peer whose plain decoding the fast paths are measured against.

For every prompt (first turn, chat template), the reference target (bfloat16 by default; float32 is
about three times faster to prefill on a CPU without bf16 units) decodes greedily; then, teacher-forced
on that answer, both models score it:
- greedy agreement: the share of the answer's positions where the path's argmax is the reference's token;
- identical prefix: how many tokens the path's own greedy decoding shares with the reference answer;
- perplexity of each model on the prompt tokens themselves (the benchmark's text, not a model's output;
  the last WINDOW tokens of each prompt, scored on their own), and on the reference answer.
Prints a table per category and overall, and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from specdecode.api import load_models
from specdecode.bench.datasets import CATEGORIES, DEFAULT_CATEGORIES
from specdecode.bench.samples import sample_tasks
from specdecode.engine import GenerationConfig

WINDOW = 384  # prompt tokens scored for perplexity (a float model on a CPU prefills slowly)


def nll(model, ids: list[int], start: int) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[start:] given what precedes each, and the token count."""
    model.reset()
    logits = model.forward(torch.tensor(ids), num_logits=len(ids) - start + 1).logits[:-1]  # [len - start, vocab]
    model.reset()
    picked = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(ids) - start), torch.tensor(ids[start:])]
    return float(-picked.sum()), len(ids) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reference", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--categories", default=",".join(DEFAULT_CATEGORIES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paths", default="int8,int4,llamacpp")
    parser.add_argument("--out", type=Path, default=Path("results/quantized-quality.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tasks = sample_tasks([c for c in args.categories.split(",") if c], args.per_category)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)

    reference = load_models(drafter=None, dtype=args.reference, progress=False)
    runs = []
    for task in track(tasks, description=f"{args.reference}: decoding and scoring"):
        prompt = reference.encode_chat([{"role": "user", "content": task.turns[0]}])
        answer = reference.engine("ar").generate(prompt, config).token_ids
        runs.append({"category": task.category, "task": task.task_id, "prompt": prompt, "answer": answer,
                     "reference_prompt_nll": nll(reference.target, prompt[-WINDOW:], 1),
                     "reference_answer_nll": nll(reference.target, prompt + answer, len(prompt))})
    reference_tokenizer = reference.tokenizer
    del reference
    gc.collect()

    paths = [p for p in args.paths.split(",") if p]
    for path in paths:
        quantized = (load_models(drafter=None, backend="llamacpp", progress=False) if path == "llamacpp"
                     else load_models(drafter=None, dtype=path, progress=False))
        for run in track(runs, description=f"{path}: scoring and decoding"):
            prompt, answer = run["prompt"], run["answer"]
            quantized.target.reset()
            logits = quantized.target.forward(torch.tensor(prompt + answer), num_logits=len(answer) + 1).logits[:-1]
            quantized.target.reset()
            own = quantized.engine("ar").generate(prompt, config).token_ids
            run[path] = {
                "agreement": (int((logits.argmax(-1) == torch.tensor(answer)).sum()), len(answer)),
                "identical_prefix": next((i for i, (a, b) in enumerate(zip(answer, own)) if a != b),
                                         min(len(answer), len(own))),
                "identical": own == answer,
                "prompt_nll": nll(quantized.target, prompt[-WINDOW:], 1),
                "answer_nll": nll(quantized.target, prompt + answer, len(prompt)),
            }
        del quantized
        gc.collect()

    def perplexity(rows, key, path=None):
        pairs = [r[key] if path is None else r[path][key] for r in rows]
        return math.exp(sum(n for n, _ in pairs) / sum(c for _, c in pairs))

    table = Table(title=f"quantized targets against {args.reference}, greedy, {args.max_new_tokens} tokens, "
                        f"{len(runs)} prompts")
    for column in ("category", "path", "greedy agreement", "identical answers", "mean identical prefix",
                   f"prompt ppl {args.reference} / path", f"answer ppl {args.reference} / path"):
        table.add_column(column)
    summary = {}
    for category in [*CATEGORIES, "overall"]:
        rows = runs if category == "overall" else [r for r in runs if r["category"] == category]
        if not rows:
            continue
        for path in paths:
            agree = sum(r[path]["agreement"][0] for r in rows) / sum(r[path]["agreement"][1] for r in rows)
            s = summary.setdefault(category, {})[path] = {
                "agreement": agree, "identical": sum(r[path]["identical"] for r in rows) / len(rows),
                "identical_prefix": sum(r[path]["identical_prefix"] for r in rows) / len(rows),
                "prompt_ppl": (perplexity(rows, "reference_prompt_nll"), perplexity(rows, "prompt_nll", path)),
                "answer_ppl": (perplexity(rows, "reference_answer_nll"), perplexity(rows, "answer_nll", path)),
            }
            table.add_row(category, path, f"{s['agreement']:.1%}", f"{s['identical']:.0%}",
                          f"{s['identical_prefix']:.1f}", f"{s['prompt_ppl'][0]:.2f} / {s['prompt_ppl'][1]:.2f}",
                          f"{s['answer_ppl'][0]:.3f} / {s['answer_ppl'][1]:.3f}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "runs": [
        {k: v for k, v in r.items() if k not in ("prompt", "answer")}
        | {"answer_text": reference_tokenizer.decode(r["answer"])}
        for r in runs]}, indent=1))


if __name__ == "__main__":
    main()
