"""Self-speculative decoding: the target drafts with a subset of its own decoder layers and verifies with
all of them (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024). *Early exit* -- the first k
layers, then the model's final norm and LM head -- is the case that skips a suffix of the layers.

Glossary (this module):

- *skip set*: the decoder layers a draft forward leaves out; the residual stream passes them unchanged.
  The other layers are *kept*.
- *draft cost*: one draft forward in one-token target forwards. Decoding on a CPU is bound by reading the
  weights, so it is the share of the weights a one-token target forward reads that the draft still reads
  (kept layers, final norm, LM head; `SkippedLayers.relative_cost`).
- *agreement*: the fraction of positions where the draft's argmax is the full model's argmax.

How layers are skipped. `run_layers` calls the model's own submodules in the order its forward calls
them -- token embedding, rotary position embedding, the kept decoder layers, final norm -- with an explicit
position per token and an explicit attention mask; callers apply the LM head. Nothing is forked and
nothing on the model changes. The other way, swapping `model.model.layers` for a ModuleList of the kept
layers inside a context manager, goes wrong in transformers 5.23 in two ways: `Qwen2Model.forward`
sizes its causal mask from the cache length of the first full-attention layer
(`masking_utils.find_first_full_attention_index`), which is not the kept layers' length once layer 0
is skipped and draft tokens sit in the others' caches; and it looks each layer's attention type up by
the layer's place in the list (`config.layer_types[i]`), not by its own index. It would also mutate a
model the engine is using, which another thread, or an exception escaping the context, would see. What
calling the layers depends on -- the submodules `embed_tokens`, `layers`, `norm`, `rotary_emb` and the
decoder layer's keyword arguments -- is common to transformers' Llama family (Llama, Qwen2, Qwen3,
Mistral) and is checked when a drafter is made (`check_layer_skipping`).

KV cache. Draft forwards write into the target's own `DynamicCache`: each kept layer's attention appends
at its own `layer_idx` and attends to that layer's keys and values of the context, which the target
computed in earlier verification forwards -- no second cache, no second prefill. Skipped layers are not
touched. When the draft is done the kept layers are cropped back to the target's cache length
(`SkippedLayers.crop`), so the engine's verification forward finds the cache exactly as it left it.

The layer search (`search_skip`, `search_exit`) scores skip sets on a few calibration prompts by the
predicted speedup of `chain_speedup` from the teacher-forced agreement (`Calibration`) and the draft cost.
For skip sets: a prefix scan over the layers ordered by block influence (ShortGPT's 1 - cos between a
layer's input and output), then Bayesian optimisation over all 2^L skip sets as in Draft & Verify --
optuna's TPE sampler, started from the best prefixes -- within a time budget. For early exit: every
exit layer, deepest first. Results are cached per model under `cache_dir() / "layerskip"`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from specdecode.drafters.base import Drafter, DrafterOptions
from specdecode.drafters.draft_model import DraftModelDrafter, best_draft_length
from specdecode.errors import UserError
from specdecode.models.base import CausalLM, ForwardOutput
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM, module_bytes
from specdecode.paths import cache_dir
from specdecode.types import Draft

SEARCH_SECONDS = 300.0  # the builders' search budget; the result is cached, so it is paid once per model
MAX_TRIALS = 400  # skip sets proposed at most per search (each costs one partial forward over the calibration)
CONTINUATION = 48  # tokens of the full model's greedy continuation per calibration prompt
PATIENCE = 3  # prefix scan: steps without a better speedup before it stops
EXIT_FRACTION = 0.75  # EarlyExitDrafter's default exit layer, as a fraction of the layers (see there)
SEARCH_VERSION = 1  # part of the cache key: bump when the scoring changes


# --- Running a subset of the layers -------------------------------------------------------------------


def check_layer_skipping(model: PreTrainedModel) -> None:
    """Raise a UserError unless `run_layers` can run this model: a Llama-style decoder whose every layer
    attends to the whole context."""
    decoder = getattr(model, "model", None)
    missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(decoder, name)]
    if decoder is None or missing or model.get_output_embeddings() is None:
        raise UserError(
            f"layer skipping needs a Llama-style decoder (embed_tokens, layers, norm, rotary_emb, an LM head); "
            f"{type(model).__name__} has none of: {', '.join(missing) or 'an LM head'}"
        )
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise UserError(f"layer skipping supports full-attention layers only; this model has {sorted(kinds)}")


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, m] bool (True: may attend) -> the [1, 1, n, m] additive mask transformers' attention takes."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def causal_allowed(cached: int, n: int) -> torch.Tensor:
    """[n, cached + n] bool: n new tokens after `cached` ones, each seeing the cache and itself and before."""
    return torch.ones(n, cached + n, dtype=torch.bool).tril(cached)


def run_layers(
    model: PreTrainedModel,
    layers: Iterable[int],  # decoder layers to run, ascending
    token_ids: torch.Tensor,  # [n] int64
    positions: torch.Tensor,  # [n] int64
    allowed: torch.Tensor | None,  # [n, cached + n] bool, new token i may attend to key j; None only for n == 1
    cache: DynamicCache | None,  # each layer reads and appends at its own layer_idx; None: no cache
    trace: list[torch.Tensor] | None = None,  # if given, gets the residual stream entering each layer and the last
) -> torch.Tensor:
    """The model's final-norm hidden states after only `layers`: [n, hidden]. The caller applies the LM
    head, and wraps the call in torch.inference_mode when the cache holds inference tensors."""
    n = token_ids.numel()
    if allowed is None and n > 1:
        raise ValueError("several new tokens need an explicit attention mask")
    decoder = model.model
    hidden = decoder.embed_tokens(token_ids.view(1, n))  # [1, n, hidden]
    position_ids = positions.view(1, n)
    rotary = decoder.rotary_emb(hidden, position_ids)  # (cos, sin), each [1, n, head_dim]
    mask = None if allowed is None else additive_mask(allowed, hidden.dtype)  # [1, 1, n, cached + n]
    for index in layers:
        if trace is not None:
            trace.append(hidden[0])
        hidden = decoder.layers[index](
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
            position_embeddings=rotary,
        )  # [1, n, hidden]
    if trace is not None:
        trace.append(hidden[0])
    return decoder.norm(hidden)[0]  # [n, hidden]


def crop_layers(cache: DynamicCache, layers: Iterable[int], length: int) -> None:
    """Drop the entries past `length` of the given layers of the cache (the others are not touched)."""
    for index in layers:
        layer = cache.layers[index]
        surplus = layer.get_seq_length() - length
        if surplus > 0:
            layer.crop(-surplus)  # transformers takes minus the count to drop


def _kv_cache(target: HFCausalLM) -> DynamicCache:
    # HFCausalLM keeps its cache private; this module is the one other place that shares it. It is read
    # afresh on every use, since the target's reset() replaces it.
    return target._cache


class SkippedLayers(CausalLM):
    """The target with the layers in `skip` left out, over the target's own KV cache: a draft model that
    costs no memory and needs no prefill.

    Its cache is the target's, for the context the target holds, followed by entries of its own for the
    tokens fed to it since (in the kept layers only). `crop` removes those and never the target's, so a
    crop to `target.cache_length` leaves the target's cache exactly as it was.
    """

    def __init__(self, target: HFCausalLM, skip: Iterable[int]):
        check_layer_skipping(target.model)
        num_layers = target.model.config.num_hidden_layers
        self.skip = tuple(sorted(set(int(i) for i in skip)))
        if any(not 0 <= i < num_layers for i in self.skip):
            raise UserError(f"skip layers must be in [0, {num_layers}), got {list(self.skip)}")
        self.kept = tuple(i for i in range(num_layers) if i not in self.skip)
        self.target = target
        self.vocab_size, self.max_context = target.vocab_size, target.max_context
        self.eos_token_ids = target.eos_token_ids
        layers = target.model.model.layers
        self._skipped_bytes = sum(module_bytes(layers[i]) for i in self.skip)
        self._own = 0  # tokens fed to the view since its cache last matched the target's

    @property
    def cache_length(self) -> int:
        return self.target.cache_length + self._own

    @property
    def weight_bytes_per_token(self) -> int:
        return self.target.weight_bytes_per_token - self._skipped_bytes

    @property
    def relative_cost(self) -> float:
        """A one-token forward of the view in one-token forwards of the target, by the weights read."""
        return self.weight_bytes_per_token / self.target.weight_bytes_per_token

    @property
    def cost_key(self) -> str:
        return f"{self.target.cost_key}|skip={','.join(map(str, self.skip))}"

    @torch.inference_mode()  # the cache holds inference tensors
    def forward(
        self,
        token_ids: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        num_logits: int | None = None,
        output_hidden: bool = False,
    ) -> ForwardOutput:
        n = token_ids.numel()
        cached = self.cache_length
        if positions is None:
            positions = torch.arange(cached, cached + n)
        num_logits = n if num_logits is None else num_logits
        if tree_mask is not None:  # [n, m] over the last m tokens -> [n, cached + n]
            m = tree_mask.shape[1]
            if m > cached + n:
                raise ValueError(f"a tree mask over {m} tokens, but the cache and the input hold {cached + n}")
            allowed = torch.ones(n, cached + n, dtype=torch.bool)
            allowed[:, cached + n - m :] = tree_mask
        else:
            allowed = causal_allowed(cached, n) if n > 1 else None
        hidden = run_layers(self.target.model, self.kept, token_ids, positions, allowed, _kv_cache(self.target))
        self._own += n
        hidden = hidden[n - num_logits :]  # [num_logits, hidden]
        logits = self.target.model.get_output_embeddings()(hidden)  # [num_logits, vocab]
        return ForwardOutput(logits=logits.float(), hidden=hidden if output_hidden else None)

    def crop(self, length: int) -> None:
        start = self.target.cache_length
        if not start <= length <= self.cache_length:
            raise ValueError(f"the view can crop its own entries only: to [{start}, {self.cache_length}], not {length}")
        crop_layers(_kv_cache(self.target), self.kept, length)
        self._own = length - start

    def reset(self) -> None:
        """Drop the view's own entries; the sequence itself is the target's to reset."""
        self.crop(self.target.cache_length)


# --- Drafters ---------------------------------------------------------------------------------------------


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
        curve: CostCurve | None = None,  # the target's; None: verification width nearly free
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
            draft_cost=view.relative_cost if draft_cost is None else draft_cost, curve=curve,
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


# --- Scoring skip sets ------------------------------------------------------------------------------------


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
    agreement: float  # teacher-forced (see Calibration)
    draft_cost: float  # one draft forward in one-token target forwards
    speedup: float  # predicted by chain_speedup
    draft_length: int  # the chain length that speedup assumes


@dataclass(frozen=True)
class SearchResult:
    best: SkipChoice
    evaluated: int  # distinct skip sets scored, one partial forward each
    seconds: float  # the search's own time (of the run that made it, when read from the cache)
    from_cache: bool = False


def block_influence(residual: list[torch.Tensor]) -> list[float]:
    """ShortGPT's block influence of each layer, 1 - the mean cosine similarity between the residual stream
    entering and leaving it: residual[i] enters layer i ([n, hidden] each, the last one leaves the last
    layer). Low influence: a layer that changes little, a good one to skip."""
    return [
        float(1 - torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean())
        for a, b in zip(residual[:-1], residual[1:])
    ]


class Calibration:
    """The target's greedy continuations of a few prompts and its keys and values over them, on which skip
    sets are scored.

    `agreement(skip)` is teacher-forced, in one forward of the kept layers: the token before each
    continuation token is fed with the full model's keys and values for everything before it, exactly the
    first draft token's situation in self-speculative decoding (a later draft token also sees the draft's
    own entries for the earlier drafts, which this ignores), and its argmax is compared with the full
    model's greedy token. All sequences share one cache, kept apart by the attention mask.
    """

    def __init__(self, target: HFCausalLM, prompts: Sequence[Sequence[int]], continuation: int = CONTINUATION):
        from specdecode.engine import GenerationConfig, SpeculativeEngine  # the engine imports the drafters

        if not prompts or not all(prompts):
            raise UserError("calibration needs at least one non-empty prompt")
        model = target.model
        check_layer_skipping(model)
        self.model = model
        self.num_layers = model.config.num_hidden_layers
        plain = SpeculativeEngine(HFCausalLM(model, target.eos_token_ids))  # its own cache, not the target's
        tokens: list[int] = []
        positions: list[int] = []
        segments: list[int] = []
        queries: list[int] = []  # packed index of the token before each continuation token
        expected: list[int] = []
        for segment, prompt in enumerate(prompts):
            generated = plain.generate(list(prompt), GenerationConfig(max_new_tokens=continuation)).token_ids
            sequence = [*prompt, *generated]
            queries += range(len(tokens) + len(prompt) - 1, len(tokens) + len(sequence) - 1)
            expected += generated
            tokens += sequence
            positions += range(len(sequence))
            segments += [segment] * len(sequence)
        self.length = len(tokens)
        token_ids, position_ids = torch.tensor(tokens), torch.tensor(positions)
        segment_ids, index = torch.tensor(segments), torch.arange(len(tokens))
        same = segment_ids[:, None] == segment_ids[None, :]  # [length, length]
        # 1. The full model over every sequence (block-diagonal causal) fills the cache.
        self.cache = DynamicCache(config=model.config)
        residual: list[torch.Tensor] = []
        with torch.inference_mode():
            run_layers(model, range(self.num_layers), token_ids, position_ids,
                       same & (index[:, None] >= index[None, :]), self.cache, trace=residual)
        self.influence = block_influence(residual)  # [num_layers]
        # 2. The queries: query q sees the full model's entries of its own sequence before it, and itself.
        query = torch.tensor(queries)
        self.query_tokens, self.query_positions = token_ids[query], position_ids[query]  # [queries]
        earlier = same[query] & (position_ids[None, :] < position_ids[query][:, None])  # [queries, length]
        self.query_allowed = torch.cat([earlier, torch.eye(len(queries), dtype=torch.bool)], dim=1)
        self.expected = torch.tensor(expected)  # [queries]

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

    def __init__(self, target: HFCausalLM, calibration: Calibration, curve: CostCurve, max_tokens: int):
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


# --- The searches ----------------------------------------------------------------------------------------

Strategy = Callable[[Scorer, Callable[[], bool], int, int], None]  # (score, out of time, max trials, seed)


def _skip_strategy(score: Scorer, stop: Callable[[], bool], max_trials: int, seed: int) -> None:
    """Prefix scan over the layers by block influence, then TPE over all skip sets from the best found."""
    import optuna

    num_layers = score.calibration.num_layers
    # 1. Skip the r least influential layers, r = 1, 2, ..., while the speedup improved in the last PATIENCE.
    order = sorted(range(num_layers), key=lambda i: score.calibration.influence[i])
    best_r, best_speedup = 0, float("-inf")
    for r in range(1, num_layers):
        if r - best_r > PATIENCE or stop() or score.calls >= max_trials:
            break
        speedup = score(order[:r]).speedup
        if speedup > best_speedup:
            best_r, best_speedup = r, speedup
    # 2. Bayesian optimisation over the skip masks (one yes/no per layer), as Draft & Verify does.
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # multivariate TPE
            sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True)
            study = optuna.create_study(direction="maximize", sampler=sampler)
            for choice in sorted(score.scores.values(), key=lambda c: -c.speedup)[:3]:
                study.enqueue_trial({f"skip{i}": i in choice.skip for i in range(num_layers)})
            while score.calls < max_trials and len(score.scores) < 2**num_layers and not stop():
                trial = study.ask()
                skip = [i for i in range(num_layers) if trial.suggest_categorical(f"skip{i}", (False, True))]
                study.tell(trial, score(skip).speedup)
    finally:
        optuna.logging.set_verbosity(verbosity)


def _exit_strategy(score: Scorer, stop: Callable[[], bool], max_trials: int, seed: int) -> None:
    """Every exit layer, deepest first (the likeliest to agree)."""
    num_layers = score.calibration.num_layers
    for exit_layer in range(num_layers - 1, 0, -1):
        if stop() or score.calls >= max_trials:
            break
        score(range(exit_layer, num_layers))


def weights_fingerprint(model: PreTrainedModel) -> str:
    """A digest of the first few values of every weight tensor: tells models with the same config apart."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            digest.update(name.encode())
            digest.update(parameter.detach().flatten()[:16].float().numpy().tobytes())
    return digest.hexdigest()[:16]


