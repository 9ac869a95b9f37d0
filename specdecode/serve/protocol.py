"""OpenAI's request bodies as strict pydantic models, OpenAI-style errors, and the response objects.

Strict, as a production client expects of a server: a field of the wrong JSON type is a 400 (no string
is read as a number or a boolean, no number as a boolean), a field the server does not know is a 400
naming it (OpenAI's own answer: "Unrecognized request argument supplied"), and an OpenAI field the server
does not implement (`best_of`, `suffix`, audio...) is taken only at its neutral value, the one that asks for
nothing; any other value is a 400 saying that it is not supported. Every error a client can cause is an
`APIError` with OpenAI's body, never a stack trace or an exception's text. The chat endpoint's own body is
`serve.chat`'s.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, TypeVar, cast

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specdecode import metrics
from specdecode.constraints import Constraint
from specdecode.engine import GenerationResult
from specdecode.engine.sequence import SEED_RANGE
from specdecode.errors import UserError

# stop strings a request may give: OpenAI's API takes 4, but evaluation harnesses send a task's own (HumanEval's
# five, and lm-evaluation-harness adds one) to /v1/completions, as vLLM takes any number
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 256  # characters of one: every step looks for each one's beginning at the text's end
MAX_BIASES = 1024  # logit_bias entries
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids entries
COMPLETION_MAX_TOKENS = 16  # what /v1/completions generates at most when max_tokens is left out or null (OpenAI's)
MAX_NAME = 256  # characters of a model, method or user name (errors quote them back)
MAX_CHOICES = 16  # a request's `n` at most: each sampled choice is a sequence of the batch
MAX_PROMPTS = 64  # a completion request's prompts at most (a batch of prompts: a generation each)
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class APIError(Exception):
    """An error the client caused (4xx) or met (5xx), sent as OpenAI's `{"error": {...}}` body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def quoted(text: str, limit: int = 64) -> str:
    """A client's string for an error message, cut short (a name may be megabytes long)."""
    return text if len(text) <= limit else text[:limit] + "..."


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool | None = None


class JSONSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's named schema; `strict` (default false, as OpenAI's) makes a
    schema keyword the grammar engine cannot enforce a 400, where otherwise it is ignored."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")  # (true: any JSON, as {}; false: none)
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON that validates against a schema."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """Ours, named as vLLM's `structured_outputs`: the output matches a regular expression, or belongs to a
    Lark grammar's language (one of the two)."""

    model_config = STRICT

    regex: str | None = None
    grammar: str | None = None


class SamplingRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = STRICT

    model: str = Field(max_length=MAX_NAME)
    # left out or null: the server's default for chat (`Limits.default_max_tokens`); 16 for completions
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: OpenAI's default, 1; 0 is greedy
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # not OpenAI's; as vLLM's (0: off)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)  # choices: sampled apart, or greedy's copies
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_NAME)  # the end user: scopes cross-request memory
    method: str | None = Field(None, max_length=MAX_NAME)  # ours: the speculative method (default: the server's)
    # as llama-server's: False, the prompt neither takes a prefix from the batch's cache nor leaves one there
    cache_prompt: bool | None = None
    ignore_eos: bool | None = None  # as vLLM's: decode on past end-of-sequence tokens, to max_tokens
    # as vLLM's: tokens that end the answer (kept in it) as an end-of-sequence token does
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # as vLLM's: a regular expression or a Lark grammar
    # the penalties and biases (`SamplingParams`): OpenAI's, then vLLM's two
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0)  # vLLM's: no end-of-sequence or stop token id before so many

    # OpenAI fields this server does not implement, with the values that ask for nothing (taken, then
    # dropped); any other value is a 400
    NEUTRAL: ClassVar[dict[str, tuple]] = {}

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _biases(cls, biases: dict[str, float] | None) -> dict[str, float] | None:
        if biases is None:
            return None
        if len(biases) > MAX_BIASES:
            raise ValueError(f"at most {MAX_BIASES} entries")
        for key, value in biases.items():
            if not key.isascii() or not key.isdigit() or len(key) > 9:
                raise ValueError(f"keys are token ids, got {quoted(key)!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"a bias lies in [-100, 100], got {value}")
        return biases

    def penalties(self) -> dict[str, Any]:
        """The penalties, bias and min-p as `SamplingParams` fields (neutral where left out)."""
        biases = tuple(sorted((int(key), float(value)) for key, value in (self.logit_bias or {}).items()))
        return {"frequency_penalty": self.frequency_penalty or 0.0, "presence_penalty": self.presence_penalty or 0.0,
                "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
                "min_p": self.min_p or 0.0, "logit_bias": biases, "min_tokens": self.min_tokens or 0}

    def top_logprobs_asked(self) -> int | None:
        """The alternatives each output token's entry lists (None: no log-probabilities)."""
        return None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stops(cls, stop: Any) -> list[str]:
        stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if not all(stops):
            raise ValueError("a stop string must not be empty")
        if max(map(len, stops), default=0) > MAX_STOP_LENGTH:
            raise ValueError(f"a stop string has at most {MAX_STOP_LENGTH} characters")
        return stops

    def choices(self) -> int:
        return self.n or 1

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def constraint(self) -> Constraint | None:
        """What `response_format` or `structured_outputs` asks the output to be (None: free text); a 400 with
        the grammar engine's message for a schema, expression or grammar it refuses."""
        asked = self._asked()
        if len(asked) > 1:
            raise APIError(400, f"Give one constraint, not {' and '.join(name for name, _ in asked)}.",
                           param=asked[1][0])
        if not asked:
            return None
        param, make = asked[0]
        try:
            return make()
        except UserError as error:
            raise APIError(400, f"Invalid `{param}`: {error}", param=param) from None

    def constraint_field(self) -> str:
        """The field a generation's constraint comes from, where it has one: the response format or structured
        outputs, else the tools (a tool call's form)."""
        asked = self._asked()
        return asked[0][0] if asked else "tools"

    def _asked(self) -> list[tuple[str, Any]]:
        asked: list[tuple[str, Any]] = []
        form = self.response_format
        if form is not None and form.type != "json_schema" and form.json_schema is not None:
            raise APIError(400, f"`json_schema` goes with `type: json_schema`, not `{form.type}`.",
                           param="response_format.json_schema")
        if form is not None and form.type == "json_object":
            asked.append(("response_format", Constraint.json_object))
        elif form is not None and form.type == "json_schema":
            if form.json_schema is None or form.json_schema.schema_ is None:
                raise APIError(400, "A `json_schema` response format needs `json_schema.schema`.",
                               param="response_format.json_schema")
            schema, strict = form.json_schema.schema_, bool(form.json_schema.strict)
            asked.append(("response_format.json_schema.schema", lambda: Constraint.json_schema(schema, strict)))
        outputs = self.structured_outputs
        if outputs is not None and outputs.regex is not None:
            pattern = outputs.regex
            asked.append(("structured_outputs.regex", lambda: Constraint.regex(pattern)))
        if outputs is not None and outputs.grammar is not None:
            lark = outputs.grammar
            asked.append(("structured_outputs.grammar", lambda: Constraint.grammar(lark)))
        return asked


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    # left out or null: OpenAI's default for completions, within the server's maximum (`Limits.answer_limit`); 0 only
    # with echo (the prompt's log-probabilities alone)
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)  # each token's log-probability and this many alternatives'
    echo: bool | None = None  # the prompt before the answer, in the text and (with logprobs) the log-probabilities

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **SamplingRequest.NEUTRAL,
        "best_of": (None, 1),
        "suffix": (None, ""),
    }

    def top_logprobs_asked(self) -> int | None:
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens is at least 1, or 0 with echo.", param="max_tokens")
        return self.logprobs

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len({type(p) for p in prompt}) > 1:
                raise ValueError("a batch of prompts is texts or token-id lists, not both")
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts a request")
            return [cls._prompt(p) for p in prompt]
        return [cls._prompt(prompt)]

    @staticmethod
    def _prompt(prompt: Any) -> str | list[int]:
        if not prompt and isinstance(prompt, (str, list)):
            raise ValueError("the prompt is empty")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(type(p) is int for p in prompt):
            return prompt
        raise ValueError("the prompt must be a string or a list of token ids (or a list of those)")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as `_prompts` validated them, each a text or token ids (the schema keeps the forms sent)."""
        return cast("list[str | list[int]]", self.prompt)


def _neutral(value: Any, neutral: tuple) -> bool:
    return any(type(value) is type(n) and value == n for n in neutral)  # True is not 1, 0.0 is not False


Request = TypeVar("Request", bound=BaseModel)


def parse(raw: bytes, model: type[Request], defaults: dict[str, Any] | None = None) -> Request:
    """A request body (JSON bytes) as `model`, fields it leaves out taken from `defaults`, or an APIError (400)
    saying what is wrong with it."""
    try:
        data = pydantic_core.from_json(raw, allow_inf_nan=False)  # invalid UTF-8, lone surrogates, deep nesting
    except ValueError as error:
        raise APIError(400, f"The request body is not valid JSON: {error}.") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    for name, neutral in getattr(model, "NEUTRAL", {}).items():
        if name in data and not _neutral(data.pop(name), neutral):
            raise APIError(400, f"`{name}` is not supported by this server; leave it out.", param=name,
                           code="unsupported_parameter")
    try:
        return model.model_validate((defaults or {}) | data)
    except ValidationError as error:
        raise invalid(error) from None


def invalid(error: ValidationError) -> APIError:
    """The first field's error, as OpenAI words it; of a field that takes one of several forms, the error of the
    form the value went furthest into (a `tool_choice` object missing its `function` is that, not "should be
    'none', 'auto' or 'required'"), and the location without pydantic's names of the forms."""
    errors = error.errors(include_url=False)
    field = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
    first = max(field, key=lambda e: len([part for part in e["loc"] if not _form(part)]))
    loc = [part for part in first["loc"] if not _form(part)]
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {quoted(str(loc[-1]))}", param=param)
    if first["type"] == "missing":
        return APIError(400, f"Missing required parameter: `{param}`.", param=param)
    message = re.sub(r" or instance of \w+", "", first["msg"].removeprefix("Value error, "))
    return APIError(400, f"Invalid value for `{param}`: {message}", param=param)


def _form(part: str | int) -> bool:
    """Whether a part of pydantic's location names one form of a field that takes several (`literal['a','b']`,
    `NamedToolChoice`, `str`) rather than a field (every field's name is lower case) or an index."""
    return isinstance(part, str) and (part[:1].isupper() or "[" in part or part in ("str", "int", "float", "bool"))


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"  # eos and stop strings


def usage(choices: list[GenerationResult], prompts: list[GenerationResult]) -> dict:
    """OpenAI's `usage` of a request: every choice's tokens (greedy copies each counted), every prompt's once (from
    one generation of each)."""
    prompt, completion = sum(len(r.prompt_ids) for r in prompts), sum(result.new_tokens for result in choices)
    # (OpenAI's field for prompt tokens served from a cache: here those a sequence of the batch shared, `engine.batch`)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in prompts)}}


def speculative(runs: list[GenerationResult]) -> dict:
    """Beside `usage`: how the request was decoded, over its generations (one per sampled choice; one for all
    greedy choices), which ran side by side."""
    steps = [step for result in runs for step in result.steps]
    tokens, seconds = sum(result.new_tokens for result in runs), max(result.seconds for result in runs)
    return {
        "method": runs[0].method,
        "target_forwards": len(steps),
        "drafted_tokens": sum(s.drafted for s in steps),
        "accepted_tokens": sum(s.accepted for s in steps),
        "mean_accepted_tokens": metrics.mean_accepted_tokens(steps),
        "acceptance_rate": metrics.acceptance_rate(steps),
        "tokens_per_second": metrics.tokens_per_second(tokens, seconds),
    }


def new_id(prefix: str, separator: str = "-") -> str:
    """A new object's id as OpenAI writes it: `chatcmpl-...`; the Responses API's with "_" (`resp_...`)."""
    return f"{prefix}{separator}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
