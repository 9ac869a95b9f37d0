"""Tool calls read out of an answer in Qwen2.5's format (`serve.tools.CallReader`), cases known by hand: text around
calls, several calls, a call that does not parse, an answer cut inside a call; the same read whole and fed in any
pieces (hypothesis), which is what keeps streamed calls equal to whole ones. And which templates have a format."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from conftest import QWEN25_TEMPLATE
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


def test_which_templates_write_calls_this_server_reads():
    assert tool_format(QWEN25_TEMPLATE.read_text()) is QWEN25
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_format(None) is None
