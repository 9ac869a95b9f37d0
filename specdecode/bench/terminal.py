"""The benchmark's summary on a terminal of 80 columns: the leaderboard by category and the figures per method,
with short column names and their legend (`specdecode.tables`). Means only: the spreads, the acceptance by
draft position and the engines' tables are in report.md, and every run in records.jsonl."""

from __future__ import annotations

from rich.table import Table

from specdecode.bench.datasets import LONG_CONTEXT
from specdecode.bench.report import OVERALL, MethodSummary
from specdecode.tables import compact_table

# the categories' column names, and what a long-context length's column is called
SHORT_CATEGORIES = {"multi-turn": "turn", "code-edit": "edit", "summarisation": "summ", "translation": "tran",
                    OVERALL: "all"}
CELL_WIDTH = 6  # a leaderboard column: "2.04", "12.3" or "fail" and the two spaces before it


def short_category(category: str) -> str:
    """A category's column name: "edit" for code-edit, "8k" for long-context/8k, the name itself if short."""
    if category.startswith(LONG_CONTEXT + "/"):
        return category.removeprefix(LONG_CONTEXT + "/")
    return SHORT_CATEGORIES.get(category, category)


def _ratio(pair: tuple[float, float]) -> str:
    """A speedup's mean in four characters (the legend says it is a ratio)."""
    mean = pair[0]
    if mean != mean:  # nan: no run of it succeeded
        return "fail"
    return f"{mean:.2f}" if mean < 10 else f"{mean:.1f}"


def leaderboard(summaries: list[MethodSummary], reference: str = "ar", width: int = 80) -> list[Table]:
    """Speedup over `reference` per category, overall last; as many tables as it takes to keep each within
    `width` columns (the default eight categories and overall fit in one)."""
    categories = [c for c in summaries[0].cells if c != OVERALL] + [OVERALL]
    method_width = max(len("method"), *(len(s.method) for s in summaries))
    per_table = max(1, (width - method_width) // CELL_WIDTH)
    tables = []
    for start in range(0, len(categories), per_table):
        shown = categories[start:start + per_table]
        meanings = {"each cell": f"speedup over {reference} (new tokens per second, as a ratio; mean of repeats)"}
        meanings.update({short_category(c): c for c in shown if short_category(c) != c})
        if any(c.startswith(LONG_CONTEXT + "/") for c in shown):
            meanings["4k, 8k, 16k"] = "long-context prompts of that length"
        table = compact_table(meanings)
        table.add_column("method", no_wrap=True)
        for category in shown:
            table.add_column(short_category(category), justify="right", no_wrap=True)
        for s in summaries:
            table.add_row(s.method, *[_ratio(s.cells[c].speedup) for c in shown])
        tables.append(table)
    return tables


def per_method(summaries: list[MethodSummary], reference: str = "ar") -> Table:
    """All categories together: throughput, speedup, acceptance and exactness per method."""
    table = compact_table({
        "tok/s": "new tokens per second",
        f"x {reference}": f"speedup over {reference}, as a ratio",
        "pred": "the speedup the analytical model predicts (metrics.predicted_speedup)",
        "acc": "share of drafted tokens accepted",
        "len": "new tokens per target forward",
        "draft": "share of the steps' time spent drafting",
        "fail": "failed runs, kept out of every average",
        "exact": f"outputs identical to {reference}'s (or the row named) of those compared; lossy: not compared",
    })
    table.add_column("method", no_wrap=True)
    for column in ("tok/s", f"x {reference}", "pred", "acc", "len", "draft", "runs", "fail", "exact"):
        table.add_column(column, justify="right", no_wrap=True)

    def number(value: float | None, text: str) -> str:
        return "-" if value is None else text.format(value)

    for s in summaries:
        cell = s.cells[OVERALL]
        exact = "lossy" if s.exact is None else f"{s.exact[0]}/{s.exact[1]}"
        if s.exact is not None and s.reference != reference:
            exact += f" vs {s.reference}"
        rate = cell.tokens_per_second[0]
        table.add_row(s.method, "fail" if rate != rate else f"{rate:.1f}", _ratio(cell.speedup),
                      number(s.predicted_speedup, "{:.2f}"), number(s.acceptance_rate, "{:.0%}"),
                      number(cell.mean_accepted_tokens, "{:.2f}"), number(s.draft_share, "{:.0%}"),
                      str(cell.runs), str(cell.failures), exact)
    return table
