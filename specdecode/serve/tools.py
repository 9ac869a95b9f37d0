"""Tool calling: the format a model's chat template writes tool calls in (`ToolFormat`, one per template family), what
a request asks of the tools (`ToolUse`: which may be called, must one be), the grammar that makes `required` and
named calls valid (`ToolUse.constraint`: each call's arguments validate against its function's parameters schema),
and the calls read back from the answer, whole or as OpenAI's streamed deltas (`CallReader`).

Families: Qwen2.5's (Hermes' format: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, calls one per
line), found by its template. A template that renders no tools in a known format gets a 400 when a request
sends tools: the server cannot read calls it does not know the shape of.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from specdecode.constraints import Constraint
from specdecode.constraints import depth
from specdecode.constraints.grammar import JSON_OPTIONS
from specdecode.errors import UserError
from specdecode.serve.call_schemas import call_schema
from specdecode.serve.chat import ChatRequest, NamedToolChoice
from specdecode.serve.protocol import APIError, new_id, quoted


@dataclass(frozen=True)
class ToolFormat:
    """How a template family writes one tool call (`prefix`, the call as JSON, `suffix`) and several (`separator`
    between them)."""

    family: str
    prefix: str
    suffix: str
    separator: str

    @property
    def open(self) -> str:
        return self.prefix.strip()

    @property
    def close(self) -> str:
        return self.suffix.strip()


QWEN25 = ToolFormat("Qwen2.5", "<tool_call>\n", "\n</tool_call>", "\n")
FORMATS = (QWEN25,)


def tool_format(template: str | None) -> ToolFormat | None:
    """The format a chat template writes tool calls in (None: none this server reads)."""
    if not template or "tools" not in template:
        return None
    return next((form for form in FORMATS if form.open in template and form.close in template), None)


@dataclass(frozen=True)
class ToolUse:
    """The tools a chat request offers and what it asks of them: `choice` is "auto" (the model decides),
    "required" (at least one call) or the one function's name that must be called; `parallel`: several calls
    allowed in one answer."""

    tools: tuple[dict, ...]  # OpenAI's definitions, as chat templates take them
    choice: str
    parallel: bool
    format: ToolFormat

    @property
    def calls_only(self) -> bool:
        """`required` or a named function: the grammar writes nothing but calls (`constraint`), so no text."""
        return self.choice != "auto"

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    def constraint(self, tokenizer, answer: Constraint | None = None) -> Constraint | None:
        """For `required` or a named function: the answer is one call (or several, when parallel) of the allowed
        functions, each call's arguments valid against its parameters schema, a separator after the last allowed
        (a model that writes one there then ends); a response format (`answer`) is then the later text answer's,
        as OpenAI's. For `auto`, None, or with a JSON response format: those calls, one call without the tags
        (`bare_call`), or the answer in that format (its grammar is made either way: a definition that could not
        be enforced is a 400 whatever the choice). A tag that is one token of `tokenizer`'s (Qwen2.5's
        `<tool_call>`) is that token in the grammar, as the model writes it."""
        functions = [tool["function"] for tool in self.tools
                     if self.choice in ("auto", "required", tool["function"]["name"])]
        bodies = [f"body_{i}: %json {json.dumps(call_schema(function))}" for i, function in enumerate(functions)]
        calls = " | ".join(f"body_{i}" for i in range(len(functions)))
        start = "calls: call (SEP call)* SEP?" if self.parallel else "calls: call SEP?"
        form, added = self.format, set(getattr(tokenizer, "get_added_vocab", dict)())

        def tag(text: str) -> str:  # the special token itself, or the text
            return text if text in added else json.dumps(text)

        before, after = form.prefix[len(form.open):], form.suffix[: -len(form.close)]
        call = f"call: {tag(form.open)} {json.dumps(before)} body {json.dumps(after)} {tag(form.close)}"
        rules = [start, call, f"body: {calls}", *bodies, f"SEP: {json.dumps(form.separator)}"]
        joined = answer if self.choice == "auto" else None  # (beside required or named calls: the next turn's)
        if joined is not None and joined.kind not in ("json_schema", "json_object"):
            raise APIError(400, f"With tools and `tool_choice` auto, the answer's format is a JSON schema or object, "
                                f"not a {joined.describe()} (the calls' grammar cannot join it); give `tool_choice` "
                                "none or required.", param="tool_choice")
        if joined is not None:
            schema = json.loads(joined.source) | {"x-guidance": dict(JSON_OPTIONS, lenient=joined.lenient)}
            rules += ["start: calls | body | answer", f"answer: %json {json.dumps(schema)}"]
        else:
            rules += ["start: calls"]
        try:
            constraint = Constraint.grammar("\n".join(rules))
        except UserError as error:
            raise APIError(400, f"The tools' parameters cannot be enforced: {error}", param="tools") from None
        return None if self.choice == "auto" and joined is None else constraint


def tool_use(body: ChatRequest, template: str | None) -> ToolUse | None:
    """What a request asks of tools (None: no tools, or `tool_choice: none`); a 400 for a choice without tools, a
    function it does not offer, or a model whose template writes no tool calls this server can read."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "`tool_choice` needs `tools`.", param="tool_choice")
        return None
    if choice == "none":
        return None
    form = tool_format(template)
    if form is None:
        families = ", ".join(f.family for f in FORMATS)
        raise APIError(400, f"This model's chat template writes no tool calls this server can read (it reads "
                            f"{families}'s); leave `tools` out.", param="tools", code="tools_unsupported")
    tools = tuple(tool.model_dump(exclude_none=True) for tool in body.tools)
    for i, tool in enumerate(tools):  # (the grammar's own check would not say which tool)
        if depth.too_deep(call_schema(tool["function"])):
            raise APIError(400, f"The parameters of `{quoted(tool['function']['name'])}` nest more than "
                                f"{depth.MAX_DEPTH} levels deep: the grammar engine takes no deeper ones.",
                           param=f"tools[{i}].function.parameters")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and named not in [tool["function"]["name"] for tool in tools]:
        raise APIError(400, f"`tool_choice` names `{quoted(named)}`, which is not among `tools`.", param="tool_choice")
    asked = named if named is not None else choice if isinstance(choice, str) else "auto"
    return ToolUse(tools, asked, body.parallel_tool_calls is not False, form)


