"""`auto`: the composite that fits the loaded models, the default method.

No method wins everywhere: copying (prompt lookup, the suffix cache) wins where the answer repeats the
prompt or earlier answers and gives almost nothing elsewhere, where the cheap trained heads (Medusa,
EAGLE-3) are the ones that pay. `auto` asks them all in one composite (`drafters.composite`), cheapest
first, their proposals merged into one token tree sized on the target's cost curve:

1. prompt lookup (with the `--reference` document), 2. the suffix cache of this and earlier requests,
3. retrieval, only from a datastore given (`--datastore`), 4. one trained head of the target (`heads_for`: a
head given with `--head`, else the shipped Medusa heads, else the shipped EAGLE-3 head), on the torch
backend (it reads the target's hidden states), asked only while the copies promise fewer than `HEAD_BELOW`
accepted tokens, 5. where no head drafts, the draft model, where one is loaded, as the expensive fallback asked
only while the others promise less than one accepted token.

The head as a fallback, not asked every step: while a copy runs long, the head's tree adds little the copy does
not already propose (the copy's path is the target's continuation until it ends), and its nodes still widen the
forward and its drafting costs time every step (measured: docs/results/auto.md, "The head as a fallback"). Its
features follow every step whether asked or not (`drafters.composite`), so it drafts at once when the copy ends.

Not the draft model beside a head: the first speculative step after plain ones brings it up to the whole
context (its prefill), which makes the engine's speculative trials dear (`engine.payoff`); after a stretch of
text where nothing paid, the engine then kept whole requests plain, copy-heavy ones included (code edits on
the AVX2 stand-in: docs/results/auto.md, "The draft model beside a head"). A head already guesses open text,
for far less.

Each source is asked only while it pays on the request (`drafters.source_payoff`), and the merged tree keeps only
the nodes that pay on the cost curve, so a step where nothing pays is the target's plain one. The engine's
step-aside switch (`engine.payoff`) is left out (`Drafter.weighs_itself`): it judges speculation from a few
timed steps, and on copied text, where what pays comes in bursts, a trial that met no copy kept whole requests
plain; without it `auto` was as fast or faster in every category (docs/results/auto.md, "Without the step-aside
switch"). Lossless like every part: the
merged tree is verified exactly (greedy match, or speculative sampling over fixed nodes).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.drafters.base import Drafter
from specdecode.drafters.composite import CompositeDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters import heads
from specdecode.drafters.options import DrafterOptions
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.sources import Source
from specdecode.drafters.suffix import SuffixDrafter

if TYPE_CHECKING:
    import torch

    from specdecode.models.base import CausalLM
    from specdecode.models.costs import CostCurve

HEAD_KINDS = ("medusa", "eagle3", "eagle")  # the shipped heads auto may draft with, cheapest first (`heads_for`)
HEAD_BELOW = 2.0  # the head is asked while the copies promise fewer accepted tokens than this (module docstring)


def heads_for(target: CausalLM, head: str | None = None) -> list[tuple[str, Path | None]]:
    """The trained head auto drafts with on this target: [(kind, the folder given, or None: the shipped one)],
    the head given (`--head`), else the first kind of HEAD_KINDS shipped for the target; none off the torch
    backend (no hidden states there).

    One head, not every one there is: a second head's drafts overlap the first's and the copies', while
    its drafting time and the wider tree it adds cost every step, which the per-source ledger
    (`drafters.source_payoff`) does not charge in full (it weighs a source's drafting time, not the
    verification width its nodes take); measured in docs/results/auto.md ("Which sources")."""
    model = getattr(target, "model", None)
    if model is None:
        return []
    if head is not None:
        return [(heads.kind_of(head), Path(str(head)).expanduser())]
    kind = shipped_kind(model)
    return [] if kind is None else [(kind, None)]


def shipped_kind(target) -> str | None:
    """The first kind of HEAD_KINDS shipped for the target (a transformers model, or its name or path before it
    loads: `heads.shipped_head`), the first EAGLE left out: it drafts only when given, EAGLE-3 supersedes it."""
    return next((kind for kind in HEAD_KINDS
                 if kind != "eagle" and heads.ships(target, kind)), None)


def drafts_with_head(target, head: str | Path | None = None, backend: str = "torch") -> bool:
    """Whether `auto` will draft with a trained head on this target, known before the models load (`target`: its
    name or path, or a loaded transformers model): a head given, or one shipped for it, on the torch backend.
    Where it will, a command running `auto` does not load the draft model (`methods.loads_draft_model`)."""
    return backend == "torch" and (head is not None or shipped_kind(target) is not None)


def head_drafter(target: CausalLM, kind: str, folder: Path | None, options: DrafterOptions) -> Drafter:
    """A head's tree drafter, as its own method builds it."""
    from specdecode.drafters.eagle import build_eagle
    from specdecode.drafters.eagle3 import build_eagle3
    from specdecode.drafters.medusa import build_medusa

    build = {"medusa": build_medusa, "eagle3": build_eagle3, "eagle": build_eagle}[kind]
    drafter = build(target, None, dataclasses.replace(options, tree=True, budget=None,
                                                      head=None if folder is None else str(folder)))
    assert drafter is not None  # (a tree it keeps on the device goes beside the merged copies: `drafters.composite`)
    return drafter


