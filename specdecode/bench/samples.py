"""Which of the benchmark's prompts a run draws: a seeded sample per category, from the tuning part or the held-out
part of each category (`part_of`), so that what tunes a method is never what reports on it."""

from __future__ import annotations

import functools
import random

from specdecode.bench.datasets import CATEGORIES, LONG_CONTEXT, LONG_LENGTHS, Task, tuning_groups
from specdecode.errors import UserError


def _strata(category: str, pool: list[Task]) -> dict[str, list[Task]]:
    """The groups a sample is drawn from: one per category of the pool's tasks (long-context's are one
    per length, `long-context/8k`..., so that a sample does not miss one)."""
    strata: dict[str, list[Task]] = {}
    for task in pool:
        strata.setdefault(task.category, []).append(task)
    return strata


def _pool(category: str) -> list[Task]:
    """A category's tasks; `long-context/LENGTH` names one length of long-context."""
    base, _, length = category.partition("/")
    if base not in CATEGORIES or (length and (base != LONG_CONTEXT or length not in LONG_LENGTHS)):
        raise UserError(f"unknown category {category!r}; choose from: {', '.join(CATEGORIES)} (or one length of "
                        f"{LONG_CONTEXT}: {', '.join(f'{LONG_CONTEXT}/{n}' for n in LONG_LENGTHS)})")
    return [task for task in CATEGORIES[base]() if not length or task.category == category]


PARTS = ("held-out", "tuning", "all")  # which part of each category's prompts a sample draws from (`part_of`)


def part_of(task: Task) -> str:
    """"tuning" or "held-out": every stratum (`_strata`) is split once and for all, disjointly, by a digest of
    its tasks' groups (`Task.split_group`: the id, or what tasks share): the ceil(n / TUNING_SHARE) groups with the
    lowest digests are for tuning (choices such as auto's sources and thresholds, A/B runs), the others for
    reporting. Fixed by the ids and contents alone, so no seed, sample size or machine moves a prompt from one part
    to the other. Tasks of one group (an agentic scenario's, each holding the one before it; rows of one passage or
    article) fall in one part; a task split with another category (`Task.split_with`: code-edit, whose prompt holds
    the reference solution of code's problem) falls in that category's part of its group; a task whose maker fixed
    its part (`Task.part`: long context's, made of one part's passages or articles) is in it."""
    if task.part is not None:
        return task.part
    return "tuning" if task.split_group in _tuning(task.split_with or task.category) else "held-out"


@functools.cache
def _tuning(stratum: str) -> frozenset[str]:
    """The groups of a stratum's tasks that are for tuning (`part_of`)."""
    base = stratum.partition("/")[0]
    if base not in CATEGORIES:  # a task made up outside the benchmark's categories (tests): nothing to tune on
        return frozenset()
    return tuning_groups(task.split_group for task in _strata(base, _pool(base)).get(stratum, []) if task.part is None)


def sample_tasks(categories: list[str], per_category: int | None, seed: int = 0, part: str = "held-out"
                 ) -> list[Task]:
    """A fixed, seeded sample of `per_category` tasks from each category (all of them when None) within `part`
    of it (`part_of`: "held-out", what reports draw from; "tuning", what tuning scripts draw from; "all"); from
    long-context, `per_category` tasks of each length."""
    if part not in PARTS:
        raise UserError(f"unknown part {part!r}; choose from: {', '.join(PARTS)}")
    tasks = []
    for category in categories:
        for stratum, pool in _strata(category, _pool(category)).items():
            pool = [task for task in pool if part == "all" or part_of(task) == part]
            if per_category is not None and per_category < len(pool):
                pool = random.Random(f"{seed}/{stratum}").sample(pool, per_category)
            tasks.extend(pool)
    return tasks
