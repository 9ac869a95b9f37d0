"""Tool calls read out of an answer in Qwen2.5's format (`serve.tools.CallReader`), cases known by hand: text around
calls, several calls, a call that does not parse, an answer cut inside a call; the same read whole and fed in any
pieces (hypothesis), which is what keeps streamed calls equal to whole ones. And which templates have a format."""

from __future__ import annotations

import json
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

import jsonschema
import pytest

from conftest import QWEN25_TEMPLATE, tiny_tokenizer
from specdecode.constraints.matcher import Matcher
from specdecode.serve.protocol import APIError
from specdecode.serve.call_schemas import call_schema
from specdecode.serve.tools import QWEN25, CallReader, ToolUse, tool_format

USE = ToolUse(tools=(), choice="auto", parallel=True, format=QWEN25)
ONE = ToolUse(tools=(), choice="auto", parallel=False, format=QWEN25)
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
OTHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CASES = [  # text: (content, [(name, arguments)])
    (CALL, (None, [("add", {"a": 1, "b": 2})])),
    ("Let me add. " + CALL, ("Let me add. ", [("add", {"a": 1, "b": 2})])),
    (CALL + "\n" + OTHER, (None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})])),
    ("no calls at all <tool", ("no calls at all <tool", [])),
    ("<tool_call>\nnot json\n</tool_call>", ("<tool_call>\nnot json\n</tool_call>", [])),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', (None, [("add", {"a": 1})])),  # cut before the tag
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1', ('<tool_call>\n{"name": "add", "arguments": {"a": 1', [])),
    ('<tool_call>\n{"name": "f", "parameters": {"x": "y"}}\n</tool_call>', (None, [("f", {"x": "y"})])),
    # an argument that spells the closing tag: inside a JSON string it closes nothing
    ('<tool_call>\n{"name": "f", "arguments": {"x": "use </tool_call> to end \\" </tool_call>"}}\n</tool_call>',
     (None, [("f", {"x": 'use </tool_call> to end " </tool_call>'})])),
    # cut inside the closing tag: the call, without the tag's beginning
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_ca', (None, [("add", {"a": 1})])),
]


def read(text: str, use: ToolUse = USE) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = CallReader(use).read(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_cases_known_by_hand():
    for text, expected in CASES:
        assert read(text) == expected, text


def test_one_call_only_when_calls_are_not_parallel():
    assert read(CALL + "\n" + OTHER, ONE) == (None, [("add", {"a": 1, "b": 2})])


@given(st.sampled_from([text for text, _ in CASES] + [CALL + "\n" + OTHER + " done"]), st.data())
def test_fed_in_pieces_reads_as_whole(text, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    reader = CallReader(USE)
    content, calls = "", []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        more, new = reader.feed(text[start:end])
        content, calls = content + more, calls + new
    more, new = reader.finish()
    content, calls = content + more, calls + new
    whole_content, whole_calls = CallReader(USE).read(text)
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    assert (content if content.strip() or not calls else None) == whole_content


def test_a_call_cut_short_is_a_call_with_the_arguments_written_so_far():
    """A call the answer's end cut inside its arguments is returned as OpenAI returns one cut by `max_tokens`:
    the call, its arguments the JSON text so far (the reply says "length"), not the tags as content; whole or fed in
    pieces alike. Only a function the request offers: under `auto`, another name or a cut before the arguments stays
    text; under `required` or a named function (the grammar writes nothing but calls) it is neither text nor a call."""
    use = ToolUse(tools=(function("add", {}),), choice="required", parallel=True, format=QWEN25)
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x\\"'
    for pieces in ([cut], [cut[:5], cut[5:20], cut[20:]]):
        reader, content, calls = CallReader(use), "", []
        for piece in pieces:
            more, new = reader.feed(piece)
            content, calls = content + more, calls + new
        more, new = reader.finish()
        assert (content + more, [c["function"] for c in calls + new]) == (
            "", [{"name": "add", "arguments": '{"a": 1, "b": "x\\"'}])
    auto = ToolUse(tools=use.tools, choice="auto", parallel=True, format=QWEN25)
    for text in ('<tool_call>\n{"name": "sub", "arguments": {"a": 1', '<tool_call>\n{"name": "add", "argu',
                 '{"name": "ad', CALL + '\n<tool_call>\n{"na'):
        for forced in (use, replace(use, choice="add")):
            for pieces in ([text], [text[:7], text[7:]]):
                reader = CallReader(forced)
                read = [reader.feed(piece) for piece in pieces] + [reader.finish()]
                assert "".join(content for content, _ in read) == "" and CallReader(forced).read(text)[0] is None
                assert [c["function"]["name"] for _, calls in read for c in calls] == ["add"] * text.startswith(CALL)
        whole = CallReader(auto).read(text)
        assert whole[0] == text[len(CALL):] if text.startswith(CALL) else whole == (text, []), text


def test_which_templates_write_calls_this_server_reads():
    assert tool_format(QWEN25_TEMPLATE.read_text()) is QWEN25
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_format(None) is None


def function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


NESTED = {"type": "object", "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Address"},
                                           "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
          "required": ["name", "home", "child"], "additionalProperties": False,
          "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                                "additionalProperties": False}}}


def test_a_calls_schema_keeps_the_parameters_references():
    """Definitions (pydantic writes a nested model's under $defs) and references to the parameters' root go with
    the parameters into the call's schema: a call validates exactly when its arguments validate."""
    schema = call_schema(function("person", NESTED)["function"])
    good = {"name": "Ana", "home": {"city": "Oslo"}, "child": {"name": "Bo", "home": {"city": "Rome"}, "child": None}}
    wrapped = {"name": "person", "arguments": {"name": "Ana", "home": {"city": "Oslo"},
                                              "child": {"name": "person", "arguments": good}}}  # `#` is the arguments
    jsonschema.validate({"name": "person", "arguments": good}, schema)
    for bad in (wrapped, {"name": "person", "arguments": {**good, "home": {"town": "Oslo"}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    jsonschema.validate(good, NESTED)  # (the arguments are what the parameters schema takes)


ODD = {"$id": "https://example.com/odd.json", "$schema": "https://json-schema.org/draft/2020-12/schema",
       "type": "object", "properties": {"k": {"const": {"$ref": "#/x"}}, "$ref": {"$ref": "#/$defs/X"}},
       "required": ["k", "$ref"], "additionalProperties": False, "$defs": {"X": {"type": "integer"}}}


def test_a_calls_schema_rebases_only_schemas():
    """A value shaped like a reference (in `const`, `enum`...) is data, and a property may be called "$ref": both were
    rebased (the enforced call then broke the tool's own schema); a root `$id` goes to the new root with the
    definitions (`#/$defs/X` was looked up in the `$id` resource left without them: a 400 for a valid tool)."""
    schema = call_schema(function("odd", ODD)["function"])
    good = {"k": {"$ref": "#/x"}, "$ref": 7}
    jsonschema.validate(good, ODD)
    jsonschema.validate({"name": "odd", "arguments": good}, schema)
    for bad in ({**good, "k": {"$ref": "#/properties/arguments/x"}}, {**good, "$ref": "7"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": "odd", "arguments": bad}, schema)
    assert matcher(ToolUse((function("odd", ODD),), "required", False, QWEN25))  # llguidance compiles it


def matcher(use: ToolUse) -> Matcher:
    tokenizer = tiny_tokenizer()
    constraint = use.constraint(tokenizer)
    assert constraint is not None
    return Matcher(constraint, tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))


def test_a_required_call_may_end_after_the_separator():
    """A model that writes the separator after its last call may still end there (it was held to another call,
    and repeated its call to the length limit)."""
    tokenizer = tiny_tokenizer()
    for parallel in (True, False):
        use = ToolUse((function("add", {"type": "object", "properties": {"a": {"type": "integer"}},
                                        "required": ["a"], "additionalProperties": False}),), "required", parallel,
                      QWEN25)
        grammar = matcher(use)
        call = tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n')
        assert grammar.legal_prefix(call) == len(call)
        grammar.consume(call)
        assert grammar.allowed()[tokenizer.eos_token_id], parallel


def test_definitions_are_checked_whatever_the_choice():
    """A definition that could not be enforced is a 400 under `auto` too, as under `required`."""
    broken = (function("f", {"type": "objekt"}),)
    for choice in ("auto", "required"):
        with pytest.raises(APIError, match="cannot be enforced"):
            ToolUse(broken, choice, True, QWEN25).constraint(tiny_tokenizer())
    assert ToolUse((function("f", NESTED),), "auto", True, QWEN25).constraint(tiny_tokenizer()) is None
    assert ToolUse((function("f", NESTED),), "required", True, QWEN25).constraint(tiny_tokenizer()) is not None


OFFERED = ToolUse((function("add", {}), function("get_weather", {})), "auto", True, QWEN25)
BARE = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
ARGUMENTS = '{"a": 1, "b": 2}'
BARE_CASES = [  # calls written without the tags, as small models write them under `auto`: (content, calls)
    (BARE, (None, [("add", ARGUMENTS)])),
    ("```json\n" + BARE + "\n```", (None, [("add", ARGUMENTS)])),
    ("```\n" + BARE + "\n```\n```json\n" + BARE.replace("add", "get_weather") + "\n```",
     (None, [("add", ARGUMENTS), ("get_weather", ARGUMENTS)])),
    ('{ "name" : "add", "parameters": {"a": "}"}} then text', (" then text", [("add", '{"a": "}"}')])),
    ('{"name": "add", "arguments": {"a": 1', (None, [("add", '{"a": 1')])),  # cut short: "length" says so
    ("```json\n" + BARE, (None, [("add", ARGUMENTS)])),  # its fence never closed
    ("```json\n" + BARE + "\n" + BARE + "\n```", (None, [("add", ARGUMENTS)] * 2)),  # two in one fence
    ("```json\n" + BARE + "\n, more\n```", ("```json\n" + BARE + "\n, more\n```", [])),
    # text: a function not offered, another object, another fence, a call after text
    ('{"name": "sub", "arguments": {}}', ('{"name": "sub", "arguments": {}}', [])),
    ('{"name": "ad"}', ('{"name": "ad"}', [])),
    ('{"total": 5}', ('{"total": 5}', [])),
    ("```python\nprint(1)\n```", ("```python\nprint(1)\n```", [])),
    ("Here: " + BARE, ("Here: " + BARE, [])),
    ("`", ("`", [])),
    ('{"name": "add", "arguments": {"a": "' + "x" * 400 + '"}}', (None, [("add", '{"a": "' + "x" * 400 + '"}')])),
]


def test_calls_written_without_tags_are_calls_whole_or_fed_in_pieces():
    for text, expected in BARE_CASES:
        content, calls = CallReader(OFFERED).read(text)
        assert (content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]) == expected, text
        reader, content, calls = CallReader(OFFERED), "", []
        for character in text:  # the stream's worst case: a character a step
            more, new = reader.feed(character)
            content, calls = content + more, calls + new
        more, new = reader.finish()
        content, calls = content + more, calls + new
        assert ((content or None) if calls else content,
                [(c["function"]["name"], c["function"]["arguments"]) for c in calls]) == expected, text


def test_auto_with_a_json_format_takes_the_calls_or_the_formatted_answer():
    """OpenAI's `response_format` shapes the text answer, not the calls: under `auto` the answer is tagged calls, a
    call without the tags, or JSON in the format; under `required` the calls alone (the format is the next turn's).
    A regular expression or grammar cannot join the calls' grammar: a 400."""
    from specdecode.constraints import Constraint

    tokenizer = tiny_tokenizer()
    schema = {"type": "object", "properties": {"total": {"type": "integer"}}, "required": ["total"],
              "additionalProperties": False}
    adds = (function("add", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                             "additionalProperties": False}),)
    texts = {"tagged": '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
             "bare": '{"name": "add", "arguments": {"a": 1}}', "answer": '{"total": 3}', "other": '{"sum": 3}',
             "text": "It is 3."}
    for choice, legal in (("auto", {"tagged", "bare", "answer"}), ("required", {"tagged"})):
        constraint = ToolUse(adds, choice, True, QWEN25).constraint(tokenizer, Constraint.json_schema(schema))
        assert constraint is not None
        for name, text in texts.items():
            grammar = Matcher(constraint, tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
            ids = tokenizer.encode(text)
            whole = grammar.legal_prefix(ids) == len(ids)
            if whole:
                grammar.consume(ids)
            assert (whole and grammar.allowed()[tokenizer.eos_token_id]) == (name in legal), (choice, name)
    with pytest.raises(APIError, match="cannot join"):
        ToolUse(adds, "auto", True, QWEN25).constraint(tokenizer, Constraint.regex("[0-9]+"))


def test_a_long_call_without_tags_is_scanned_once_as_it_streams(monkeypatch):
    """A held call is read again at every piece; its object's scan carries on where the last one stopped (a
    write_file call of a long file, its text full of braces, was scanned whole at every piece)."""
    from specdecode.serve import tools

    scanned = []
    real = tools._scan
    monkeypatch.setattr(tools, "_scan", lambda text, start=0, state=(False, False): (
        scanned.append(len(text) - start), real(text, start, state))[1])
    content = "def f(x):\n    return {'a': [x]}\n" * 100
    text = json.dumps({"name": "add", "arguments": {"path": "a.py", "content": content}})
    reader, calls = CallReader(OFFERED), []
    for at in range(0, len(text), 3):
        calls += reader.feed(text[at:at + 3])[1]
    assert [json.loads(c["function"]["arguments"])["content"] for c in calls] == [content]
    assert sum(scanned) < 2 * len(text)
