"""Which prompts the target answers for the trained drafters' data (`training.answers`), and how.

Prompts, in an order seeded by `Settings.seed`, each with an id that does not depend on it:
- `sharegpt:<i>`: the first user turn of ShareGPT conversation i (`corpus.sharegpt_conversations`; a
  turn repeating an earlier conversation's is dropped: the same prompt, the same greedy answer);
- `stdlib:<module>:write`: a request to write a standard-library module; `stdlib:<module>:<kind>@<line>`:
  a slice of its source (SLICE_LINES lines from that line) to explain or to continue (kinds alternate
  along the file). About `Settings.code_share` of the prompts are these.
A prompt that contains the opening of a benchmark prompt is skipped (`corpus.mentions_any`): only the
prompt reaches the target, so only it can leak one. Prompts go through the target's chat template and a
prompt too long loses its middle (`encode`).

Answers: greedy, or (`Settings.sampled_share` of the prompts) sampled at `Settings.temperature`; which,
and the sampling seed, follow from the prompt's id and `Settings.seed` alone (`sampling_of`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import UserError
from specdecode.training import corpus

SLICE_LINES = 40  # lines of code in an explain / continue prompt
MIN_SLICE_LINES = 8  # non-blank lines a slice needs
CUT_MARK = "\n[...]\n"  # where a prompt too long for the limit lost its middle


@dataclass(frozen=True)
class Settings:
    """What decides the answers; a folder keeps the settings it was started with."""

    max_new_tokens: int = 512
    sampled_share: float = 0.5  # of the prompts, answered by sampling (the rest greedily)
    temperature: float = 0.8  # of the sampled answers
    code_share: float = 0.35  # of the prompts, standard-library code requests (the rest ShareGPT)
    max_prompt_tokens: int = 1024  # chat-templated; a longer prompt loses its middle
    seed: int = 0  # the prompts' order, and which are sampled with which seeds

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        for name in ("sampled_share", "code_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UserError(f"{name} must be between 0 and 1, got {getattr(self, name)}")
        if not 0.0 < self.temperature <= 100.0:
            raise UserError(f"temperature must be in (0, 100], got {self.temperature}")
        if self.max_prompt_tokens < 16:
            raise UserError(f"max_prompt_tokens must be at least 16, got {self.max_prompt_tokens}")


@dataclass(frozen=True)
class Prompt:
    id: str  # "sharegpt:<i>" or "stdlib:<module>:<kind>[@<line>]"
    source: str  # "sharegpt" or "stdlib"
    text: str  # the user turn

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.text}]


def sharegpt_prompts(path: Path | None = None) -> Iterator[Prompt]:
    """The first user turn of each ShareGPT conversation, once per text."""
    seen = set()
    for index, messages in enumerate(corpus.sharegpt_conversations(path)):
        text = messages[0]["content"]
        key = " ".join(text.split()).lower()
        if key not in seen:
            seen.add(key)
            yield Prompt(f"sharegpt:{index}", "sharegpt", text)


def stdlib_prompts(folder: Path | None = None) -> Iterator[Prompt]:
    """Requests about each standard-library module (the files `corpus.stdlib_conversations` reads): to
    write it, and to explain or continue each SLICE_LINES-line slice of it (alternately)."""
    from specdecode.drafters.retrieval.build import STDLIB_SKIP, stdlib_folder

    root = folder or stdlib_folder()
    for path in sorted(root.rglob("*.py")):
        if STDLIB_SKIP & set(path.relative_to(root).parts):
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        yield Prompt(f"stdlib:{module}:write", "stdlib", f"Write the Python standard library module `{module}`.")
        for number, start in enumerate(range(0, len(lines), SLICE_LINES)):
            chunk = lines[start : start + SLICE_LINES]
            if sum(1 for line in chunk if line.strip()) < MIN_SLICE_LINES:
                continue
            code = "\n".join(chunk)
            kind, request = ("continue", "Continue this code") if number % 2 == 0 else ("explain", "Explain this code")
            text = f"{request} from the Python module `{module}`:\n\n```python\n{code}\n```"
            yield Prompt(f"stdlib:{module}:{kind}@{start + 1}", "stdlib", text)


def prompts(settings: Settings, *, sharegpt: Path | None = None, stdlib: Path | None = None,
            openings: frozenset[str] | None = None) -> Iterator[Prompt]:
    """Every prompt once, in an order seeded by settings.seed: each next one code with probability
    settings.code_share (the other source once one runs out), benchmark prompts skipped. `openings`:
    the benchmark's (`corpus.evaluation_openings`) unless given. The sources are read now, the
    benchmark check made as the prompts are taken."""
    openings = corpus.evaluation_openings() if openings is None else openings
    code, chat = list(stdlib_prompts(stdlib)), list(sharegpt_prompts(sharegpt))
    random.Random(f"{settings.seed}:stdlib").shuffle(code)  # one stream each: a source's order is its own
    random.Random(f"{settings.seed}:sharegpt").shuffle(chat)
    return _mixed(iter(code), iter(chat), random.Random(f"{settings.seed}:mix"), settings.code_share, openings)


def _mixed(code: Iterator[Prompt], chat: Iterator[Prompt], mix: random.Random, code_share: float,
           openings: frozenset[str]) -> Iterator[Prompt]:
    while True:
        first, second = (code, chat) if mix.random() < code_share else (chat, code)
        prompt = next(first, None) or next(second, None)
        if prompt is None:
            return
        if not corpus.mentions_any(prompt.messages, openings):
            yield prompt


def sampling_of(prompt_id: str, settings: Settings) -> int | None:
    """The seed a prompt's answer is sampled with, or None when it is answered greedily: a function of
    the id and settings.seed alone, so neither the order nor a rerun changes it."""
    digest = hashlib.sha256(f"{settings.seed}:{prompt_id}".encode()).digest()
    draw = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    return int.from_bytes(digest[8:16], "big") >> 2 if draw < settings.sampled_share else None


def encode(models, prompt: Prompt, limit: int) -> list[int]:
    """The prompt's chat-templated token ids (`Models.encode_chat`), at most `limit` of them: a longer
    prompt keeps the beginning and end of its text (where questions and instructions are) and loses
    the middle."""
    ids = models.encode_chat(prompt.messages)
    if len(ids) <= limit:
        return ids
    tokenizer = models.tokenizer
    text_ids = tokenizer.encode(prompt.text, add_special_tokens=False)
    overhead = len(ids) - len(text_ids) + len(tokenizer.encode(CUT_MARK, add_special_tokens=False))
    keep = limit - overhead
    for _ in range(4):  # re-encoding may merge tokens differently at the cuts
        if keep < 2:
            break
        head, tail = text_ids[: keep - keep // 2], text_ids[len(text_ids) - keep // 2 :]
        text = tokenizer.decode(head) + CUT_MARK + tokenizer.decode(tail)
        ids = models.encode_chat([{"role": "user", "content": text}])
        if len(ids) <= limit:
            return ids
        keep -= len(ids) - limit
    raise UserError(f"the chat template alone takes more than {limit} tokens")


def prompt_limit(settings: Settings, max_context: int) -> int:
    """Prompt tokens at most: settings.max_prompt_tokens, less where the target's context would leave
    the answer too little room (but never under half of it)."""
    return min(settings.max_prompt_tokens, max(max_context - settings.max_new_tokens, max_context // 2))
