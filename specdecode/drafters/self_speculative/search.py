"""The layer search (`search_skip`, `search_exit`) scores skip sets on a few calibration prompts by the
predicted speedup of `chain_speedup` from the teacher-forced agreement (`CalibrationSet`) and the draft cost.
For skip sets: a prefix scan over the layers ordered by block influence (ShortGPT's 1 - cos between a
layer's input and output), then Bayesian optimisation over all 2^L skip sets as in Draft & Verify --
optuna's TPE sampler, started from the best prefixes -- within a time budget. For early exit: every
exit layer, deepest first. Results are cached per model under `cache_dir() / "layerskip"` (written
atomically; a file that cannot be read is moved aside with a warning and the search run again).
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specdecode.drafters.self_speculative.scoring import CONTINUATION, CalibrationSet, Scorer, SearchResult, SkipChoice
from specdecode.errors import UserError
from specdecode.models.base import CausalLM
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.paths import cache_dir, read_json_cache, write_atomically

SEARCH_SECONDS = 300.0  # the builders' search budget; the result is cached, so it is paid once per model
MAX_TRIALS = 400  # skip sets proposed at most per search (each costs one partial forward over the calibration)
PATIENCE = 3  # prefix scan: steps without a better speedup before it stops
# sets scored: a search its budget stopped before this many (a busy machine's few trials) is searched again at the
# next start, its best kept, up to SEARCHES searches in all; its first result was cached for good (on a loaded
# machine, the default target's skip set of a dozen trials, barely faster than plain decoding)
SETTLED, SEARCHES = 100, 3
SEARCH_VERSION = 1  # part of the cache key: bump when the scoring changes

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
            digest.update(parameter.detach().flatten()[:16].float().cpu().numpy().tobytes())
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
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    from specdecode.progress import Progress

    if not isinstance(target, HFCausalLM):
        raise UserError("the layer search runs the target's layers itself: it needs the torch backend")
    if budget_seconds <= 0 or max_trials < 1:
        raise UserError(f"the search needs a positive budget and trial count, got {budget_seconds} s, {max_trials}")
    curve = curve or target.cost_curve()
    path, identity = cache_path(kind, target, prompts, continuation, max_tokens, folder)
    cached = _cached(path) if use_cache else None
    if cached is not None and cached.settled:
        return cached
    start = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task(f"{kind} search: calibrating", total=budget_seconds)
        calibration = CalibrationSet(target, prompts, continuation)
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
    seconds = time.perf_counter() - start
    # a search its budget stopped early, again: the better of the two, and what both scored
    earlier = cached or SearchResult(score.best, 0, 0.0, searches=0)
    best = earlier.best if earlier.best.speedup > score.best.speedup else score.best
    evaluated, searches = earlier.evaluated + len(score.scores), earlier.searches + 1
    settled = seconds < budget_seconds or evaluated >= SETTLED or searches >= SEARCHES
    result = SearchResult(best, evaluated, earlier.seconds + seconds, searches=searches, settled=settled)
    record = {"identity": identity, "best": asdict(result.best), "evaluated": result.evaluated,
              "seconds": result.seconds, "searches": result.searches, "settled": settled,
              "curve": [list(curve.sizes), list(curve.relative)], "influence": calibration.influence}
    write_atomically(path, json.dumps(record, indent=1))
    return result


def _cached(path: Path) -> SearchResult | None:
    """The search result cached in `path`, or None: not searched yet, or a file that cannot be read as one,
    which is moved aside with a warning (`paths.read_json_cache`) so the search runs again."""
    return read_json_cache(path, "layer search", "searching again", _result)


def _result(data) -> SearchResult:
    """The search result a cache file's JSON holds (a KeyError or TypeError where it holds none)."""
    best = SkipChoice(**{**data["best"], "skip": tuple(int(layer) for layer in data["best"]["skip"])})
    return SearchResult(best, int(data["evaluated"]), float(data["seconds"]), from_cache=True,
                        searches=int(data.get("searches", 1)), settled=bool(data.get("settled", True)))


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
