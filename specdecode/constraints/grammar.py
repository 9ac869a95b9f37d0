"""What a constraint is: a JSON schema (strict or lenient), any JSON object, a regular expression or a Lark
grammar, turned into the grammar engine's (llguidance) own form and checked once, when it is made.

Glossary:
- *constraint*: the language the output must belong to (`Constraint`).
- *matcher*: one sequence's position in that language (`constraints.matcher.Matcher`): the tokens allowed
  next, forced tokens, completion.
- *allowed* tokens: those after which the output can still end inside the language; the grammar's *mask*.
- *forced* tokens: where the grammar allows exactly one continuation for a while, its canonical tokens.
- *complete*: the output is in the language and nothing may follow it; the sequence ends.

A constraint's user mistakes (a schema that is not valid JSON or not a schema, a feature the engine does not
enforce under `strict`, a regular expression or grammar that does not compile, an empty language) are
UserErrors carrying the engine's own message.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.hf

from specdecode.constraints import depth
from specdecode.errors import UserError

Kind = Literal["json_schema", "json_object", "regex", "grammar"]
log = logging.getLogger("specdecode.constraints")

# JSON as Python's json.dumps writes it (", " and ": "): no whitespace left to the model between tokens,
# so that separators are forced (drafted for free) and a weak model cannot pad an answer with blanks.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """A language the output must belong to. Make one with `json_schema`, `json_object`, `regex` or
    `grammar`; `source` is what the user gave (the schema as JSON text), `compiled` the engine's form."""

    kind: Kind
    source: str
    compiled: str  # llguidance's grammar (JSON text), checked when made
    lenient: bool = False  # a JSON schema's keywords the engine cannot enforce are left out (not `strict`)

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool | str, strict: bool = True) -> Constraint:
        """Output that validates against `schema` (a JSON Schema, as a dict, a bool or JSON text). `strict`: a
        keyword the engine cannot enforce is an error; otherwise a warning (logged), and the rest is enforced (as
        OpenAI's `strict: false`, where the schema is a hint)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise UserError(f"the JSON schema is not valid JSON: {error}") from None
            except RecursionError:
                raise UserError("the JSON schema nests too deeply to be read") from None
        if schema is True:  # JSON Schema's `true`: any JSON, as {}
            schema = {}
        if schema is False:
            raise UserError("the JSON schema `false` admits no output: its language is empty")
        if not isinstance(schema, dict):
            raise UserError(f"a JSON schema is a JSON object (or true), got {type(schema).__name__}")
        try:
            text = json.dumps(schema)
        except RecursionError:
            raise UserError("the JSON schema nests too deeply to be read") from None
        except (TypeError, ValueError) as error:  # a value JSON has no form for (a set, a circular reference)
            raise UserError(f"the JSON schema is not JSON: {error}") from None
        return _made("json_schema", text, not strict)

    @staticmethod
    def json_object() -> Constraint:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return _made("json_object", '{"type": "object"}', False)

    @staticmethod
    def regex(pattern: str) -> Constraint:
        """Output that matches `pattern` whole (Rust regex syntax, as llguidance reads it)."""
        return _made("regex", pattern, False)

    @staticmethod
    def grammar(lark: str) -> Constraint:
        """Output in the language of a Lark grammar (its `start` rule; llguidance's Lark dialect, which also
        takes JSON schemas and regular expressions inline)."""
        return _made("grammar", lark, False)

    def describe(self) -> str:
        return describe(self.kind)


CACHED_SOURCE = 1 << 16  # characters: a constraint no longer than this is compiled once and kept (`_made`)


def _made(kind: Kind, source: str, lenient: bool) -> Constraint:
    """The constraint of `kind` from its source text, compiled and checked; a short one compiled once and kept
    (an agent's tools and a client's schema come back with every request, and with every prompt of one)."""
    return _cached(kind, source, lenient) if len(source) <= CACHED_SOURCE else _compiled(kind, source, lenient)


def _compiled(kind: Kind, source: str, lenient: bool) -> Constraint:
    _check_depth(kind, source)
    with refusals(kind):
        if kind in ("json_schema", "json_object"):
            options = dict(JSON_OPTIONS, lenient=lenient)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, overrides=options)  # type: ignore[arg-type]
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(source)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise UserError(f"the {describe(kind)} does not compile: {one_line(messages[0])}")
    if messages:  # what a lenient schema leaves unenforced (`uniqueItems`...): the output may break it
        log.warning("the %s is enforced without what the grammar engine cannot enforce: %s", describe(kind),
                    one_line("; ".join(messages))[:300])
    return Constraint(kind, source, grammar, lenient)


_cached = functools.lru_cache(maxsize=64)(_compiled)


def _check_depth(kind: Kind, source: str) -> None:
    """A UserError for a schema or grammar nested deeper than the grammar engine can check without ending the
    process (`constraints.depth`)."""
    try:
        if kind == "json_schema":
            depth.schema_depth(json.loads(source))
        elif kind == "grammar":
            depth.grammar_depth(source)
    except depth.TooDeep:
        raise UserError(f"the {describe(kind)} nests more than {depth.MAX_DEPTH} levels deep (its references or "
                        "rules followed): the grammar engine takes no deeper one") from None


@contextlib.contextmanager
def refusals(kind: Kind) -> Iterator[None]:
    """The grammar engine's refusal of a user's input as a UserError: a ValueError, or a panic of its Rust code
    (pyo3's PanicException, a BaseException; some malformed schemas reach one) that would otherwise escape
    every `except Exception` up to the server's 500."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:
        if not isinstance(error, ValueError) and type(error).__name__ != "PanicException":
            raise
        raise UserError(f"the {describe(kind)} does not compile: {one_line(str(error))[:300]}") from None


def describe(kind: Kind) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object constraint", "regex": "regular expression",
            "grammar": "grammar"}[kind]


def one_line(message: str) -> str:
    """The engine's message on one line, without the source lines and carets it draws under them."""
    drawing = re.compile(r"^\s*(\^+|\d+ \|.*)\s*$")
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip() and not drawing.match(line))


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_tokenizer(tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> llguidance.LLTokenizer:
    """The grammar engine's view of a Hugging Face fast tokenizer with `vocab_size` logits (the target's, which
    may pad the tokenizer's) and the given end-of-sequence tokens; built once per tokenizer (a second on a
    150k vocabulary)."""
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise UserError("a constraint needs the model's own (fast) tokenizer; this model has none loaded")
    key = (vocab_size, eos_ids)
    per_tokenizer = _TOKENIZERS.setdefault(tokenizer, {})
    if key not in per_tokenizer:
        eos = sorted(eos_ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()))
        try:
            per_tokenizer[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos or None)
        except ValueError as error:
            raise UserError(f"the grammar engine cannot read this tokenizer: {error}") from None
    return per_tokenizer[key]
