"""The self-speculative drafters (layer skipping, early exit) and their builders for the methods registry."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specdecode.drafters.base import Drafter
from specdecode.drafters.options import DrafterOptions
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.self_speculative.layers import SkippedLayers
from specdecode.drafters.self_speculative.scoring import CONTINUATION
from specdecode.drafters.self_speculative.search import SEARCH_SECONDS, search_exit, search_skip
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM, torch_target
from specdecode.types import Draft

EXIT_FRACTION = 0.75  # EarlyExitDrafter's default exit layer, as a fraction of the layers (see there)


class LayerSkipDrafter(DraftModelDrafter):
    """Drafts a chain with the target's kept layers: DraftModelDrafter's loop (greedy drafts, or sampled
    ones with their distributions for lossless speculative sampling; adaptive length from the online
    acceptance, the draft cost and the target's cost curve) with `SkippedLayers` as its draft model.

    `target` must be the very HFCausalLM the engine verifies with: the drafter reads its cache. Before
    each draft the view is lined up with the target's cache; afterwards the draft tokens' entries are
    cropped, so the target's cache is as the engine left it. The step that prefills a prompt longer than
    `prefill_limit` tokens does not draft: the kept layers would have to prefill it as well, a large
    share of a prefill for a few draft tokens. Every later step feeds one pending token.
    """

    name = "layerskip"

    def __init__(
        self,
        target: HFCausalLM,
        skip: Iterable[int],
        num_tokens: int = 4,
        adaptive: bool = True,
        min_tokens: int = 1,
        max_tokens: int = 16,
        confidence_threshold: float = 0.4,
        draft_cost: float | None = None,  # None: the kept share of the weights (`SkippedLayers.relative_cost`)
        curve: CostCurve | None = None,  # the target's; None: its measured one (`CausalLM.cost_curve`)
        prefill_limit: int = 16,
    ):
        if not isinstance(target, HFCausalLM):
            raise UserError("self-speculative drafting runs the target's layers itself: it needs the torch backend")
        if prefill_limit < 1:
            raise UserError(f"prefill_limit must be >= 1 (steps after the prefill feed one token), got {prefill_limit}")
        view = SkippedLayers(target, skip)
        super().__init__(
            view, num_tokens=num_tokens, adaptive=adaptive, min_tokens=min_tokens, max_tokens=max_tokens,
            confidence_threshold=confidence_threshold,
            draft_cost=view.relative_cost if draft_cost is None else draft_cost,
            curve=target.cost_curve() if curve is None else curve,
        )
        self.target, self.view, self.prefill_limit = target, view, prefill_limit

    @property
    def skip(self) -> tuple[int, ...]:
        return self.view.skip

    def propose(self, context, max_tokens, params, generator) -> Draft:
        start = self.target.cache_length  # the context the target holds keys and values for
        if len(context) - start > self.prefill_limit:
            return Draft.empty()
        self._cache.seen = list(context[:start])  # the view's cache begins as the target's
        try:
            return super().propose(context, max_tokens, params, generator)
        finally:
            self.view.crop(start)  # drop the draft's entries: the target's cache is as it was
            del self._cache.seen[start:]


class EarlyExitDrafter(LayerSkipDrafter):
    """Drafts with the first `exit_layer` layers, then the model's final norm and LM head.

    The draft's context keys and values are then exactly what it would compute itself (the first k layers
    see the same residual stream as in the full model), so sharing the target's cache approximates
    nothing. The default exit layer is EXIT_FRACTION of the layers: without early-exit training, a middle
    layer read through the final norm and head rarely predicts what the last layer does, only a late one
    does; `build_earlyexit` searches the exit layer instead (`search_exit`).
    """

    name = "earlyexit"

    def __init__(self, target: HFCausalLM, exit_layer: int | None = None, **options):
        if not isinstance(target, HFCausalLM):
            raise UserError("early exit runs the target's layers itself: it needs the torch backend")
        num_layers = target.model.config.num_hidden_layers
        exit_layer = max(1, round(EXIT_FRACTION * num_layers)) if exit_layer is None else exit_layer
        if not 1 <= exit_layer <= num_layers:
            raise UserError(f"the exit layer must be in [1, {num_layers}], got {exit_layer}")
        super().__init__(target, skip=range(exit_layer, num_layers), **options)
        self.exit_layer = exit_layer



# --- Builders (the methods registry) --------------------------------------------------------------------

# Calibration texts: the model continues each, and the search scores skip sets on its own continuations.
# Short, and of the kinds the default target (a coding assistant) meets: code, prose, a chat request.
CALIBRATION_TEXTS = (
    "import heapq\n\n\ndef dijkstra(graph, source):\n"
    '    """Shortest distances from source in a graph given as {node: [(neighbour, weight), ...]}."""\n'
    "    distances = {source: 0}\n    queue = [(0, source)]\n",
    "The river rises in the hills above the town and winds for forty miles through farmland before it "
    "reaches the sea. In spring, when the snow melts, it often floods the lower fields, and",
)
CALIBRATION_REQUEST = "Write a Python function that merges two sorted lists into one sorted list."


def calibration_prompts(
    tokenizer, vocab_size: int, count: int = 3, length: int = 24, max_length: int | None = None
) -> list[list[int]]:
    """Token ids of the calibration texts and, when the tokenizer has a chat template, of a short coding
    request as a chat turn. Without a tokenizer (tiny test models), `count` seeded random sequences of
    `length` ids: only the model's own greedy continuations of them are scored, which keeps them usable."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(vocab_size, (length,), generator=generator, device="cpu").tolist() for _ in range(count)]
    prompts = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in CALIBRATION_TEXTS]
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": CALIBRATION_REQUEST}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return [p[-max_length:] for p in prompts] if max_length else prompts  # a small model's context holds them




def build_layerskip(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> Drafter:
    """`layerskip`: the target drafts with the layers the search (`search_skip`, cached) leaves in."""
    target = torch_target(target, "method 'layerskip'")
    prompts = calibration_prompts(options.tokenizer, target.vocab_size,
                                  max_length=target.max_context - CONTINUATION - 1)
    result = search_skip(target, prompts, budget_seconds=SEARCH_SECONDS, continuation=CONTINUATION)
    return LayerSkipDrafter(target, result.best.skip, num_tokens=result.best.draft_length,
                            draft_cost=result.best.draft_cost, curve=target.cost_curve())


def build_earlyexit(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> Drafter:
    """`earlyexit`: the target drafts with its first k layers, k from the search (`search_exit`, cached)."""
    target = torch_target(target, "method 'earlyexit'")
    prompts = calibration_prompts(options.tokenizer, target.vocab_size,
                                  max_length=target.max_context - CONTINUATION - 1)
    result = search_exit(target, prompts, budget_seconds=SEARCH_SECONDS, continuation=CONTINUATION)
    num_layers = target.model.config.num_hidden_layers
    exit_layer = min(result.best.skip, default=num_layers)
    return EarlyExitDrafter(target, exit_layer, num_tokens=result.best.draft_length,
                            draft_cost=result.best.draft_cost, curve=target.cost_curve())