def new_call(name: str, arguments: str) -> dict:
    """An OpenAI tool call, its arguments as JSON text."""
    return {"id": new_id("call", "_"), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_call(text: str) -> dict | None:
    """One call's JSON (`{"name": ..., "arguments": {...}}`) as an OpenAI tool call; None if it is not one."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return new_call(call["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None


CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(.*)', re.DOTALL)


def cut_call(text: str, names: list[str]) -> dict | None:
    """A call that the answer's end cut short (`{"name": "f", "arguments": {"city": "Pa`) as an OpenAI tool call
    whose arguments are the JSON text written so far, as OpenAI returns a call cut by `max_tokens` (with
    finish_reason "length"); None unless it names one of `names`."""
    match = CUT_CALL.fullmatch(text)
    if match is None:
        return None
    name = json.loads(match.group(1))
    if name not in names:
        return None
    return new_call(name, match.group(2))


def _closing(text: str, close: str) -> int:
    """Where `close` first stands in a call's text outside a JSON string (an argument may spell the tag), or -1."""
    end = text.find(close)
    while end >= 0 and _in_string(text[:end]):
        end = text.find(close, end + 1)
    return end


def _in_string(text: str) -> bool:
    """Whether JSON text ends inside a string."""
    return _scan(text)[1][0]


def _scan(text: str, start: int = 0, state: tuple[bool, bool] = (False, False)
          ) -> tuple[list[int], tuple[bool, bool]]:
    """The positions of JSON text's characters from `start` that stand outside its strings (quotes aside), and the
    state at its end (inside a string, after an escape in one), from which a scan of more text carries on."""
    outside, (inside, escaped) = [], state
    for i in range(start, len(text)):
        character = text[i]
        if escaped:
            escaped = False
        elif character == "\\":
            escaped = inside
        elif character == '"':
            inside = not inside
        elif not inside:
            outside.append(i)
    return outside, (inside, escaped)


class CallReader:
    """Reads an answer's text as it comes (`feed`, then `finish`) into the text meant for the user and tool calls.
    Text before, between and after calls is content (blank text between calls is dropped); a call that does not
    parse stays content. The same reader serves whole answers (`read`) and streamed ones, so both agree."""

    def __init__(self, use: ToolUse):
        self.use = use
        self.buffer = ""
        self.inside = False  # within a call's opening and closing tags
        self.bare = True  # at the answer's start or after a bare call: a bare call may come (`bare_call`)
        self.fenced = False  # within a fence of bare calls
        self.scanned: dict = {}  # how far a held bare call's object was scanned (`_object_end`)
        self.calls: list[dict] = []
        self.blank = ""  # blank text after a call, held until text that is not blank follows (else dropped)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, new calls) that this piece of text completes."""
        self.buffer += text
        content, calls = "", list[dict]()
        form = self.use.format
        while True:
            if self.bare and not self.inside:
                read = bare_call(self.buffer, self.use.names, self.fenced, self.scanned)
                if isinstance(read, tuple):
                    call, used, self.fenced = read
                    self.buffer, self.scanned = self.buffer[used:], {}
                    calls += self._take(call)
                    continue
                if read == MORE:  # (held until it shows whether it is a call)
                    return content, calls
                self.bare = False
            if not self.inside:
                at = self.buffer.find(form.open)
                if at < 0:  # keep what may still become the opening tag
                    keep = next((n for n in range(min(len(form.open) - 1, len(self.buffer)), 0, -1)
                                 if form.open.startswith(self.buffer[-n:])), 0)
                    content += self._outside(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return content, calls
                content += self._outside(self.buffer[:at])
                self.buffer, self.inside = self.buffer[at + len(form.open) :], True
            else:
                end = _closing(self.buffer, form.close)
                if end < 0:
                    return content, calls
                body, self.buffer, self.inside = self.buffer[:end], self.buffer[end + len(form.close) :], False
                text_, new = self._call(body)
                content, calls = content + text_, calls + new

    def finish(self) -> tuple[str, list[dict]]:
        """(content, calls) left at the end: an unclosed call that parses is a call (an answer cut short)."""
        rest, self.buffer = self.buffer, ""  # (blank text held after a call is dropped)
        if self.bare and not self.inside:  # a bare call cut short, or text that could have begun one
            self.bare = False
            start = rest.find("{")
            end = _object_end(rest, start) if start >= 0 else None  # (whole, but for a fence's close)
            call = None if start < 0 else parse_call(rest[start:end]) if end else cut_call(rest[start:].strip(),
                                                                                          self.use.names)
            return ("", self._take(call)) if call is not None else (self._cut(rest), [])
        if self.inside:  # (a closing tag cut short is left out)
            self.inside = False
            close = self.use.format.close
            cut = next((n for n in range(min(len(close) - 1, len(rest)), 0, -1) if close.startswith(rest[-n:])), 0)
            return self._call(rest[: len(rest) - cut], closed=False)
        return self._cut(rest), []

    def read(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole answer: (content, or None when it is blank beside calls or under a forced choice; the calls)."""
        content, calls = self.feed(text)
        more, last = self.finish()
        content += more
        calls += last
        return (None if (calls or self.use.calls_only) and not content.strip() else content), calls

    def _outside(self, text: str) -> str:
        if self.calls and not text.strip():
            self.blank += text
            return ""
        text, self.blank = self.blank + text, ""
        return text

    def _call(self, body: str, closed: bool = True) -> tuple[str, list[dict]]:
        call = parse_call(body.strip())
        if call is None and not closed:
            call = cut_call(body.strip(), self.use.names)
        form = self.use.format
        if call is None:
            return (form.open + body + form.close, []) if closed else (self._cut(form.open + body), [])
        return "", self._take(call)

    def _cut(self, text: str) -> str:
        """An answer's end cut short where no call reads: content, but under `required` or a named function the
        grammar wrote nothing but calls, so it is the beginning of a call, not text for the user (none)."""
        return "" if self.use.calls_only else self._outside(text)

    def _take(self, call: dict) -> list[dict]:
        if self.calls and not self.use.parallel:
            return []  # one call only: the rest are dropped
        self.calls.append(call)
        return [call]


MORE = "more"  # `bare_call`: the text may still become a call


def bare_call(text: str, names: list[str], fenced: bool = False, scanned: dict | None = None
              ) -> tuple[dict, int, bool] | str | None:
    """An answer's start read as a call written without the template's tags, as small models often write them
    under `tool_choice: auto` (`{"name": "f", "arguments": {...}}`; in a ```json fence, several in one): (the call,
    the characters it took, whether a fence it is in stays open for the next) once whole; MORE while the text may
    still become one; None once it cannot (it is text). `fenced`: within a fence an earlier call opened;
    `scanned`: where an earlier read of the same text, shorter, left its scan (a long call is then read once, not
    again at every piece). A call of a function the request does not offer is text."""
    at = len(text) - len(text.lstrip())
    if not fenced and text[at:] and len(text[at:]) < 3 and "```".startswith(text[at:]):
        return MORE
    if not fenced and text.startswith("```", at):  # ```json, or ```, then the line's end
        fenced, at = True, at + 3
        if text.startswith("json", at):
            at += 4
        elif text[at:] and "json".startswith(text[at:]):
            return MORE
        line = text[at:].lstrip(" \t")
        if not line.startswith("\n"):
            return MORE if not line else None
        at = len(text) - len(line) + 1
    start = at = at + len(text[at:]) - len(text[at:].lstrip())
    for literal in ("{", '"name"', ":", '"'):
        at += len(text[at:]) - len(text[at:].lstrip()) if literal != "{" else 0
        if not text.startswith(literal, at):
            return MORE if literal.startswith(text[at:]) else None
        at += len(literal)
    close = text.find('"', at)
    name = text[at:] if close < 0 else text[at:close]
    if close < 0:
        return MORE if any(n.startswith(name) for n in names) else None
    if name not in names:
        return None
    end = _object_end(text, start, scanned)
    call = None if end is None else parse_call(text[start:end])
    if end is None or call is None:
        return MORE if end is None else None
    if not fenced:
        return call, end, False
    rest = text[end:].lstrip()  # the fence's close, or the next call in it
    if rest.startswith("```"):
        return call, len(text) - len(rest) + 3, False
    if rest.startswith("{"):
        return call, end, True
    return MORE if "```".startswith(rest) else None


def _object_end(text: str, start: int, scanned: dict | None = None) -> int | None:
    """Where the JSON object opening at `start` ends (past its closing brace), or None if it has not yet; `scanned`
    keeps how far a scan of the text got, for the next read of it grown."""
    at, depth, state = (scanned or {}).get(start, (start, 0, (False, False)))
    outside, state = _scan(text, at, state)
    for i in outside:
        if text[i] in "{[":
            depth += 1
        elif text[i] in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    if scanned is not None:
        scanned[start] = (len(text), depth, state)
    return None
