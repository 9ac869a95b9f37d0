"""A chat answer written as OpenAI's Responses API writes it (`/v1/responses`; the request is `serve.responses`'): a
finished answer's Response object (`ResponsesReply.whole`, from the chat body `serve.replies.response` writes) and a
streamed one's events (`ResponsesReply.stream`, from the chat chunks `serve.replies.chunk_bodies` yields), so that
both endpoints read the same text, tool calls and log-probabilities out of a generation.

A Response's `output` holds the answer's text as one `message` item (its `output_text` part with the tokens'
log-probabilities when asked for), and each tool call as a `function_call` item; its `status` is `incomplete` (with
`incomplete_details.reason: max_output_tokens`) where the length limit ended the answer. Beside `usage` it carries
our `speculative` block, as a chat response does, and each streamed text delta our `specdecode` (the step's tokens).

The events, each `event: <type>` and its data with a `sequence_number`: `response.created`, `response.in_progress`;
for text `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`; for a call
`response.output_item.added`, `response.function_call_arguments.delta` (the whole arguments: a call is read once it
closes), `response.function_call_arguments.done`, `response.output_item.done`; then `response.completed` or
`response.incomplete` with the Response. A failure mid-stream, where a chat stream sends an error body, is an
`error` event (its code, message and field) followed by `response.failed`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable

from specdecode.engine import GenerationResult
from specdecode.serve import protocol, replies
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.protocol import APIError, SamplingRequest
from specdecode.serve.worker import Job
from specdecode.types import TokenLogprob


class ResponsesReply(replies.Reply):
    """How a Responses request's generation is written: `echoed`, the request's fields a Response repeats; `renamed`,
    an error naming the Responses fields its chat fields came from (a streamed error names them)."""

    def __init__(self, echoed: dict, renamed: Callable[[APIError], APIError]):
        self.echoed, self.renamed = echoed, renamed
        self.ident, self.created = protocol.new_id("resp", "_"), protocol.now()

    def response(self, model: str, output: list[dict], status: str, usage: dict | None = None,
                 speculative: dict | None = None, error: dict | None = None) -> dict:
        cut = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = {"id": self.ident, "object": "response", "created_at": self.created, "status": status,
                "completed_at": protocol.now() if status == "completed" else None, "model": model, "output": output,
                "error": error, "incomplete_details": cut, "usage": usage, **self.echoed}
        return body if speculative is None else body | {"speculative": speculative}

    def whole(self, outcomes: list[tuple[GenerationResult, list[TokenLogprob]]], plan: replies.Choices) -> dict:
        chat = replies.response(outcomes, plan)
        [choice] = chat["choices"]  # (a Responses request has one)
        message, status = choice["message"], _status(choice["finish_reason"])
        calls = message.get("tool_calls", [])
        output = []
        if message["content"] is not None and (message["content"] or not calls):
            entries = (choice["logprobs"] or {}).get("content") or []
            output.append(text_item(message["content"], entries, "completed" if calls else status))
        output += [call_item(call, cut_or_completed(call)) for call in calls]
        return self.response(chat["model"], output, status, usage(chat["usage"]), chat["speculative"])

    async def stream(self, jobs: list[Job], firsts: list, body: SamplingRequest, plan: replies.Choices,
                     metrics: ServerMetrics) -> AsyncIterator[str]:
        use = plan.answers[0].tools
        events = Events(self, plan.answers[0].model_name, calls_only=use is not None and use.calls_only)
        async with contextlib.aclosing(replies.chunk_bodies(jobs, firsts, body, plan, metrics)) as chunks:
            async for chunk in chunks:
                for event in events.read(chunk):
                    yield event


class Events:
    """A streamed chat answer's chunks (`replies.chunk_bodies`) as Responses' events; the output items as they stand
    (`output`), the text's message item while it is being written (`message`).

    The items are the whole Response's, whatever steps the text came in (a speculative step may carry a call and the
    text after it): one message item with all the text, then the calls. So under `auto` a call's events wait for the
    message item's end (the stream's end); under a forced choice, whose answer is calls alone, each is sent as it
    closes. Text that is blank so far is held, since beside calls it is no item at all. `calls_only`: the answer is
    calls alone (`tools.ToolUse.calls_only`), so no message item, even an empty one."""

    def __init__(self, reply: ResponsesReply, model: str, calls_only: bool = False):
        self.reply, self.model, self.calls_only = reply, model, calls_only
        self.sequence = 0
        self.output: list[dict] = []
        self.message: dict | None = None
        self.finish: str | None = None
        self.usage: dict | None = None
        self.speculative: dict | None = None
        # steps before the message item opens (blank text, an incomplete character, a call being read), with their
        # log-probabilities and tokens: a delta each once it opens; none if it never does
        self.held: list[tuple[str, list[dict], dict | None]] = []
        self.calls: list[dict] = []  # (under `auto`: sent after the message item)

    def read(self, chunk: dict | None) -> list[str]:
        """The events of a chat chunk (None: the stream's end; an error body: its failure)."""
        out = []
        if self.sequence == 0:
            begun = self.reply.response(self.model, [], "in_progress")
            out = [self.event("response.created", response=begun), self.event("response.in_progress", response=begun)]
        if chunk is None:
            return out + self.end()
        if "error" in chunk:
            return out + self.fail(chunk["error"])
        if chunk.get("usage"):
            self.usage = usage(chunk["usage"])
        self.speculative = chunk.get("speculative", self.speculative)
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text, tokens = delta.get("content") or "", chunk.get("specdecode")
            entries = (choice["logprobs"] or {}).get("content") or []
            if text.strip() or (self.message is not None and (text or entries or tokens is not None)):
                out += self.text(text, entries, tokens)
            elif text or entries or tokens is not None:
                self.held.append((text, entries, tokens))
            for call in delta.get("tool_calls", []):
                if self.calls_only:
                    out += self.call(call)
                else:
                    self.calls.append(call)
            self.finish = choice["finish_reason"] or self.finish
        return out

    def text(self, text: str, entries: list[dict], tokens: dict | None = None) -> list[str]:
        """A piece of the answer's text, in the message item being written (opened first if need be: the steps held
        until then first, each its own delta); a step that wrote no text is a delta of none."""
        out = []
        if self.message is None:
            self.message = text_item("", [], "in_progress")
            part = self.message["content"][0]
            self.message["content"] = []
            out.append(self.event("response.output_item.added", output_index=len(self.output), item=self.message))
            self.output.append(self.message)
            out.append(self.event("response.content_part.added", **self._where(), part=part))
            self.message["content"].append(part)
            held, self.held = self.held, []
            for earlier in held:
                out += self.text(*earlier)
        if text or entries or tokens is not None:
            part = self.message["content"][0]
            part["text"] += text
            part["logprobs"] += entries
            out.append(self.event("response.output_text.delta", **self._where(), delta=text, logprobs=entries,
                                  **({"specdecode": tokens} if tokens is not None else {})))
        return out

    def close(self, status: str) -> list[str]:
        """The end of the message item being written, if one is."""
        if self.message is None:
            return []
        where, part = self._where(), self.message["content"][0]
        self.message["status"], item, self.message = status, self.message, None
        return [self.event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
                self.event("response.content_part.done", **where, part=part),
                self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def call(self, call: dict) -> list[str]:
        item, index = call_item(call, "in_progress"), len(self.output)
        arguments, item["arguments"] = item["arguments"], ""
        self.output.append(item)
        out = [self.event("response.output_item.added", output_index=index, item=item)]
        where = {"item_id": item["id"], "output_index": index}
        out.append(self.event("response.function_call_arguments.delta", **where, delta=arguments))
        item["arguments"], item["status"] = arguments, cut_or_completed(call)
        out.append(self.event("response.function_call_arguments.done", **where, arguments=arguments,
                              name=item["name"]))
        return out + [self.event("response.output_item.done", output_index=index, item=item)]

    def end(self) -> list[str]:
        """The last events: the text's item closed (opened first, with what was held, where the answer has neither
        text nor calls and could have had text), the calls held, then the Response, completed or incomplete."""
        status = _status(self.finish)
        opens = self.message is None and not self.output and not self.calls and not self.calls_only
        out = self.text("", []) if opens else []
        out += self.close("completed" if self.calls else status)
        for call in self.calls:
            out += self.call(call)
        whole = self.reply.response(self.model, self.output, status, self.usage, self.speculative)
        return out + [self.event(f"response.{status}", response=whole)]

    def fail(self, error: dict) -> list[str]:
        """A failure mid-stream: an `error` event as the chat stream's error body says it, and `response.failed`."""
        said = self.reply.renamed(APIError(400, error["message"], param=error.get("param")))
        out = [self.event("error", code=error.get("code"), message=said.message, param=said.param)]
        code = "server_error" if error.get("type") == "server_error" else "invalid_prompt"
        failed = self.reply.response(self.model, self.output, "failed", self.usage, self.speculative,
                                     error={"code": code, "message": error["message"]})
        return out + [self.event("response.failed", response=failed)]

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _where(self) -> dict:
        assert self.message is not None
        return {"item_id": self.message["id"], "output_index": self.output.index(self.message), "content_index": 0}


def text_item(text: str, entries: list[dict], status: str) -> dict:
    """The answer's text as an output message item; `entries`: its tokens' log-probabilities, as chat's."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": entries}
    return {"type": "message", "id": protocol.new_id("msg", "_"), "role": "assistant", "status": status,
            "content": [part]}


def call_item(call: dict, status: str) -> dict:
    """A chat tool call (`serve.tools.new_call`) as a function_call output item."""
    return {"type": "function_call", "id": protocol.new_id("fc", "_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def cut_or_completed(call: dict) -> str:
    """A call's item status: "incomplete" for a call the length limit cut short (its arguments the JSON text written
    so far, `serve.tools.cut_call`), else "completed"."""
    try:
        json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        return "incomplete"
    return "completed"


def usage(chat: dict) -> dict:
    """Chat's `usage` as a Response's."""
    cached = chat.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached,
                                                                           "cache_write_tokens": 0},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"

