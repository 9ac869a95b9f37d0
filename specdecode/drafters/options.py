"""What a drafter is built with (`DrafterOptions`) and the checks on it, apart from the drafters: the method
registry and the command line validate a user's options without importing torch."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from specdecode.errors import UserError

MAX_FIXED_BUDGET = 4096  # the largest budget a user may set

# The draft model's fixed tree shape (`--choices default`, `draft-tree-fixed`), for comparison with the
# dynamic tree: a main chain 8 deep with second choices along its first levels.
DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,),
    (0, 0), (0, 1), (1, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0),
    (0, 0, 0, 0), (0, 0, 0, 1),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
    (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0, 0, 0),
)


def check_budget(budget: int | None) -> None:
    """A budget set by hand: None (chosen from the cost curve) or 1 .. MAX_FIXED_BUDGET nodes."""
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)):
        raise UserError(f"the tree budget is a whole number of nodes, got {budget!r}")
    if budget is not None and not 1 <= budget <= MAX_FIXED_BUDGET:
        raise UserError(f"the tree budget must be between 1 and {MAX_FIXED_BUDGET} nodes, got {budget}")


@dataclass(frozen=True)
class DrafterOptions:
    tree: bool = False  # draft a token tree instead of a chain
    budget: int | None = None  # tree nodes verified per step; None: chosen from the measured cost curve
    choices: tuple[tuple[int, ...], ...] | None = None  # a fixed tree shape (draft model only)
    datastore: str | None = None  # a retrieval datastore (`specdecode datastore build`); None: the default
    head: str | None = None  # a trained head's folder (`specdecode train KIND --out`); None: the one shipped
    reference_ids: tuple[int, ...] | None = None  # a document to copy from (retrieved passages, a file being edited)
    tokenizer: object | None = field(default=None, compare=False)  # the target's, for drafters that tokenize text
    # the draft model's when it differs from the target's (its drafts are translated through text); None: the same
    draft_tokenizer: object | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.budget is not None and not self.tree:
            raise UserError("a budget applies to token trees; add --tree")
        check_budget(self.budget)
        if self.choices is not None:  # (kept as tuples: a caller's lists, hashed with the options, were a TypeError)
            try:
                choices = tuple(tuple(operator.index(rank) for rank in path) for path in self.choices)
            except TypeError:
                raise UserError(f"tree choices are paths of whole-number ranks, e.g. [[0], [1], [0, 0]], got "
                                f"{self.choices!r}") from None
            object.__setattr__(self, "choices", choices)
        if self.choices is not None and not self.tree:
            raise UserError("tree choices apply to token trees; add --tree")
