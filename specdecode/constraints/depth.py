"""How deep a constraint's source nests, checked before the grammar engine reads it.

llguidance checks a grammar by recursing once a level: of a JSON schema, its references followed, and of a Lark
grammar, each rule a rule leads to. It recurses on the calling thread's stack, and a source some hundreds of levels
deep (a chain of `$ref`s, or of rules, that fits in a request's body) overflows it, which ends the whole process: a
server with every request it holds. So a source deeper than MAX_DEPTH is a UserError instead, far below where the
engine's recursion ends and far above where real schemas and grammars end. A reference back to a schema on the way
(a recursive schema: a tree's node) or a rule back to one on the way nests nothing more: the engine makes a rule of it.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 256  # levels a schema (its references followed) or a grammar's rules may nest
DATA = ("const", "enum", "default", "examples")  # keywords whose values are data, never schemas


class TooDeep(Exception):
    pass


def schema_depth(schema: Any) -> int:
    """The levels from `schema`'s root to its deepest part, local references followed; TooDeep past MAX_DEPTH."""
    heights: dict[str, int] = {}

    def height(node: Any, level: int, on_the_way: frozenset[str]) -> int:
        if level >= MAX_DEPTH:  # this node is the root's (level + 1)-th level
            raise TooDeep
        parts = node if isinstance(node, list) else [v for k, v in node.items() if k not in DATA] \
            if isinstance(node, dict) else []
        deepest = 0
        for part in parts:
            deepest = max(deepest, height(part, level + 1, on_the_way))
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str) and ref.startswith("#") and ref not in on_the_way:
            if ref not in heights:
                heights[ref] = height(_pointed(schema, ref), level + 1, on_the_way | {ref})
            deepest = max(deepest, heights[ref])
            if level + 1 + deepest > MAX_DEPTH:
                raise TooDeep
        return 1 + deepest

    return height(schema, 0, frozenset())


def too_deep(schema: Any) -> bool:
    """Whether `schema` nests more than MAX_DEPTH levels (`schema_depth`)."""
    try:
        return schema_depth(schema) > MAX_DEPTH
    except TooDeep:
        return True


def _pointed(schema: Any, ref: str) -> Any:
    """The part of `schema` a local reference (`#/$defs/name`) points at (None where it points at nothing)."""
    node = schema
    for token in ref[1:].split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(token)
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?[ \t]*:", re.MULTILINE)
LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[a-z]*')
NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def grammar_depth(lark: str) -> int:
    """The levels of a Lark grammar's longest chain of rules (or terminals) each naming the next, a `%json` schema
    inside a rule counted by its own depth; TooDeep past MAX_DEPTH."""
    starts = [(match.group(1), match.start(), match.end()) for match in DEFINITION.finditer(lark)]
    bodies = {name: lark[end: starts[i + 1][1] if i + 1 < len(starts) else len(lark)]
              for i, (name, _, end) in enumerate(starts)}
    inner: dict[str, int] = {}  # a rule's `%json` schemas' depth
    for name, body in bodies.items():
        at = body.find("%json")
        while at >= 0:
            opened = body.find("{", at)
            try:
                schema, end = json.JSONDecoder().raw_decode(body, opened) if opened >= 0 else (None, at + 5)
            except (ValueError, RecursionError):  # the engine's to refuse in words
                schema, end = None, at + 5
            inner[name] = max(inner.get(name, 0), schema_depth(schema) if schema is not None else 0)
            body = body[:at] + body[end:]
            at = body.find("%json")
        bodies[name] = body
    leads = {name: {word for word in NAME.findall(LITERALS.sub(" ", body)) if word in bodies and word != name}
             for name, body in bodies.items()}
    heights: dict[str, int] = {}

    def height(name: str, level: int, on_the_way: frozenset[str]) -> int:
        if level >= MAX_DEPTH:
            raise TooDeep
        if name not in heights:
            deepest = inner.get(name, 0)
            for other in leads[name] - on_the_way:
                deepest = max(deepest, height(other, level + 1, on_the_way | {name}))
            heights[name] = 1 + deepest
        if level + heights[name] > MAX_DEPTH:
            raise TooDeep
        return heights[name]

    return max((height(name, 0, frozenset()) for name in bodies), default=0)
