"""What one request may cost (`Limits`: tokens, time, the queue) and the checks of a request against it and
against the model's context, each failure an OpenAI error (400) before the request reaches the worker."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specdecode.engine import GenerationConfig
from specdecode.errors import UserError
from specdecode.constraints import Constraint
from specdecode.serve.chat import ChatRequest
from specdecode.serve.protocol import COMPLETION_MAX_TOKENS, SEED_RANGE, APIError, SamplingRequest
from specdecode.serve.worker import DEFAULT_MAX_QUEUE
from specdecode.types import SamplingParams

GREEDY_BELOW = 1e-5  # a smaller temperature decodes greedily
NORMALISED_SHRINK = 3  # a Unicode normaliser (NFC) turns at most three characters into one of a third their bytes


@dataclass(frozen=True)
class Limits:
    """What one request may cost."""

    max_tokens: int = 4096  # the most a request may ask to generate
    # a chat request whose max_tokens is left out or null, at most the rest of the context (OpenAI: the rest
    # of the context); a completion's is OpenAI's 16 (`protocol.COMPLETION_MAX_TOKENS`)
    default_max_tokens: int = 512
    request_seconds: float = 300.0  # from arrival; then the generation ends where it is
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting for the model; beyond: 429
    max_prompt_tokens: int | None = None  # the longest prompt a request may send (None: the model's context)

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_tokens <= self.max_tokens:
            raise UserError(f"the default max_tokens ({self.default_max_tokens}) must lie in 1 .. the maximum "
                            f"({self.max_tokens})")
        if not self.request_seconds > 0 or self.max_queue < 1:
            raise UserError("the request timeout must be positive and the queue hold at least one request")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise UserError(f"the longest prompt must be at least one token, got {self.max_prompt_tokens}")

    def prompt_tokens(self, context: int) -> int:
        """The most prompt tokens a request may send: `max_prompt_tokens`, never beyond the context."""
        return context if self.max_prompt_tokens is None else min(self.max_prompt_tokens, context)

    def check_prompt(self, prompt_ids: list[int], context: int, param: str) -> None:
        """Refuse a prompt longer than this server takes (`max_prompt_tokens`) before any work on it; one
        that does not fit in the context is refused by `config`."""
        most = self.prompt_tokens(context)
        if most < context and len(prompt_ids) > most:
            raise APIError(400, f"This server takes prompts of at most {most} tokens; the request has "
                                f"{len(prompt_ids)}.", param=param, code="prompt_too_long")

    def answer_limit(self, body: SamplingRequest, context: int) -> int | None:
        """The tokens a request asks to generate at most (None: a chat request that names none), checked; a completion
        that names none asks for OpenAI's 16, or the server's maximum where that is less (it asked for no number)."""
        if isinstance(body, ChatRequest):
            limit = body.answer_limit()
        else:
            limit = body.max_tokens if body.max_tokens is not None else min(COMPLETION_MAX_TOKENS, self.max_tokens)
        if limit is not None and limit >= context:  # with any prompt at all
            raise APIError(400, f"This model's maximum context length is {context} tokens; the request asks for "
                                f"{limit} to generate.", param="max_tokens", code="context_length_exceeded")
        if limit is not None and limit > self.max_tokens:
            raise APIError(400, f"max_tokens is at most {self.max_tokens} on this server; the request "
                                f"asks for {limit}.", param="max_tokens")
        return limit

    def config(self, body: SamplingRequest, prompt_ids: list[int], limit: int | None, context: int,
               param: str, constraint: Constraint | None = None) -> GenerationConfig:
        """The generation a tokenized request asks for, once it fits in the context; `constraint`: what its answer
        must be (`Server._constraint`: its response format, or its tools' calls)."""
        room = context - len(prompt_ids)
        if room <= 0 or (limit is not None and limit > room):
            asked = f" + {limit} to generate" if limit is not None else ""
            raise APIError(400, f"This model's maximum context length is {context} tokens; the request has "
                                f"{len(prompt_ids)} prompt tokens{asked}.", param=param,
                           code="context_length_exceeded")
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature < GREEDY_BELOW:  # as vLLM: below it, logits / temperature leave float32's range
            temperature = 0.0
        top = body.top_logprobs_asked()
        # a completion's echo: the prompt's scores with logprobs, and the engine's echo for max_tokens 0 (the prompt
        # fed alone)
        echo = bool(getattr(body, "echo", False)) and (top is not None or limit == 0)
        if body.min_tokens and constraint:
            raise APIError(400, "`min_tokens` cannot hold open an answer a format or a required call shapes (its "
                                "grammar may end first).", param="min_tokens")
        # a chat request that names no limit: the server's default, or min_tokens where that asks for more
        most = limit if limit is not None else min(max(self.default_max_tokens, body.min_tokens or 0), room,
                                                   self.max_tokens)
        if body.min_tokens and body.min_tokens > most:
            raise APIError(400, f"`min_tokens` ({body.min_tokens}) is more than the tokens the answer may have "
                                f"({most}).", param="min_tokens")
        try:
            sampling = SamplingParams(temperature=temperature, top_k=body.top_k or 0,
                                      top_p=1.0 if body.top_p is None else body.top_p, **body.penalties())
            return GenerationConfig(max_new_tokens=most,
                                    sampling=sampling, stop=tuple(body.stop or ()), seed=body.seed,
                                    ignore_eos=bool(body.ignore_eos), stop_token_ids=tuple(body.stop_token_ids or ()),
                                    constraint=constraint, echo=echo,
                                    logprobs=top if top is not None else 0 if echo else None)
        except UserError as error:
            raise APIError(400, str(error)) from None


def choice_configs(config: GenerationConfig, count: int) -> list[GenerationConfig]:
    """The generations a request of `count` choices runs: one whose copies are every choice when it decodes
    greedily (they would be the same tokens); else one a choice, choice i seeded with the request's seed + i (its
    first choice is the one a request of one choice gets), or each from fresh randomness without a seed."""
    if count == 1 or config.sampling.greedy:
        return [config]
    low, high = SEED_RANGE
    seeds = [None if config.seed is None else (config.seed + i - low) % (high - low) + low for i in range(count)]
    return [dataclasses.replace(config, seed=seed) for seed in seeds]


def check_ids(prompt: list[int], vocab: int) -> None:
    """Refuse a completion's prompt of token ids that are not the model's."""
    if any(not 0 <= t < vocab for t in prompt):
        raise APIError(400, f"Token ids must lie in [0, {vocab}).", param="prompt")


def prompt_byte_limit(tokenizer, context: int) -> int | None:
    """Above this many UTF-8 bytes a prompt cannot fit in `context` tokens, whatever it says: no token
    stands for more bytes than its own text in the vocabulary (a byte-level symbol, a SentencePiece `▁`
    or `<0x..>` is never shorter than what it stands for), times NORMALISED_SHRINK when the tokenizer
    normalises the text first. None when the vocabulary cannot be read."""
    try:
        longest = max(len(token.encode("utf-8", "replace")) for token in tokenizer.get_vocab())
    except Exception:
        return None
    normaliser = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    return context * longest * (NORMALISED_SHRINK if normaliser is not None else 1)


def check_prompt_bytes(texts: list[str], byte_limit: int | None, context: int, param: str,
                       most: int | None = None) -> None:
    """Refuse a prompt whose bytes already exceed what the context could hold (`prompt_byte_limit`), or
    the `most` tokens a server takes when fewer, before it is tokenized."""
    size = sum(len(text.encode("utf-8")) for text in texts)
    if byte_limit is None or size <= byte_limit:
        return
    if most is not None and most < context:
        raise APIError(400, f"This server takes prompts of at most {most} tokens; the prompt's {size} bytes "
                            "cannot fit in them.", param=param, code="prompt_too_long")
    raise APIError(400, f"This model's maximum context length is {context} tokens; the prompt's {size} bytes "
                        "cannot fit in it.", param=param, code="context_length_exceeded")
