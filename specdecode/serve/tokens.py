"""`/tokenize` and `/detokenize`, as vLLM's endpoints of those names (llama-server has the pair too): a client
counts what a prompt takes of the context, or what it would cost, before it sends it, with the server's own
tokenizer and chat template. The ids are the ones a completion with the same `prompt`, or a chat request with
the same `messages` and `tools`, would feed the model; `model` may be left out."""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, Field

from specdecode.serve import protocol
from specdecode.serve.chat import ChatRequest
from specdecode.serve.protocol import MAX_NAME, STRICT, APIError, CompletionRequest
from specdecode.serve.server import Server


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str = Field(max_length=MAX_NAME)
    tokens: list[Annotated[int, Field(ge=0)]]

    NEUTRAL: ClassVar[dict[str, tuple]] = {}


def tokenize_request(raw: bytes, model_name: str) -> ChatRequest | CompletionRequest:
    """The body of a /tokenize request: a chat's (it has `messages`) or a completion's."""
    try:
        chat = "messages" in json.loads(raw)
    except (ValueError, TypeError):  # (protocol.parse says what is wrong with it)
        chat = False
    kind: type[ChatRequest | CompletionRequest] = ChatRequest if chat else CompletionRequest
    return protocol.parse(raw, kind, {"model": model_name})


async def tokenize(server: Server, body: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """The prompt's token ids, how many, and the context they must fit in with the answer."""
    prepared = server.prepare(body)
    if len(prepared) > 1:
        raise APIError(400, "Give one prompt to tokenize.", param="prompt")
    [ids] = await server.tokenizing(prepared[0][0])
    return {"count": len(ids), "max_model_len": server.models.target.max_context, "tokens": ids}


async def detokenize(server: Server, body: DetokenizeRequest) -> dict[str, Any]:
    """The text of token ids, as the tokenizer decodes them (special tokens written out)."""
    vocab = server.models.target.vocab_size
    if any(token >= vocab for token in body.tokens):
        raise APIError(400, f"Token ids must lie in [0, {vocab}).", param="tokens")
    [text] = await server.tokenizing(functools.partial(server.models.tokenizer.decode, body.tokens))
    return {"prompt": str(text)}