def cache_path(kind: str, target: HFCausalLM, prompts: Sequence[Sequence[int]], continuation: int,
               max_tokens: int, folder: Path | None = None) -> tuple[Path, dict]:
    """Where a search's result is cached, and what names it: the model (config, dtype, weights), the
    calibration and the search's kind. Not the cost curve, which is re-measured now and then and moves
    the scores little: the file records the curve it was found with."""
    identity = {
        "kind": kind,
        "version": SEARCH_VERSION,
        "model": target.cost_key,
        "weights": weights_fingerprint(target.model),
        "prompts": hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest()[:16],
        "continuation": continuation,
        "max_tokens": max_tokens,
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return (folder if folder is not None else cache_dir() / "layerskip") / f"{key}.json", identity


def _search(kind: str, strategy: Strategy, target: CausalLM, prompts: Sequence[Sequence[int]], *,
            budget_seconds: float, max_trials: int, continuation: int, curve: CostCurve | None, max_tokens: int,
            seed: int, folder: Path | None, use_cache: bool, progress: bool) -> SearchResult:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if not isinstance(target, HFCausalLM):
        raise UserError("the layer search runs the target's layers itself: it needs the torch backend")
    if budget_seconds <= 0 or max_trials < 1:
        raise UserError(f"the search needs a positive budget and trial count, got {budget_seconds} s, {max_trials}")
    curve = curve or target.cost_curve()
    path, identity = cache_path(kind, target, prompts, continuation, max_tokens, folder)
    if use_cache and path.exists():
        data = json.loads(path.read_text())
        best = SkipChoice(**{**data["best"], "skip": tuple(data["best"]["skip"])})
        return SearchResult(best, data["evaluated"], data["seconds"], from_cache=True)
    start = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task(f"{kind} search: calibrating", total=budget_seconds)
        calibration = Calibration(target, prompts, continuation)
        score = Scorer(target, calibration, curve, max_tokens)

        def stop() -> bool:
            elapsed = time.perf_counter() - start
            if score.scores:
                best = score.best
                bar.update(task, description=f"{kind} search: {len(score.scores)} sets, best {best.speedup:.2f}x "
                                             f"(skip {len(best.skip)} of {calibration.num_layers} layers)")
            bar.update(task, completed=min(elapsed, budget_seconds))
            return elapsed >= budget_seconds

        score(())  # the baseline: the full model as its own draft
        strategy(score, stop, max_trials, seed)
    result = SearchResult(score.best, len(score.scores), time.perf_counter() - start)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    record = {"identity": identity, "best": asdict(result.best), "evaluated": result.evaluated,
              "seconds": result.seconds, "curve": [list(curve.sizes), list(curve.relative)],
              "influence": calibration.influence}
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return result


def search_skip(target: CausalLM, prompts: Sequence[Sequence[int]], *, budget_seconds: float = SEARCH_SECONDS,
                max_trials: int = MAX_TRIALS, continuation: int = CONTINUATION, curve: CostCurve | None = None,
                max_tokens: int = 16, seed: int = 0, folder: Path | None = None, use_cache: bool = True,
                progress: bool = True) -> SearchResult:
    """The skip set with the highest predicted speedup found within `budget_seconds` (calibration included;
    the last trial may run over) and `max_trials` proposals. Cached per model and calibration in `folder`
    (default `cache_dir() / "layerskip"`); use_cache=False searches afresh and replaces the cached result.
    `curve`: the target's cost curve (default: measured once per machine, cached)."""
    return _search("skip", _skip_strategy, target, prompts, budget_seconds=budget_seconds, max_trials=max_trials,
                   continuation=continuation, curve=curve, max_tokens=max_tokens, seed=seed, folder=folder,
                   use_cache=use_cache, progress=progress)


def search_exit(target: CausalLM, prompts: Sequence[Sequence[int]], *, budget_seconds: float = SEARCH_SECONDS,
                max_trials: int = MAX_TRIALS, continuation: int = CONTINUATION, curve: CostCurve | None = None,
                max_tokens: int = 16, folder: Path | None = None, use_cache: bool = True,
                progress: bool = True) -> SearchResult:
    """The early exit with the highest predicted speedup (as search_skip; its skip set is a suffix of the
    layers, or empty when no exit beats the full model as its own draft)."""
    return _search("exit", _exit_strategy, target, prompts, budget_seconds=budget_seconds, max_trials=max_trials,
                   continuation=continuation, curve=curve, max_tokens=max_tokens, seed=0, folder=folder,
                   use_cache=use_cache, progress=progress)


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
        return [torch.randint(vocab_size, (length,), generator=generator).tolist() for _ in range(count)]
    prompts = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in CALIBRATION_TEXTS]
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": CALIBRATION_REQUEST}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return [p[-max_length:] for p in prompts] if max_length else prompts  # a small model's context holds them


