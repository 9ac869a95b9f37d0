"""What the int8 target path costs in quality, against the float model, on the benchmark's prompts.

    python benchmarks/int8_quality.py [--reference bfloat16|float32] [--per-category 2] [--categories a,b]
                                      [--max-new-tokens 64] [--out results/int8-quality.json]

For every prompt (first turn, chat template), the reference target (bfloat16 by default; float32 is
about three times faster to prefill on a CPU without bf16 units) decodes greedily; then, teacher-forced
on that answer, both models score it:
- greedy agreement: the share of the answer's positions where the int8 model's argmax is the reference's token;
- identical prefix: how many tokens the int8 model's own greedy decoding shares with the reference answer;
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
from specdecode.bench.datasets import CATEGORIES, sample_tasks
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
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("results/int8-quality.json"))
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

    quantized = load_models(drafter=None, dtype="int8", progress=False)
    for run in track(runs, description="int8: scoring and decoding"):
        prompt, answer = run["prompt"], run["answer"]
        quantized.target.reset()
        logits = quantized.target.forward(torch.tensor(prompt + answer), num_logits=len(answer) + 1).logits[:-1]
        quantized.target.reset()
        run["agreement"] = (int((logits.argmax(-1) == torch.tensor(answer)).sum()), len(answer))
        own = quantized.engine("ar").generate(prompt, config).token_ids
        run["identical_prefix"] = next((i for i, (a, b) in enumerate(zip(answer, own)) if a != b), min(len(answer), len(own)))
        run["identical"] = own == answer
        run["int8_prompt_nll"] = nll(quantized.target, prompt[-WINDOW:], 1)
        run["int8_answer_nll"] = nll(quantized.target, prompt + answer, len(prompt))

    def perplexity(rows, key):
        total, count = (sum(r[key][i] for r in rows) for i in (0, 1))
        return math.exp(total / count)

    table = Table(title=f"int8 target against {args.reference}, greedy, {args.max_new_tokens} tokens, {len(runs)} prompts")
    for column in ("category", "greedy agreement", "identical answers", "mean identical prefix",
                   f"prompt ppl {args.reference} / int8", f"answer ppl {args.reference} / int8"):
        table.add_column(column)
    summary = {}
    for category in [*CATEGORIES, "overall"]:
        rows = runs if category == "overall" else [r for r in runs if r["category"] == category]
        if not rows:
            continue
        agree = sum(r["agreement"][0] for r in rows) / sum(r["agreement"][1] for r in rows)
        summary[category] = {
            "agreement": agree, "identical": sum(r["identical"] for r in rows) / len(rows),
            "identical_prefix": sum(r["identical_prefix"] for r in rows) / len(rows),
            "prompt_ppl": (perplexity(rows, "reference_prompt_nll"), perplexity(rows, "int8_prompt_nll")),
            "answer_ppl": (perplexity(rows, "reference_answer_nll"), perplexity(rows, "int8_answer_nll")),
        }
        s = summary[category]
        table.add_row(category, f"{s['agreement']:.1%}", f"{s['identical']:.0%}", f"{s['identical_prefix']:.1f}",
                      f"{s['prompt_ppl'][0]:.2f} / {s['prompt_ppl'][1]:.2f}",
                      f"{s['answer_ppl'][0]:.3f} / {s['answer_ppl'][1]:.3f}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "runs": [
        {k: v for k, v in r.items() if k not in ("prompt", "answer")} | {"answer_text": reference_tokenizer.decode(r["answer"])}
        for r in runs]}, indent=1))


if __name__ == "__main__":
    main()
