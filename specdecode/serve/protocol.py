"""OpenAI's request bodies as pydantic models, OpenAI-style errors, and the response objects."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdecode.engine import GenerationResult

MAX_STOP_STRINGS = 4  # as OpenAI's API


class APIError(Exception):
    """An error the client caused (4xx) or met (5xx), sent as OpenAI's `{"error": {...}}` body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class SamplingRequest(BaseModel):
    """The fields both endpoints share; unknown fields are ignored, as OpenAI's SDKs may send more."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default and range; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # not OpenAI's; as vLLM's (0: off)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    stream: bool = False
    stream_options: dict | None = None
    method: str | None = None  # ours: the speculative method for this request (default: the server's)

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stops

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("one prompt per request (batch prompts are not supported; send several requests)")
            return prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"  # eos and stop strings


def usage(result: GenerationResult) -> dict:
    prompt, completion = len(result.prompt_ids), result.new_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculative(result: GenerationResult) -> dict:
    """Beside `usage`: how the request was decoded."""
    drafted = sum(s.drafted for s in result.steps)
    accepted = sum(s.accepted for s in result.steps)
    return {
        "method": result.method,
        "target_forwards": result.target_forwards,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "mean_accepted_tokens": result.mean_accepted_tokens,
        "acceptance_rate": result.acceptance_rate,
        "tokens_per_second": result.tokens_per_second,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
