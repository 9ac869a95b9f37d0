"""Scoring skip sets: the predicted speedup of a chain (`chain_speedup`) from the teacher-forced agreement
on calibration prompts (`CalibrationSet`) and the draft cost, memoised per skip set (`Scorer`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specdecode.drafters.draft_model import best_draft_length
from specdecode.drafters.self_speculative.layers import check_layer_skipping, crop_layers, run_layers
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM, module_bytes

CONTINUATION = 48  # tokens of the full model's greedy continuation per calibration prompt


def chain_speedup(agreement: float, draft_cost: float, curve: CostCurve, max_tokens: int) -> tuple[float, int]:
    """Predicted speedup over plain decoding of chains whose tokens are each accepted with probability
    `agreement`, and the draft length (1..max_tokens) that gives it. As DraftModelDrafter's model: a chain
    of k drafts yields (1 - a^(k+1)) / (1 - a) tokens per step for k draft forwards and one verification
    over k + 1 tokens, k * draft_cost + curve(k + 1) target forwards; plain decoding yields 1 per forward."""
    length = best_draft_length(agreement, draft_cost, range(1, max_tokens + 1), curve)
    a = min(max(agreement, 0.0), 0.999)
    tokens = (1 - a ** (length + 1)) / (1 - a)
    return tokens / (length * draft_cost + curve(length + 1)), length


@dataclass(frozen=True)
class SkipChoice:
    """A skip set and how it scored on the calibration."""

    skip: tuple[int, ...]
    agreement: float  # teacher-forced (see CalibrationSet)
    draft_cost: float  # one draft forward in one-token target forwards
    speedup: float  # predicted by chain_speedup
    draft_length: int  # the chain length that speedup assumes


@dataclass(frozen=True)
class SearchResult:
    best: SkipChoice
    evaluated: int  # distinct skip sets scored, one partial forward each
    seconds: float  # the search's own time (of the run that made it, when read from the cache)
    from_cache: bool = False
    searches: int = 1  # searches that made it (`search.SETTLED`)
    settled: bool = True  # whether a start takes it as it is (else it searches again)


def block_influence(residual: list[torch.Tensor]) -> list[float]:
    """ShortGPT's block influence of each layer, 1 - the mean cosine similarity between the residual stream
    entering and leaving it: residual[i] enters layer i ([n, hidden] each, the last one leaves the last
    layer). Low influence: a layer that changes little, a good one to skip."""
    return [
        float(1 - torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean())
        for a, b in zip(residual[:-1], residual[1:])
    ]


def greedy_continuation(model: CausalLM, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding, as the engine without a drafter does it (one forward per token, the argmax
    of its one row): up to `max_new_tokens` new tokens, an end-of-sequence token (kept) or a full context."""
    model.reset()
    context, pending = list(prompt_ids), list(prompt_ids)
    output: list[int] = []
    while len(output) < max_new_tokens and len(context) < model.max_context:
        logits = model.forward(torch.tensor(pending, device="cpu"), num_logits=1).logits  # [1, vocab]
        token = int(logits[0].argmax())
        output.append(token)
        context.append(token)
        pending = [token]
        if token in model.eos_token_ids:
            break
    return output


class CalibrationSet:
    """The target's greedy continuations of a few prompts and its keys and values over them, on which skip
    sets are scored.

    `agreement(skip)` is teacher-forced, in one forward of the kept layers: the token before each
    continuation token is fed with the full model's keys and values for everything before it, exactly the
    first draft token's situation in self-speculative decoding (a later draft token also sees the draft's
    own entries for the earlier drafts, which this ignores), and its argmax is compared with the full
    model's greedy token. All sequences share one cache, kept apart by the attention mask.
    """

    def __init__(self, target: HFCausalLM, prompts: Sequence[Sequence[int]], continuation: int = CONTINUATION):
        if not prompts or not all(prompts):
            raise UserError("calibration needs at least one non-empty prompt")
        model = target.model
        check_layer_skipping(model)
        self.model = model
        self.num_layers = model.config.num_hidden_layers
        plain = HFCausalLM(model, target.eos_token_ids)  # its own cache, not the target's
        tokens: list[int] = []
        positions: list[int] = []
        segments: list[int] = []
        queries: list[int] = []  # packed index of the token before each continuation token
        expected: list[int] = []
        for segment, prompt in enumerate(prompts):
            generated = greedy_continuation(plain, list(prompt), continuation)
            sequence = [*prompt, *generated]
            queries += range(len(tokens) + len(prompt) - 1, len(tokens) + len(sequence) - 1)
            expected += generated
            tokens += sequence
            positions += range(len(sequence))
            segments += [segment] * len(sequence)
        self.length = len(tokens)
        device = target.device  # the calibration's tensors and cache live with the model
        token_ids, position_ids = torch.tensor(tokens, device=device), torch.tensor(positions, device=device)
        segment_ids, index = torch.tensor(segments, device=device), torch.arange(len(tokens), device=device)
        same = segment_ids[:, None] == segment_ids[None, :]  # [length, length]
        # 1. The full model over every sequence (block-diagonal causal) fills the cache.
        self.cache = DynamicCache(config=model.config)
        residual: list[torch.Tensor] = []
        with torch.inference_mode():
            run_layers(model, range(self.num_layers), token_ids, position_ids,
                       same & (index[:, None] >= index[None, :]), self.cache, trace=residual)
        self.influence = block_influence(residual)  # [num_layers]
        # 2. The queries: query q sees the full model's entries of its own sequence before it, and itself.
        query = torch.tensor(queries, device=device)
        self.query_tokens, self.query_positions = token_ids[query], position_ids[query]  # [queries]
        earlier = same[query] & (position_ids[None, :] < position_ids[query][:, None])  # [queries, length]
        self.query_allowed = torch.cat([earlier, torch.eye(len(queries), dtype=torch.bool, device=device)], dim=1)
        self.expected = torch.tensor(expected, device=device)  # [queries]

    @torch.inference_mode()
    def agreement(self, skip: Iterable[int]) -> float:
        skipped = set(skip)
        kept = [i for i in range(self.num_layers) if i not in skipped]
        try:
            hidden = run_layers(self.model, kept, self.query_tokens, self.query_positions, self.query_allowed,
                                self.cache)  # [queries, hidden]
        finally:
            crop_layers(self.cache, kept, self.length)
        predicted = self.model.get_output_embeddings()(hidden).argmax(-1)  # [queries]
        return float((predicted == self.expected).float().mean())


class Scorer:
    """Scores skip sets on a calibration (memoised): agreement, draft cost, predicted speedup."""

    def __init__(self, target: HFCausalLM, calibration: CalibrationSet, curve: CostCurve, max_tokens: int):
        self.calibration, self.curve, self.max_tokens = calibration, curve, max_tokens
        self.total_bytes = target.weight_bytes_per_token
        self.layer_bytes = [module_bytes(layer) for layer in target.model.model.layers]
        self.scores: dict[tuple[int, ...], SkipChoice] = {}
        self.calls = 0  # skip sets asked for, repeats included

    def __call__(self, skip: Iterable[int]) -> SkipChoice:
        self.calls += 1
        key = tuple(sorted(set(skip)))
        if key not in self.scores:
            agreement = self.calibration.agreement(key)
            cost = 1 - sum(self.layer_bytes[i] for i in key) / self.total_bytes
            speedup, length = chain_speedup(agreement, cost, self.curve, self.max_tokens)
            self.scores[key] = SkipChoice(key, agreement, cost, speedup, length)
        return self.scores[key]

    @property
    def best(self) -> SkipChoice:
        return max(self.scores.values(), key=lambda choice: choice.speedup)
