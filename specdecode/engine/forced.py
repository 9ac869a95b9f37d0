"""The grammar as a drafter: under a constraint, where the grammar allows one continuation for a while (keys,
quotes, braces, the rest of an enum value), its canonical tokens (`Matcher.forced`) lead the step's draft, and
the method's drafter drafts after them. SGLang calls skipping such runs jump-forward decoding; here they are
drafted, so the target still verifies them and the output stays the constrained target's (a forced string may
be tokenized another way, which the masked target may prefer).

How the method's draft joins the forced run depends on what its drafter reads:
- a drafter that drafts from the tokens alone (prompt lookup, suffix, retrieval, a draft model, a composite of
  those) is asked to continue the context *and* the forced run, and its draft hangs after the run;
- a drafter that reads the target's own logits or hidden states (Jacobi, lookahead, the trained heads) has
  none for the forced tokens yet, so it drafts from the context as always: its draft is kept where it already
  begins with the forced run, else the forced run alone is the draft.
Either way what the grammar forbids is cut (`Matcher.legal_draft`), and plain decoding (no drafter) stays
plain: it is the baseline.
"""

from __future__ import annotations

import torch

from specdecode.constraints import Matcher
from specdecode.drafters.base import Drafter, own_verdict
from specdecode.types import Draft, SamplingParams, Verdict


def propose(drafter: Drafter | None, context: list[int], room: int, params: SamplingParams, generator,
            matcher: Matcher | None) -> Draft:
    """The step's draft of at most `room` tokens: the forced run (under a constraint), then the drafter's,
    without what the grammar forbids. None: a plain step (no draft)."""
    if drafter is None or room <= 0:
        return Draft.empty()
    forced = matcher.forced()[:room] if matcher is not None else []
    if not forced:
        draft = drafter.propose(context, room, params, generator)
        return legal(draft, matcher, params)
    reads_target = drafter.needs.logits or bool(drafter.needs.hidden)
    if reads_target:
        draft = legal(drafter.propose(context, room, params, generator), matcher, params)
        if draft.parents is None and draft.tokens[: len(forced)].tolist() == forced:
            return with_forced(draft, len(forced))
        return with_forced(Draft.empty(), 0, forced)
    rest = room - len(forced)
    draft = drafter.propose(context + forced, rest, params, generator) if rest > 0 else Draft.empty()
    assert matcher is not None
    taken = matcher.consume(forced)
    try:
        draft = legal(draft, matcher, params)
    finally:
        matcher.rollback(taken)
    return with_forced(draft, len(forced), forced)


def legal(draft: Draft, matcher: Matcher | None, params: SamplingParams) -> Draft:
    """The draft cut at what the grammar forbids; as it is when unconstrained."""
    if matcher is None:
        return draft
    return matcher.legal_draft(draft, sampled=not params.greedy and draft.probs is not None)


def with_forced(draft: Draft, already: int, forced: list[int] | None = None) -> Draft:
    """`forced` (a chain of one-hot tokens) ahead of `draft`, which continues after them; `Draft.forced` says
    how many leading tokens the grammar forced (`already`: those the draft itself begins with).

    A draft kept because it begins with the forced run (a drafter that reads the target, `propose`) was kept on
    the condition that its first `already` tokens are the run's: given that, those tokens were fixed in
    advance, not drawn from the drafter's distribution, so their rows become one-hot as a prepended run's are
    (speculative sampling with the drafter's own rows there would be biased); the tokens after them were drawn
    given those, from the rows they keep."""
    if not forced:
        if already and draft.probs is not None:
            fixed = draft.probs.clone()
            fixed[:already] = 0.0
            fixed[torch.arange(already, device=fixed.device), draft.tokens[:already].to(fixed.device)] = 1.0
            draft.probs = fixed
        draft.forced = already
        return draft
    head = torch.tensor(forced, dtype=torch.long, device=draft.tokens.device)  # [f]
    f = len(forced)
    tokens = torch.cat([head, draft.tokens.to(head.device)])
    probs = None
    if draft.probs is not None:  # the forced tokens were fixed in advance: one-hot rows
        one_hot = torch.zeros(f, draft.probs.shape[-1], dtype=draft.probs.dtype, device=draft.probs.device)
        one_hot[torch.arange(f), head.to(draft.probs.device)] = 1.0
        probs = torch.cat([one_hot, draft.probs])
    parents = None
    if draft.parents is not None:  # the tree hangs from the run's last token
        inner = draft.parents.cpu()
        parents = torch.cat([torch.arange(-1, f - 1, device="cpu"), torch.where(inner >= 0, inner + f, f - 1)])
    scores = None
    if draft.scores is not None:  # the run is near-certain: the gate keeps it whenever it keeps anything
        scores = torch.cat([torch.ones(f, dtype=draft.scores.dtype, device=draft.scores.device), draft.scores])
    return Draft(tokens=tokens, probs=probs, parents=parents, scores=scores,
                 auxiliary=draft.auxiliary if len(draft) else None,
                 drawn_independently=draft.drawn_independently, forced=f, prepended=f)


def own_part(draft: Draft, verdict: Verdict) -> tuple[Draft, Verdict]:
    """The draft and its verdict as the drafter should learn them: without a forced run the engine put ahead of
    its draft (`Draft.prepended`), the run's acceptance not counted as the drafter's (`drafters.base.own_verdict`),
    a tree's nodes under the run's last token hanging from the context again."""
    p = draft.prepended
    if not p:
        return draft, verdict
    parents = None
    if draft.parents is not None:  # the run is a chain 0 .. p - 1; the drafter's nodes follow it
        inner = draft.parents[p:].cpu()
        parents = torch.where(inner >= p, inner - p, torch.full_like(inner, -1))
    own = Draft(tokens=draft.tokens[p:], probs=None if draft.probs is None else draft.probs[p:], parents=parents,
                scores=None if draft.scores is None else draft.scores[p:], auxiliary=draft.auxiliary,
                drawn_independently=draft.drawn_independently)
    return own, own_verdict(verdict, p)
