"""OpenAI's Responses API (`POST /v1/responses`), stateless, on the chat path: a Responses request becomes a
`ChatRequest` (`ResponsesRequest.chat`) that runs as any chat request runs (the same methods, batching, limits, tool
grammar, log-probabilities and statistics), and its answer is written as a Response object or Responses' streamed
events (`serve.response_objects`). An error names the Responses field it is about (`ResponsesRequest.param`).

What maps onto what: `instructions` is a system message first; `input`'s messages (user, system, developer, assistant;
text parts) are chat messages, its `function_call` items an assistant message's tool calls and its
`function_call_output` items tool messages; `max_output_tokens` is `max_completion_tokens`; Responses' flat function
tools and named `tool_choice` are chat's nested ones; `text.format` is `response_format`; the log-probabilities
included (`include: ["message.output_text.logprobs"]`, or `top_logprobs`) are chat's `logprobs` and `top_logprobs`.

Refused (a 400 naming the field): what needs a stored response or conversation (nothing is stored), built-in tools
(only function tools), image, file and audio input, background runs, `truncation: "auto"`, a reasoning effort, a
verbosity, `max_tool_calls`, `context_management`, `prompt` (a stored prompt), `moderation`, unknown item types.
Accepted and ignored, since they do not change the answer: `store` (nothing is stored either way), `include` entries
other than the log-probabilities (there is nothing to fill them with), `prompt_cache_key`, `prompt_cache_retention`,
`prompt_cache_options`, `safety_identifier`, `service_tier`, `stream_options`, a reasoning `summary`.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from specdecode.serve import protocol
from specdecode.serve.chat import ChatRequest
from specdecode.serve.protocol import MAX_NAME, STRICT, APIError
from specdecode.serve.response_objects import ResponsesReply

if TYPE_CHECKING:
    from specdecode.serve.server import Server

LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for the output text's log-probabilities
STATELESS = "This server stores no responses or conversations; send the whole conversation in `input`."
NOT_SUPPORTED = {  # fields refused unless null, and why
    "previous_response_id": STATELESS,
    "conversation": STATELESS,
    "prompt": "This server stores no prompts; send the instructions and input themselves.",
    "max_tool_calls": "`max_tool_calls` is not supported; leave it out (`parallel_tool_calls: false` allows one call).",
    "context_management": "`context_management` is not supported: the server keeps no context to compact.",
    "moderation": "`moderation` is not supported by this server; leave it out.",
}
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
ITEM_KEYS = {  # what an input item may hold: Responses' fields, and what a client replays of an output item
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status", "caller", "namespace"},
    "function_call_output": {"type", "call_id", "output", "id", "status", "caller", "name", "namespace"},
}
# what a replayed call item's fields must be here, null aside (a pydantic dump writes the output types' every field):
# called directly by the model (not by a program the server ran), from no tool namespace
ITEM_VALUES = {"caller": ({"type": "direct"},), "namespace": ()}
# `include` entries OpenAI defines; all but the log-probabilities' ask for output this server never makes
INCLUDES = (LOGPROBS, "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
            "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
            "reasoning.encrypted_content")


class ResponsesRequest(BaseModel):
    """A Responses request's fields; `chat` makes it the chat request that runs it."""

    model_config = STRICT

    model: str = Field(max_length=MAX_NAME)
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # ours, as chat's
    method: str | None = Field(None, max_length=MAX_NAME)  # ours: the speculative method
    user: str | None = Field(None, max_length=MAX_NAME)
    stream: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)  # echoed
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    store: bool | None = None  # nothing is stored, asked or not
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    # accepted and ignored: they do not change the answer
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    # refused unless null (`NOT_SUPPORTED`)
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    moderation: Any = None

    _origins: dict[str, str] = PrivateAttr(default_factory=dict)  # a chat message's (or call's) input item

    def chat(self) -> ChatRequest:
        """The chat request that runs this one; a 400 naming the field for what it refuses or finds invalid."""
        self._refuse()
        chat: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "method": self.method,
            "user": self.user, "stream": self.stream, "tools": self._tools(), "tool_choice": self._tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": self._format()}
        if self.logprobs():
            chat |= {"logprobs": True, "top_logprobs": self.top_logprobs}
        if self.stream:  # (the usage goes into the last event's response)
            chat["stream_options"] = {"include_usage": True}
        try:
            return ChatRequest.model_validate({key: value for key, value in chat.items() if value is not None})
        except ValidationError as error:
            raise self.renamed(protocol.invalid(error)) from None

    def renamed(self, error: APIError) -> APIError:
        """`error` naming the Responses fields: its `param`, and each chat field its message names in backquotes
        (its `param`, or a path into a field only the chat request has: never a bare name, which may be a
        client's own, as a function called `max_tokens`)."""

        def field(name: re.Match) -> str:
            chat = name.group(1)
            return f"`{self.param(chat) if chat == error.param or CHAT_PATH.match(chat) else chat}`"

        error.message = re.sub(r"`([^`]+)`", field, error.message)
        error.param = self.param(error.param)
        return error

    def echoed(self) -> dict:
        """The request's fields a Response repeats, OpenAI's defaults where left out."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p, "tool_choice": self.tool_choice or "auto",
                "tools": self.tools or [],
                "text": {"format": {"type": "text"}} | {k: v for k, v in (self.text or {}).items() if v is not None},
                "top_logprobs": self.top_logprobs or 0, "truncation": "disabled", "user": self.user,
                "store": False, "background": False, "previous_response_id": None, "reasoning": None}

    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or ()) or self.top_logprobs is not None

    def param(self, chat: str | None) -> str | None:
        """The Responses field that a chat request's field (as an error names it) came from."""
        if chat is None:
            return None
        if match := re.match(r"messages\[\d+\](?:\.tool_calls\[\d+\])?", chat):
            at = match.group(0)
            if at not in self._origins:  # a message's own field, of a message that holds calls
                at = at.split(".")[0]
            rest = chat[len(at):].replace(".function.", ".").replace(".tool_call_id", ".call_id")
            return self._origins.get(at, "input") + (rest if self._origins.get(at) != "instructions" else "")
        for old, new in RENAMED:
            if re.match(old + r"(?![\w])", chat):
                return re.sub(old, new, chat, count=1)
        return chat

    def _refuse(self) -> None:
        for name, why in NOT_SUPPORTED.items():
            if getattr(self, name) is not None:
                raise APIError(400, why, param=name, code="unsupported_parameter")
        if self.background:
            raise APIError(400, "This server runs no background responses; leave `background` out.",
                           param="background", code="unsupported_parameter")
        if self.truncation == "auto":
            raise APIError(400, "This server does not truncate a conversation: one longer than the context is a 400. "
                                "Leave `truncation` out, or `disabled`.", param="truncation",
                           code="unsupported_parameter")
        _known(self.reasoning or {}, {"effort", "summary", "generate_summary"}, "reasoning")
        effort = (self.reasoning or {}).get("effort")
        if effort not in (None, "none"):
            raise APIError(400, "This server's models have no reasoning effort to set; leave `reasoning` out.",
                           param="reasoning.effort", code="unsupported_parameter")
        for index, entry in enumerate(self.include or ()):
            if entry not in INCLUDES:
                raise APIError(400, f"{protocol.quoted(entry)!r} is not an `include` value; the values: "
                                    f"{', '.join(INCLUDES)}.", param=f"include[{index}]")
        if (self.text or {}).get("verbosity") not in (None, "medium"):
            raise APIError(400, "This server's models have no verbosity to set; leave `text.verbosity` out.",
                           param="text.verbosity", code="unsupported_parameter")

    def _messages(self) -> list[dict]:
        """The conversation as chat messages: the instructions, then each input item (a call joins the assistant
        message before it), each message's and call's input item kept in `_origins`."""
        messages: list[dict] = []

        def add(message: dict, origin: str) -> None:
            self._origins[f"messages[{len(messages)}]"] = origin
            messages.append(message)

        if self.instructions is not None:
            add({"role": "system", "content": self.instructions}, "instructions")
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        if not items:
            raise APIError(400, "`input` holds no items.", param="input")
        called: set = set()  # the calls' ids so far, which an output answers
        for index, item in enumerate(items):
            where = "input" if isinstance(self.input, str) else f"input[{index}]"
            kind = _item_type(item, where)
            if kind == "message":
                add(_message(item, where), where)
                continue
            if kind == "function_call" and item.get("status") == "incomplete":
                raise APIError(400, "A call the length limit cut short (`status: incomplete`) has no whole arguments "
                                    "to send back; leave it out.", param=f"{where}.status")
            call_id = _string(item, "call_id", where)  # (a call's, or the call an output answers)
            if kind == "function_call":
                called.add(call_id)
                call = {"id": call_id, "type": "function",
                        "function": {"name": _string(item, "name", where),
                                     "arguments": _string(item, "arguments", where)}}
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    add(last := {"role": "assistant", "content": None}, where)
                calls = last.setdefault("tool_calls", [])
                self._origins[f"messages[{len(messages) - 1}].tool_calls[{len(calls)}]"] = where
                calls.append(call)
            else:
                if call_id not in called:
                    raise APIError(400, f"No `function_call` item before it has the `call_id` "
                                        f"{protocol.quoted(call_id)!r}.", param=f"{where}.call_id")
                add({"role": "tool", "tool_call_id": call_id,
                     "content": _text(item.get("output"), f"{where}.output")}, where)
        return messages

    def _tools(self) -> list[dict] | None:
        """Responses' flat function tools as chat's nested ones; a 400 for any other kind."""
        if self.tools is None:
            return None
        tools = []
        for index, tool in enumerate(self.tools):
            if not isinstance(tool, dict):
                raise APIError(400, 'A tool is an object: {"type": "function", "name": ..., "parameters": ...}.',
                               param=f"tools[{index}]")
            kind = tool.get("type")
            if kind != "function":
                raise APIError(400, f"Only function tools are supported (`type: function`), not "
                                    f"{protocol.quoted(str(kind))!r}: this server runs no built-in tools.",
                               param=f"tools[{index}].type", code="unsupported_parameter")
            tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        return tools

    def _tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if choice == "auto" and not self.tools:  # (Responses' default, which a client sends with no tools)
            return None
        if choice is None or isinstance(choice, str):
            return choice  # (checked by chat's: none, auto or required)
        if choice.get("type") == "function" and set(choice) == {"type", "name"}:
            return {"type": "function", "function": {"name": choice["name"]}}
        raise APIError(400, '`tool_choice` is "none", "auto", "required" or {"type": "function", "name": ...}: this '
                            "server runs function tools only.", param="tool_choice", code="unsupported_parameter")

    def _format(self) -> dict | None:
        """`text.format` as chat's `response_format`."""
        text = self.text or {}
        _known(text, {"format", "verbosity"}, "text")
        form = text.get("format")
        if not isinstance(form, dict) or form.get("type") != "json_schema":
            return form
        return {"type": "json_schema", "json_schema": {key: value for key, value in form.items() if key != "type"}}


