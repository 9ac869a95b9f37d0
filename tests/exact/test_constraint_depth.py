"""A constraint nested deeper than the grammar engine can check is refused in words (`constraints.depth`): the engine
recurses once a level on the thread's stack, and a chain of a thousand `$ref`s (or of three thousand rules) in one
request's body ended the whole process, a server with every request it held (SIGSEGV)."""

from __future__ import annotations

import pytest

from specdecode.constraints import Constraint, depth
from specdecode.errors import UserError
from specdecode.serve.protocol import APIError
from specdecode.serve.chat import ChatRequest
from specdecode.serve.tools import QWEN25, ToolUse, tool_use


def chained(links: int) -> dict:
    """A schema whose definitions each hold the next: `links` references deep."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(links)}
    return {"$ref": "#/$defs/d0", "$defs": defs | {f"d{links}": {"type": "string"}}}


def rules(count: int) -> str:
    return "\n".join(["start: r0", *(f'r{i}: "a{i}" r{i + 1} | "b"' for i in range(count)), f'r{count}: "z"'])


@pytest.mark.parametrize("make", [lambda: Constraint.json_schema(chained(1000)),
                                  lambda: Constraint.grammar(rules(3000)),
                                  lambda: Constraint.grammar(f"start: %json {chained(1000)}".replace("'", '"'))])
def test_a_source_deeper_than_the_engine_takes_is_refused_in_words(make):
    with pytest.raises(UserError, match=f"more than {depth.MAX_DEPTH} levels deep"):
        make()


def test_deep_tools_are_a_400_naming_them():
    use = ToolUse(({"type": "function", "function": {"name": "f", "parameters": chained(1000)}},), "required", True,
                  QWEN25)
    with pytest.raises(APIError, match="levels deep") as refused:
        use.constraint(None)
    assert refused.value.param == "tools"


def test_a_deep_tool_is_named_with_its_place_among_the_tools():
    tools = [{"type": "function", "function": {"name": name, "parameters": chained(links)}}
             for name, links in [("shallow", 3), ("deep", 1000)]]
    body = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools})
    with pytest.raises(APIError, match=f"parameters of `deep` nest more than {depth.MAX_DEPTH}") as refused:
        tool_use(body, f"{{% if tools %}}{QWEN25.open} {QWEN25.close}{{% endif %}}")
    assert refused.value.param == "tools[1].function.parameters"


def test_real_depths_pass_and_are_counted_once_a_reference():
    """Chains as deep as real schemas go, a recursive schema (a tree's node: a rule of the engine's, not a level a
    node), and references shared by many paths (counted once: not one walk a path) all compile."""
    Constraint.json_schema(chained(40))
    Constraint.grammar(rules(200))
    tree = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array",
                                                                        "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    assert depth.schema_depth(tree) < 16
    Constraint.json_schema(tree)
    shared = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"},
                                                          "b": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(40)}
    assert depth.schema_depth({"$ref": "#/$defs/d0", "$defs": shared | {"d40": {"type": "string"}}}) < depth.MAX_DEPTH


def nested(levels: int) -> dict:
    """A schema `levels` deep with no reference: arrays of arrays."""
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"items": schema}
    return schema


@pytest.mark.parametrize("measure, make", [(depth.schema_depth, nested), (depth.schema_depth, chained),
                                           (depth.grammar_depth, rules)])
def test_the_limit_is_exactly_max_depth_levels(measure, make, monkeypatch):
    """Around the limit, a source is refused exactly when it nests more than MAX_DEPTH levels (its depth as counted
    without the limit), whether its levels are nested parts, references followed or rules."""
    sizes = range(depth.MAX_DEPTH // 3 - 4, depth.MAX_DEPTH + 4) if make is chained else \
        range(depth.MAX_DEPTH - 4, depth.MAX_DEPTH + 4)
    with monkeypatch.context() as unlimited:
        unlimited.setattr(depth, "MAX_DEPTH", 10 ** 6)
        levels = {size: measure(make(size)) for size in sizes}
    assert min(levels.values()) < depth.MAX_DEPTH < max(levels.values())
    for size, count in levels.items():
        if count > depth.MAX_DEPTH:
            with pytest.raises(depth.TooDeep):
                measure(make(size))
        else:
            assert measure(make(size)) == count
