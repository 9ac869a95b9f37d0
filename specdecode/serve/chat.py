"""OpenAI's chat request body (`ChatRequest`): messages (text parts; a tool's result; an assistant's earlier tool
calls), tools and the choice among them, and log-probabilities; read as strictly as `serve.protocol` reads the
fields both endpoints share. What a conversation becomes for the chat template is `template_messages`; what the
tools ask of the output is `serve.tools`."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator

from specdecode.serve.protocol import MAX_NAME, STRICT, APIError, SamplingRequest

MAX_TOOLS = 128  # OpenAI's limit
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class TextPart(BaseModel):
    """A content part of a chat message; only text ones (this server reads no images or audio)."""

    model_config = STRICT

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = STRICT

    name: str = Field(max_length=MAX_NAME)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call an assistant message made earlier in the conversation."""

    model_config = STRICT

    id: str = Field(max_length=MAX_NAME)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None  # validated to the message's text (None: none)
    name: str | None = Field(None, max_length=MAX_NAME)  # the participant's name
    tool_call_id: str | None = Field(None, max_length=MAX_NAME)  # a tool message: the call it answers
    tool_calls: list[ToolCall] | None = None  # an assistant message: the calls it made
    refusal: str | None = None  # an assistant message replayed as OpenAI returned it (not shown to the model)
    # what else a returned message holds when a client sends it back as its SDK dumps it (`message.model_dump()`):
    # empty here (this server returns no audio, no legacy function call, no annotations), and not shown either
    audio: None = None
    function_call: None = None
    annotations: list[dict[str, Any]] | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _text(cls, content: Any) -> str | None:
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("content must be a string or a list of text parts")
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError('content parts must be text parts, {"type": "text", "text": ...}: this server '
                                 "reads text only")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError('a text part is {"type": "text", "text": "..."} with a string text')
            texts.append(part["text"])
        return "".join(texts)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else ""  # validated to a string or None


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object (None: no arguments)
    strict: bool | None = None  # a schema keyword the grammar engine cannot enforce is then a 400


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT

    name: str = Field(max_length=MAX_NAME)


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the answer calls."""

    model_config = STRICT

    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # each output token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=20)  # and this many of the likeliest tokens' at its position
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: True, as OpenAI's

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **SamplingRequest.NEUTRAL,
        "functions": (None, []),
        "function_call": (None, "none"),
        "modalities": (None, ["text"]),
        "audio": (None,),
        "prediction": (None,),
        "store": (None, False),
        "metadata": (None, {}),
        "service_tier": (None, "auto", "default"),
        "reasoning_effort": (None,),
        "web_search_options": (None,),
    }

    def answer_limit(self) -> int | None:
        """max_completion_tokens or max_tokens (OpenAI takes either); a 400 when both differ. None when both
        are left out or null: the server's default (`Limits.default_max_tokens`), where OpenAI's is the rest
        of the context, since one request must not hold the model that long unasked."""
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "Give max_tokens or max_completion_tokens, not both.", param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_asked(self) -> int | None:
        """The alternatives each output token's entry lists (None: no log-probabilities); a 400 for
        top_logprobs without logprobs, as OpenAI's."""
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        """The conversation as chat templates take it: each message's role and text, a tool message's call id
        (and name), an assistant's earlier calls with their arguments as objects (templates write them as JSON
        themselves); a 400 for a message the roles do not allow."""
        out = []
        for index, message in enumerate(self.messages):
            entry: dict[str, Any] = {"role": message.role, "content": message.text()}
            if message.name is not None:
                entry["name"] = message.name
            if message.role == "tool":
                if message.tool_call_id is None:
                    raise APIError(400, "A tool message needs `tool_call_id`.", param=f"messages[{index}].tool_call_id")
                entry["tool_call_id"] = message.tool_call_id
            elif message.tool_call_id is not None:
                raise APIError(400, "Only a tool message has `tool_call_id`.", param=f"messages[{index}].tool_call_id")
            if message.tool_calls:
                if message.role != "assistant":
                    raise APIError(400, "Only an assistant message has `tool_calls`.",
                                   param=f"messages[{index}].tool_calls")
                entry["tool_calls"] = [_template_call(call, f"messages[{index}].tool_calls[{i}]")
                                       for i, call in enumerate(message.tool_calls)]
            out.append(entry)
        return out


def _template_call(call: ToolCall, param: str) -> dict:
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
    except json.JSONDecodeError:
        raise APIError(400, "A tool call's `arguments` must be JSON text.", param=f"{param}.function.arguments") \
            from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