# a path into a field of the chat request that the Responses request does not have (`messages[2].content`)
CHAT_PATH = re.compile(r"(messages\[\d+\]|tools\[\d+\]\.function|response_format|tool_choice\.function|json_schema)"
                       r"[.\[]|messages\[\d+\]$")
RENAMED = [  # chat's fields, as regular expressions, and the Responses fields they come from
    (r"tools\[(\d+)\]\.function", r"tools[\1]"),
    (r"tool_choice\.function", "tool_choice"),
    (r"response_format\.json_schema", "text.format"),
    (r"response_format", "text.format"),
    (r"json_schema(?=\.)", "text.format"),  # (a message's `json_schema.schema`)
    (r"(?:max_completion_tokens|max_tokens)", "max_output_tokens"),
    (r"logprobs", "include"),
    (r"messages", "input"),
]


def _known(fields: dict, known: set[str] | frozenset[str], where: str) -> None:
    """A 400 naming the first of an object's `fields` that is not `known`, as OpenAI's for an unknown argument."""
    if extra := sorted(set(fields) - known):
        raise APIError(400, f"Unrecognized request argument supplied: {protocol.quoted(extra[0])}",
                       param=f"{where}.{extra[0]}")


def _item_type(item: Any, where: str) -> str:
    """An input item's type (a message's may be left out), once its fields are those of its type."""
    if not isinstance(item, dict):
        raise APIError(400, "An input item is an object.", param=where)
    kind = item.get("type", "message")
    if not isinstance(kind, str):
        raise APIError(400, "An input item's `type` is a string.", param=f"{where}.type")
    if kind == "item_reference":
        raise APIError(400, STATELESS, param=f"{where}.type", code="unsupported_parameter")
    if kind not in ITEM_KEYS:
        raise APIError(400, f"Input items of type {protocol.quoted(str(kind))!r} are not supported: this server reads "
                            f"{', '.join(ITEM_KEYS)} items.", param=f"{where}.type", code="unsupported_parameter")
    _known(item, ITEM_KEYS[kind], where)
    for key, allowed in ITEM_VALUES.items():
        if item.get(key) is not None and item[key] not in allowed:
            raise APIError(400, f"`{where}.{key}` is not supported here: {', '.join(map(str, allowed)) or 'null'} "
                                "only.", param=f"{where}.{key}", code="unsupported_parameter")
    return kind


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise APIError(400, f"A message's role is one of {', '.join(ROLES)}.", param=f"{where}.role")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"`{where}.{key}` must be a string.", param=f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content or a call's output: a string, or text parts (a replayed refusal is not shown)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"`{where}` must be a string or a list of text parts.", param=where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise APIError(400, f"This server reads text only, not {kind} parts.", param=f"{where}[{index}]",
                           code="unsupported_parameter")
        if kind == "refusal":
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, 'A content part here is {"type": "input_text", "text": ...} (or output_text).',
                           param=f"{where}[{index}]")
        texts.append(part["text"])
    return "".join(texts)


async def create(server: Server, request: Request) -> Response:
    """One request to /v1/responses, from its body to its response, every error naming a Responses field."""
    arrival = time.perf_counter()
    body = protocol.parse(await request.body(), ResponsesRequest)
    chat = body.chat()
    try:
        return await server.answer(request, chat, arrival, ResponsesReply(body.echoed(), body.renamed))
    except APIError as error:
        raise body.renamed(error) from None
