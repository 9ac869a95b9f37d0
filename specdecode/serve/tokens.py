"""`/tokenize` and `/detokenize`, as vLLM's endpoints of those names (llama-server has the pair too): a client
counts what a prompt takes of the context, or what it would cost, before it sends it, with the server's own
tokenizer and chat template. The ids are the ones a completion with the same `prompt`, or a chat request with
the same `messages` and `tools`, would feed the model; `model` may be left out."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class Asked:
    """vLLM's fields of a /tokenize request beside the prompt or messages (the defaults: what a completion or chat
    request feeds): special tokens around a text prompt, the assistant's turn opened after the messages, or the last
    message continued instead, and each token's text in the answer."""

    add_special_tokens: bool | None = None  # None: a completion's True, a chat's False (its template writes them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


def tokenize_request(raw: bytes, model_name: str) -> tuple[ChatRequest | CompletionRequest, Asked]:
    """The body of a /tokenize request: a chat's (it has `messages`) or a completion's, and vLLM's fields beside."""
    try:
        data = json.loads(raw)
    except ValueError:  # (protocol.parse says what is wrong with it)
        data = None
    asked = Asked()
    if isinstance(data, dict):
        for name in [name for name in data if name in Asked.__dataclass_fields__]:
            if not isinstance(value := data.pop(name), bool):
                raise APIError(400, f"`{name}` is true or false.", param=name)
            asked = replace(asked, **{name: value})
        raw = json.dumps(data).encode()
    kind: type[ChatRequest | CompletionRequest] = ChatRequest if isinstance(data, dict) and "messages" in data \
        else CompletionRequest
    return protocol.parse(raw, kind, {"model": model_name}), asked


async def tokenize(server: Server, body: ChatRequest | CompletionRequest, asked: Asked) -> dict[str, Any]:
    """The prompt's token ids, how many, and the context they must fit in with the answer (and each token's text)."""
    prepared = server.prepare(body)
    if len(prepared) > 1:
        raise APIError(400, "Give one prompt to tokenize.", param="prompt")
    encode = prepared[0][0]  # (`Server.prepare`'s, with vLLM's fields)
    if isinstance(body, ChatRequest):
        if asked.add_generation_prompt and asked.continue_final_message:
            raise APIError(400, "Give add_generation_prompt or continue_final_message, not both.",
                           param="continue_final_message")
        encode = functools.partial(encode, add_generation_prompt=asked.add_generation_prompt,
                                   continue_final_message=asked.continue_final_message,
                                   add_special_tokens=bool(asked.add_special_tokens))
    elif asked.add_special_tokens is not None:
        encode = functools.partial(encode, special=asked.add_special_tokens)
    [ids] = await server.tokenizing(encode)
    answer = {"count": len(ids), "max_model_len": server.models.target.max_context, "tokens": ids}
    if asked.return_token_strs:
        answer["token_strs"] = server.models.tokenizer.convert_ids_to_tokens(ids)
    return answer


async def detokenize(server: Server, body: DetokenizeRequest) -> dict[str, Any]:
    """The text of token ids, as the tokenizer decodes them (special tokens written out)."""
    vocab = server.models.target.vocab_size
    if any(token >= vocab for token in body.tokens):
        raise APIError(400, f"Token ids must lie in [0, {vocab}).", param="tokens")
    [text] = await server.tokenizing(functools.partial(server.models.tokenizer.decode, body.tokens))
    return {"prompt": str(text)}