def copy_sources(target: CausalLM, options: DrafterOptions, curve: CostCurve | None = None) -> list[Source]:
    """What `auto` asks first, free: prompt lookup (with the `--reference` document), the suffix cache (its trees
    sized on `curve`, default the target's), and retrieval where a datastore is given."""
    sources = [Source(PromptLookupDrafter(reference_ids=options.reference_ids)),
               Source(SuffixDrafter(curve or target.cost_curve(), tree=True))]
    if options.datastore is not None:
        from specdecode.drafters.retrieval import build_retrieval

        sources.append(Source(build_retrieval(target, None, dataclasses.replace(options, tree=False, budget=None))))
    return sources


def auto_sources(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> list[Source]:
    """What `auto` composes for these models, in the order asked (see the module docstring)."""
    sources = copy_sources(target, options)
    guessers = [Source(head_drafter(target, kind, folder, options), "expensive")
                for kind, folder in heads_for(target, options.head)]
    sources += guessers
    if draft is not None and not guessers:  # (one with the target's tokenizer: `api.Models.drafter_for`)
        sources.append(Source(DraftModelDrafter.for_models(draft, target), "expensive"))
    return sources


def compose(sources: list[Source], curve: CostCurve, final_layer: int | None,
            device: torch.device | str | None = None) -> CompositeDrafter:
    """`auto`'s composite of these sources, merged into one tree sized on `curve`; `final_layer`: the target's
    final-norm state's index among its hidden states (for a head that reads it)."""
    # with a head, the one expensive source is the head (no draft model beside it): asked below HEAD_BELOW
    with_head = any(source.drafter.needs.hidden for source in sources)
    drafter = CompositeDrafter(sources, curve, tree=True, final_layer=final_layer,
                               fallback_below=HEAD_BELOW if with_head else 1.0, device=device)
    drafter.name = "auto"
    drafter.weighs_itself = True  # no step-aside switch (module docstring)
    return drafter


def build_auto(target: CausalLM, draft: CausalLM | None, options: DrafterOptions) -> Drafter:
    """The `auto` method: `auto_sources` merged into one tree sized on the target's cost curve."""
    model = getattr(target, "model", None)
    final_layer = None if model is None else model.config.num_hidden_layers  # the final-norm state's index
    return compose(auto_sources(target, draft, options), target.cost_curve(), final_layer, target.device)


def describe(sources: list[Source]) -> str:
    """What an `auto` drafter is made of, in words: "pld, suffix; medusa (fallback)"."""
    free = [s.drafter.name for s in sources if s.cost == "free"]
    expensive = [s.drafter.name for s in sources if s.cost == "expensive"]
    return ", ".join(free) + "".join(f"; {name} (fallback)" for name in expensive)
