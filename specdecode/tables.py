"""Tables that fit an 80-column terminal: short column names explained in a legend below the table, numbers
never wrapped, only a description column (where a table has one) wrapping into the width left."""

from __future__ import annotations

from rich import box
from rich.table import Table


def legend(meanings: dict[str, str]) -> str:
    """"name: meaning; name: meaning", the caption that explains a table's short column names."""
    return "; ".join(f"{name}: {meaning}" for name, meaning in meanings.items()) + "."


def compact_table(meanings: dict[str, str], leading: int = 0) -> Table:
    """An empty table: a rule under the header, no borders, one space between columns, and the legend of
    `meanings` below, wrapped to the table's width. `leading`: blank lines between rows (for rows that wrap)."""
    return Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0), leading=leading,
                 caption=legend(meanings), caption_justify="left")
