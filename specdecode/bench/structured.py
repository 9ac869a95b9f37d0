"""The `structured` category: answers the output must shape (a JSON schema or a regular expression), in three
kinds: extraction of facts from a short text into a schema, a tool call's JSON arguments, and an answer in a
fixed textual form. The prompts and schemas are HAND-WRITTEN for this benchmark (no package ships such a set
with schemas), kept here in the repository; each task carries its constraint, and `valid` checks an answer
against it with `jsonschema` or a full regular-expression match, independently of the grammar engine.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from specdecode.constraints import Constraint

CATEGORY = "structured"


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


STRING, INTEGER, NUMBER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
PERSON = _object({"name": STRING, "born": INTEGER, "died": INTEGER, "field": STRING,
                  "known_for": {"type": "array", "items": STRING, "maxItems": 3}})
INVOICE = _object({"invoice_number": STRING, "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                   "customer": STRING, "items": {"type": "array", "items": _object(
                       {"description": STRING, "quantity": INTEGER, "unit_price": NUMBER}), "maxItems": 5},
                   "currency": {"enum": ["EUR", "USD", "GBP"]}})
EVENT = _object({"title": STRING, "city": STRING, "start": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                 "days": INTEGER, "free": BOOLEAN, "topics": {"type": "array", "items": STRING, "maxItems": 4}})
PACKAGE = _object({"name": STRING, "version": {"type": "string", "pattern": r"^\d+\.\d+\.\d+$"},
                   "license": {"enum": ["MIT", "Apache-2.0", "BSD-3-Clause", "GPL-3.0"]},
                   "dependencies": {"type": "array", "items": STRING, "maxItems": 5}, "python": STRING})

EXTRACTION = [
    ("person", PERSON, "Ada Lovelace (1815-1852) was an English mathematician, chiefly known for her work on "
                       "Charles Babbage's Analytical Engine and for publishing the first algorithm meant for it."),
    ("invoice", INVOICE, "Invoice INV-2041, issued 2024-03-08 to Northwind Traders: 3 USB-C cables at 9.50 "
                         "each and 1 docking station at 129.00; amounts in euros."),
    ("event", EVENT, "PyCon Italia takes place in Florence from 2025-05-28 for four days. Tickets are paid. "
                     "Talks cover web frameworks, data science, packaging and education."),
    ("package", PACKAGE, "requests 2.32.3 is released under the Apache 2.0 licence, needs Python 3.8 or later, "
                         "and depends on charset-normalizer, idna, urllib3 and certifi."),
]

WEATHER = _object({"city": STRING, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": INTEGER})
SEARCH = _object({"query": STRING, "language": {"enum": ["python", "javascript", "rust", "go"]},
                  "max_results": INTEGER, "include_forks": BOOLEAN})
EMAIL = _object({"to": {"type": "array", "items": STRING, "maxItems": 3}, "subject": STRING, "body": STRING,
                 "urgent": BOOLEAN})
SQL = _object({"table": STRING, "columns": {"type": "array", "items": STRING, "maxItems": 5},
               "where": STRING, "limit": INTEGER})

TOOL_CALLS = [
    ("get_weather", WEATHER, "What will the weather be like in Lisbon over the next three days? Use Fahrenheit."),
    ("search_code", SEARCH, "Find up to five Rust repositories implementing a B-tree, not counting forks."),
    ("send_email", EMAIL, "Tell alice@example.com and bob@example.com that the release is postponed to Friday; "
                          "it is urgent."),
    ("run_query", SQL, "From the orders table, show the id, customer and total of the ten most recent orders "
                       "over 100."),
]

FORMS = [
    ("date", r"\d{4}-\d{2}-\d{2}", "On what date did the Apollo 11 crew land on the Moon? Answer as YYYY-MM-DD."),
    ("verdict", r"(yes|no), confidence [0-9]{1,2}%\. [A-Z][a-z ,]{10,120}\.",
     "Is Python's list.sort stable? Answer yes or no, then your confidence in percent, then one sentence why."),
    ("semver", r"[0-9]+\.[0-9]+\.[0-9]+",
     "A library at version 2.7.4 adds a backwards-compatible feature. What is its next version? Give the "
     "version only."),
    ("csv", r"(name,language,year\n)([A-Za-z+#]+,[A-Za-z+#]+,[0-9]{4}\n){3}",
     "List three programming languages as CSV with the header name,language,year, where language is the "
     "language's paradigm and year its first release."),
]


def tasks() -> list[tuple[str, str, Constraint]]:
    """Every structured task as (id, prompt, constraint): four extractions, four tool calls, four answers in a
    fixed form (`bench.datasets.structured` makes them Tasks)."""
    out = []
    for name, schema, text in EXTRACTION:
        out.append((f"extract/{name}", f"Extract the facts from this text as JSON matching the schema.\n\n"
                    f"Schema: {json.dumps(schema)}\n\nText: {text}", Constraint.json_schema(schema)))
    for name, schema, request in TOOL_CALLS:
        out.append((f"tool/{name}", f"You can call the function `{name}` with JSON arguments matching this "
                    f"schema: {json.dumps(schema)}\n\nRequest: {request}\n\nReply with the arguments only.",
                    Constraint.json_schema(schema)))
    for name, pattern, question in FORMS:
        out.append((f"form/{name}", question, Constraint.regex(pattern)))
    return out


def valid(constraint: Constraint, text: str) -> bool:
    """Whether a whole answer is in the constraint's language, checked without the grammar engine."""
    if constraint.kind == "regex":
        return re.fullmatch(constraint.source, text) is not None
    try:
        instance = json.loads(text)
    except json.JSONDecodeError:
        return False
    if constraint.kind == "json_object":
        return isinstance(instance, dict)
    if constraint.kind != "json_schema":
        raise ValueError(f"no independent check of a {constraint.describe()}")
    try:
        jsonschema.validate(instance, json.loads(constraint.source))
    except jsonschema.ValidationError:
        return False
    return True
