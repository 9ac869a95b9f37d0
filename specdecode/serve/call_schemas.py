"""The JSON schema of one tool call as a template family writes it (`call_schema`: the function's name, then its
arguments), which the tools' grammar enforces (`tools.ToolUse.constraint`)."""

from __future__ import annotations

from typing import Any

from specdecode.constraints import depth
from specdecode.constraints.grammar import JSON_OPTIONS


DEFINITIONS = ("$defs", "definitions")  # where a schema keeps the parts its references name
ROOT_KEYWORDS = ("$id", "$schema")  # what says which resource and dialect the parameters' root is: the new root's
# keywords whose values map names to schemas (a property may be called "$ref")
SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", *DEFINITIONS)


def call_schema(function: dict) -> dict:
    """The JSON schema of one call of `function` as the template family writes it: its name, then its arguments. The
    parameters schema becomes the `arguments` property of a new root, so its definitions move up to that root and
    every reference into it (`#`, `#/properties/...`) is rebased (`#/properties/arguments/...`)."""
    parameters = function.get("parameters") or {"type": "object"}
    options = dict(JSON_OPTIONS, lenient=not function.get("strict"))
    moved = (*DEFINITIONS, *ROOT_KEYWORDS)
    kept = {key: _rebased(parameters[key], key in DEFINITIONS) for key in moved if key in parameters}
    arguments = _rebased({key: value for key, value in parameters.items() if key not in moved})
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": options, **kept}


def _rebased(schema: Any, names: bool = False) -> Any:
    """`schema` with each local reference into the parameters' root rebased to `#/properties/arguments`; `names`:
    a map of names to schemas. Values (`const`, `enum`...) are data, kept as they are."""
    if isinstance(schema, list):
        return [_rebased(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if names:
        return {name: _rebased(value) for name, value in schema.items()}
    out = {key: value if key in depth.DATA else _rebased(value, key in SCHEMA_MAPS) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and \
            not any(ref.startswith(f"#/{key}/") for key in DEFINITIONS):
        out["$ref"] = "#/properties/arguments" + ref[1:]
    return out
