"""The target's log-probabilities of the tokens a sequence emits, and of its prompt's tokens, for a request that
asks for them: from the forwards the sequence makes anyway (verification's, the prompt's prefill), never an extra
one.

A token's log-probability is the log-softmax of the target's raw logits at its position (OpenAI's convention):
before penalties, a bias, temperature, truncation or a grammar's mask, so that it does not depend on how the
token was chosen, and a speculative step reports what plain decoding reports for the same token. Under greedy
decoding every emitted token is the processed argmax of its row, so the values ride along the verdict's one
transfer (`riders`); a sampled step reads them in a second transfer once its tokens are known.
"""

from __future__ import annotations

import torch

from specdecode.devices import to_host
from specdecode.types import TokenLogprob, Verdict

MAX_TOP = 20  # the most alternatives a token's entry lists (OpenAI's top_logprobs limit)


def riders(raw: torch.Tensor, rows: torch.Tensor, top: int) -> tuple[torch.Tensor, ...]:
    """What greedy verification carries to the host with its verdict so that every emitted token's entry is known:
    raw, rows: [n + 1, vocab] the target's logits as the model gave them and as processed for verification.
    -> ([n + 1] the log-probability of each row's processed argmax, [n + 1, top] the likeliest log-probabilities,
    [n + 1, top] their tokens)."""
    logprobs = raw.float().log_softmax(-1)  # [n + 1, vocab]
    chosen = logprobs.gather(-1, rows.argmax(-1, keepdim=True)).squeeze(-1)  # [n + 1]
    values, tokens = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # [n + 1, top] each
    return chosen, values, tokens


def _entries(tokens: list[int], chosen: list[float], values: list[list[float]], alternatives: list[list[int]]
             ) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(token, value, tuple(zip(alt, vals)))
                 for token, value, vals, alt in zip(tokens, chosen, values, alternatives))


def emitted(raw: torch.Tensor, verdict: Verdict, top: int) -> tuple[TokenLogprob, ...]:
    """Each of the verdict's tokens' entries. raw: [n + 1, vocab] the target's logits after the context (row 0) and
    after each draft node's path. From the verdict's riders when greedy verification carried them, else read here."""
    at = [0] + [node + 1 for node in verdict.path]  # the row each emitted token was chosen from
    if verdict.riders:
        chosen, values, alternatives = verdict.riders  # every row's
        return _entries(list(verdict.tokens), [chosen[r] for r in at], [values[r] for r in at],
                        [alternatives[r] for r in at])
    index = torch.tensor(at, device=raw.device)  # [m]
    logprobs = raw.index_select(0, index).float().log_softmax(-1)  # [m, vocab]
    tokens = torch.tensor(verdict.tokens, device=raw.device)  # [m]
    values, alternatives = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # [m, top] each
    chosen_, values_, alternatives_ = to_host(logprobs.gather(-1, tokens[:, None]).squeeze(-1), values, alternatives)
    return _entries(list(verdict.tokens), chosen_, values_, alternatives_)


def of_prompt(logits: torch.Tensor, following: list[int], top: int) -> tuple[TokenLogprob, ...]:
    """The entries of prompt tokens `following` ([m] ids), each scored by the row before it. logits: [m, vocab]."""
    logprobs = logits.float().log_softmax(-1)  # [m, vocab]
    tokens = torch.tensor(following, device=logits.device)  # [m]
    values, alternatives = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # [m, top] each
    chosen, values_, alternatives_ = to_host(logprobs.gather(-1, tokens[:, None]).squeeze(-1), values, alternatives)
    return _entries(following, chosen, values_, alternatives_)
