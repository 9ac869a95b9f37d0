"""`specdecode demo`: every method answers the same prompts on the default models, side by side."""

from __future__ import annotations

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from specdecode.api import load_models
from specdecode.bench.exactness import diagnose
from specdecode.engine import GenerationConfig, GenerationResult
from specdecode.methods import choose
from specdecode.tables import compact_table

DEMO_PROMPTS = [
    "Add type hints and a docstring to this function, and return the whole function:\n\n"
    "```python\ndef moving_average(values, window):\n    result = []\n    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n        result.append(sum(chunk) / window)\n    return result\n```",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
]


# One of each family, in a few minutes: the self-speculative methods (layerskip, earlyexit) search their
# layers on first use (minutes), so they are left to `specdecode generate` and the benchmark.
DEMO_METHODS = ["ar", "auto", "draft", "draft-tree", "pld", "pld-tree", "rest", "lookahead", "jacobi", "suffix",
                "eagle-tree", "medusa-tree", "composite"]


HEAD_METHODS = {"eagle-tree": "eagle", "medusa-tree": "medusa"}  # the demo's methods that draft with a shipped head


def demo_methods(target: str) -> list[str]:
    """DEMO_METHODS but the head methods whose kind of head ships for no such target (`heads.ships`)."""
    from specdecode.drafters.heads import ships

    return [name for name in DEMO_METHODS if name not in HEAD_METHODS or ships(target, HEAD_METHODS[name])]


def run_demo(target: str, drafter: str, dtype: str, draft_dtype: str, max_new_tokens: int,
             device: str | None = None) -> None:
    console = Console()
    methods = demo_methods(target)
    if left := [name for name in DEMO_METHODS if name not in methods]:
        console.print(f"[dim]{', '.join(left)}: no head of theirs ships for {target}; left out[/dim]")
    choices = {name: choose(name) for name in methods}
    models = load_models(target, drafter, dtype=dtype, draft_dtype=draft_dtype, device=device)
    engines = {name: models.engine_for(choice) for name, choice in choices.items()}
    prompts = [models.encode(p, chat=True) for p in DEMO_PROMPTS]
    with console.status("Warming up"):
        for engine in engines.values():
            engine.generate(prompts[0], GenerationConfig(max_new_tokens=4))
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    results: dict[str, list[GenerationResult]] = {name: [] for name in engines}
    for number, (text, ids) in enumerate(zip(DEMO_PROMPTS, prompts), 1):
        console.rule(f"Prompt {number}")
        console.print(Text(text), highlight=False)  # (Text: brackets in prompts and answers are not markup)
        reference = None
        for name, engine in engines.items():
            with console.status(f"{name}: generating {max_new_tokens} tokens"):
                result = engine.generate(ids, config)
            results[name].append(result)
            note = ""
            if reference is None:
                reference = result.token_ids
            elif choices[name].method.lossless:
                divergence = diagnose(models.target, ids, reference, result.token_ids)
                note = "identical to ar" if divergence is None else divergence.describe()
            title = (f"{name}: {result.tokens_per_second:.1f} tokens/s, {result.mean_accepted_tokens:.2f} tokens "
                     "per target forward")
            console.print(Panel(Text(result.text), title=Text(title), subtitle=Text(note) if note else None,
                                title_align="left"), highlight=False)
    # all prompts of a method as one generation, so every figure comes from specdecode.metrics
    rows = [
        GenerationResult(
            prompt_ids=[], token_ids=[t for r in rs for t in r.token_ids], text="",
            steps=[s for r in rs for s in r.steps], seconds=sum(r.seconds for r in rs), finish_reason="", method=name,
        ).summary()
        for name, rs in results.items()
    ]
    console.rule("All prompts")
    console.print(stats_table(rows, baseline_tps=rows[0]["tokens_per_second"]))


def stats_table(rows: list[dict], baseline_tps: float | None = None) -> Table:
    """One row per run (`GenerationResult.summary()`), with speedups over `baseline_tps` if given: the
    table of `specdecode generate` and of the demo, short column names explained below it (`--json` has
    every figure)."""
    meanings = {
        "tokens": "new tokens", "s": "seconds", "tok/s": "new tokens per second", "fwd": "target forwards",
        "len": "new tokens per target forward", "acc": "share of drafted tokens accepted",
    }
    if baseline_tps:
        meanings["x ar"] = "speedup, tok/s over ar's"
    table = compact_table(meanings)
    table.add_column("method", no_wrap=True)
    for column in meanings:
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        acceptance = row["acceptance_rate"]
        cells = [
            row["method"],
            str(row["new_tokens"]),
            f"{row['seconds']:.2f}",
            f"{row['tokens_per_second']:.2f}",
            str(row["target_forwards"]),
            f"{row['mean_accepted_tokens']:.2f}",
            "-" if acceptance is None else f"{acceptance:.0%}",
        ]
        if baseline_tps:
            cells.append(f"{row['tokens_per_second'] / baseline_tps:.2f}x")
        table.add_row(*cells)
    return table