def _torch_target(target: CausalLM, method: str) -> HFCausalLM:
    if not isinstance(target, HFCausalLM):
        raise UserError(f"method {method!r} runs the target's own layers, which needs the torch backend "
                        f"(this target is {type(target).__name__}); use --backend torch")
    return target


def build_layerskip(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> Drafter:
    """`layerskip`: the target drafts with the layers the search (`search_skip`, cached) leaves in."""
    target = _torch_target(target, "layerskip")
    prompts = calibration_prompts(options.tokenizer, target.vocab_size, max_length=target.max_context - CONTINUATION - 1)
    result = search_skip(target, prompts,
                         budget_seconds=SEARCH_SECONDS, continuation=CONTINUATION)
    return LayerSkipDrafter(target, result.best.skip, num_tokens=result.best.draft_length,
                            draft_cost=result.best.draft_cost, curve=target.cost_curve())


def build_earlyexit(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> Drafter:
    """`earlyexit`: the target drafts with its first k layers, k from the search (`search_exit`, cached)."""
    target = _torch_target(target, "earlyexit")
    prompts = calibration_prompts(options.tokenizer, target.vocab_size, max_length=target.max_context - CONTINUATION - 1)
    result = search_exit(target, prompts,
                         budget_seconds=SEARCH_SECONDS, continuation=CONTINUATION)
    num_layers = target.model.config.num_hidden_layers
    exit_layer = min(result.best.skip, default=num_layers)
    return EarlyExitDrafter(target, exit_layer, num_tokens=result.best.draft_length,
                            draft_cost=result.best.draft_cost, curve=target.cost_curve())
