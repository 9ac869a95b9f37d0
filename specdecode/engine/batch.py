"""Speculative decoding of several sequences at once: one target forward per step for all of them, each sequence
accepting its own number of draft tokens.

Layout (ragged, no padding): every sequence's keys and values live side by side in the target's one KV cache, each
sequence owning a list of cache slots. A step's forward carries, sequence after sequence, the context tokens each has
not fed yet (a newcomer's whole prompt, then one token per step) and its draft. A full attention mask over cache and
input lets every token see only its own sequence's slots and, within the step, its own causal (chain) or ancestor (tree)
predecessors; position ids count per sequence. After verification a sequence keeps the slots of its context and accepted
tokens; the rest (rejected drafts, finished sequences) is garbage, squeezed out once it is a quarter of the cache.

Why one ragged row rather than a padded batch: a forward costs what its tokens cost (the measured cost curve prices it,
padding would waste it) and it runs through the model interface trees already use. The price is that attention spans
every sequence's slots, masked: small on a CPU, where decoding is bound by reading the weights.

The gate spreads speculation across the batch (`tree.budget.cut_batch`): every scored draft token of every sequence
competes for the forward on the cost curve, so as the batch grows speculation shrinks, and it switches itself off where
the curve says a wider forward no longer pays. Prompt tokens fed in the same step are the prompts' cost, not the drafts'
(`cut_batch`'s `feeding`).

Prompts: a step carries at most one chunk of prompt tokens in all (`costs.prefill_chunk`, then what takes as long at the
pace of the last chunk: `PrefillShare`), so that no prompt holds the batch for longer than a chunk. Prompts that fit in
a chunk are fed whole, oldest first, while they fit together; a longer prompt is fed a chunk a step, drafting and
verifying nothing until its rest fits in a chunk, and takes turns with the other sequences (`PrefillShare`; or goes
into every step, `chunk_policy="every"`): a sequence that comes in while a long prompt is fed waits for the chunk under
way, not for the prompt. Several long prompts take turns too, the one that has fed the fewest chunks first.

Shared prefixes: a sequence about to feed its prompt takes, instead of feeding them, the cache slots of the longest
prefix of it (all but its last token) that another sequence of the same tenant holds (`add`'s `tenant`), live or
ended (`keep_ended`; once squeezed out of the cache, a copy of its entries: `keep_bytes`, `slots.SavedContexts`): a
chat template's system prompt, a conversation's earlier turns. Sequences that come together with prompts that begin
alike feed that beginning once: a later one waits for the earlier to hold it (`slots.waiting`). Their keys and
values are what its own prefill would compute (a token's depend only on the tokens before it: the same bits on the int8
and int4 paths, a wider forward's rounding on the float ones); a slot is garbage once no sequence holds it. Tenants
never share: a prefix found shows in the time to the first token. Off where the caller keeps every fed token's hidden
states.

Drafters here must not run a model of their own or the target (`Drafter.batchable`: the copies, retrieval, Jacobi's
guesses from the target's logits, a head that reads the target's features, a composite of those); each sequence gets its
own drafter (`Drafter.for_sequence`), told how its draft fared with its rows of the forward's logits and hidden states
(the forward asks for what any of them reads, `HiddenRequest`), and ended as the sequence leaves (`Drafter.end`: what it
remembers goes to its owner's memory). A head's sequences draft in one call (`drafters.medusa.BatchedHeads`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from specdecode import devices
from specdecode.drafters.base import Drafter
from specdecode.drafters.sources import HiddenRequest, final_layer
from specdecode.engine.prompts import check_prompt
from specdecode.engine.sequence import (
    GenerationConfig, GenerationResult, SequenceState, StepEvent, VerifiedStep, after_prefill, conclude,
)
from specdecode.engine.pacing import Pace, PrefillShare
from specdecode.engine.slots import (Held, SavedContexts, Slots, attention_inputs, doubled, forward_inputs,
                                     longest_prefix, waiting)
from specdecode.errors import UserError
from specdecode.models import holding
from specdecode.models.base import CausalLM, Entries
from specdecode.models.costs import CHUNK_SECONDS, CostCurve, prefill_chunk
from specdecode.models.live_curve import LiveCurve
from specdecode.tree.budget import cut_batch
from specdecode.types import Draft
from specdecode.verify.tree import verify

GARBAGE_SHARE = 0.25  # compact the cache once this share of it belongs to no sequence


@dataclass
class Member:
    """A sequence in the batch."""

    progress: SequenceState
    drafter: Drafter | None
    method: str
    verifier: Callable  # the method's (exact verification unless the method is lossy)
    slots: Slots  # the cache slots of context[:len(slots)], in order
    chunks: int = 0  # chunks of its prompt fed before its first step
    # those chunks' hidden states [chunk, d], where its drafter reads them (`after_prefill`)
    pieces: list[torch.Tensor] = field(default_factory=list)
    tenant: Hashable = None  # who it may share a prompt's prefix with (module docstring, *Shared prefixes*)
    share: bool = True  # False: it takes no prefix, lends none, leaves none


class BatchEngine:
    """Steps every sequence added to it together; `step()` returns each one's event (and its result once
    it ends)."""

    def __init__(self, target: CausalLM, tokenizer=None, gate: bool = True,
                 keep_hidden: bool | tuple[int, ...] = False, clock: Callable[[], float] | None = None,
                 chunk_seconds: float = CHUNK_SECONDS, share_prefixes: bool = True, keep_ended: int = 0,
                 keep_bytes: int = 0, chunk_policy: str = "turns"):
        """`keep_hidden`: the hidden states (`CausalLM.forward`'s `output_hidden`) of every context token a sequence
        feeds are kept, bfloat16, in `hidden[id]` (one piece a step, in order; the caller pops them). The target's
        forwards (for its cost curve) and whole steps (for the turns of long prompts, `PrefillShare`) are timed without
        waiting for the device, as `SpeculativeEngine` times them (`devices.stopwatch`; `clock`: a fixed clock
        instead, read at once). `chunk_seconds`, `chunk_policy`: what a step's prompt tokens take at most, and when a
        long prompt's chunk goes into a step (`PrefillShare`).
        `share_prefixes`: a sequence takes the slots of a prefix of its prompt another holds (module docstring);
        `keep_ended`: so many ended sequences' contexts stay in the cache for that too, until it is squeezed or a
        sequence that comes to an empty batch has no use for them: only where nothing else touches the target's cache
        (the server's batch, on a cache of its own); `keep_bytes`: then, copied out of the cache, up to so many bytes
        of each tenant's (`slots.SavedContexts`)."""
        if not target.several_sequences:
            raise UserError(f"{type(target).__name__} holds one sequence at a time; batching needs the torch backend")
        self.target, self.tokenizer, self.gate, self.keep_hidden = target, tokenizer, gate, keep_hidden
        self.stopwatch = devices.stopwatch(target.device, clock)  # (a test may assign one)
        self.members: dict[int, Member] = {}
        self.share_prefixes = share_prefixes and not keep_hidden  # (a borrowed token's hidden states are not fed)
        self._doubled = 0  # slots held by more than one sequence, counted once for each holder beyond the first
        self.keep_ended = keep_ended if self.share_prefixes else 0
        self._ended: list[Held] = []  # the last `keep_ended` ended sequences' contexts, their slots garbage
        self.saved = SavedContexts(keep_bytes if self.keep_ended else 0)  # theirs once their slots leave the cache
        self.hidden: dict[int, list[torch.Tensor]] = {}
        self._ids = itertools.count()
        self._share = PrefillShare(chunk_seconds, chunk_policy)
        self.pace = Pace()  # how fast the batch outputs tokens, what its sequences' drafting is priced at
        # the sequences the last step ended on a failure of their own (a UserError: a constraint the grammar engine
        # cannot follow; or a fault in its drafting or verification), each with it: the others step on
        self.failures: list[tuple[int, Exception]] = []
        self.cache = holding.Holder(target, "this model is decoding another sequence (an engine made from the same "
                                    "models): build the batch on `target.sibling()`, a cache of its own, beside them")

    @functools.cached_property
    def curve(self) -> CostCurve | LiveCurve:
        """The target's verification cost curve, as `SpeculativeEngine.curve`."""
        return self.target.cost_curve()

    @functools.cached_property
    def prefill_chunk(self) -> int:
        """Prompt tokens a step feeds at most (`costs.prefill_chunk`; a test may assign it)."""
        return prefill_chunk(self.target.cost_curve(), self._share.seconds)

    def __len__(self) -> int:
        return len(self.members)

    def add(self, prompt_ids: list[int], config: GenerationConfig, drafter: Drafter | None = None,
            method: str | None = None, verifier: Callable = verify, tenant: Hashable = None, share: bool = True
            ) -> int:
        """A new sequence; it joins at the next step. Returns its id. `verifier`: the method's
        (`Method.verifier`), exact verification by default. `tenant`: sequences of the same one (None is one too)
        share their prompts' prefixes (module docstring, *Shared prefixes*); `share` False: this one shares
        nothing, feeding its whole prompt and leaving nothing for later ones."""
        prompt_ids = check_prompt(self.target, prompt_ids)
        if config.echo:
            raise UserError("the batch engine does not score prompts (echo): run it alone (SpeculativeEngine)")
        if drafter is not None and not drafter.batchable:
            raise UserError(f"the {drafter.name} drafter cannot join a batch (it runs a model, or remembers earlier "
                            "sequences); run it alone")
        with self.cache.taken(kept=lambda: self.members or self._ended):  # (to its last sequence: `models.holding`)
            if not self.members and not self._ended:
                self.target.reset()
            if self.gate:
                _ = self.curve  # measured (once per model and machine) while the cache is empty
            state = SequenceState(prompt_ids, config, self.tokenizer, self.target)
            if drafter is not None:
                drafter.begin(list(prompt_ids))
        ident = next(self._ids)
        self.members[ident] = Member(state, drafter, method or (drafter.name if drafter else "ar"), verifier, Slots(),
                                     tenant=tenant, share=share)
        return ident

    def remove(self, ident: int) -> None:
        """Drop a sequence (its client went away); its slots become garbage."""
        self._end(ident)
        if not self.members:  # (and nothing kept: the request may have failed in a forward)
            self.target.reset()
            self._ended.clear()
            self.cache.let_go()

    def step(self) -> list[tuple[int, StepEvent, GenerationResult | None]]:
        """One forward for the sequences in the batch: (id, event, result if it ended) for each that stepped.
        A sequence that ends also yields its held-back text as a last event. A sequence whose prompt is fed
        only in part (module docstring: *Prompts*), or waits, yields nothing."""
        self.failures = []
        if not self.members:
            return []
        self.stopwatch.settle()  # the timings of earlier steps the device has done with
        began = self.stopwatch.mark()
        # 0. What the forward carries: every sequence past its prompt, and prompt tokens within one chunk in all.
        plan = self._plan()
        idents = [i for i, m in self.members.items() if i in plan or len(m.slots) >= len(m.progress.prompt_ids)]
        members = [self.members[i] for i in idents]
        pending = [m.progress.context[len(m.slots) : len(m.slots) + plan.get(i, len(m.progress.context))]
                   for i, m in zip(idents, members)]
        # a sequence steps (drafts, verifies, appends) once the forward feeds all of its context
        stepping = [len(m.slots) + len(p) == len(m.progress.context) for m, p in zip(members, pending)]
        chunked = any(i in plan and not steps for i, steps in zip(idents, stepping))  # a long prompt's chunk
        # 1. Draft, each sequence on its own (a head's sequences in one call: `drafters.medusa.BatchedHeads`);
        #    then the gate shares the forward out: trees too where it carries several sequences (a sequence alone
        #    steps as the single-sequence engine does, its tree sized on the curve by its drafter), over its cache.
        cached = self.target.cache_length
        if self.gate:
            self.curve.at(cached)
        drafts, draft_seconds = self._draft(idents, members, stepping)
        timed = self.gate and not plan  # a prompt's prefill (cold, all attention) is not timed
        if self.gate:
            # the sequences that step share out the forward; prompt tokens fed beside them, each one's last context
            # token aside, are the prompts' cost, not speculation's (`cut_batch`'s `feeding`); where the forward is
            # timed, a width the gate stopped letting through is timed again now and then (`LiveCurve.probe`)
            context, ready = sum(len(p) for p in pending), [k for k, s in enumerate(stepping) if s]
            probe = getattr(self.curve, "probe", None) if timed else None
            cut = iter(cut_batch([drafts[k] for k in ready], self.curve, context, shared=len(members) > 1,
                                 feeding=context - len(ready), probe=probe))
            drafts = [next(cut) if steps else draft for draft, steps in zip(drafts, stepping)]
        # 2. One forward over every sequence's pending tokens and draft.
        forward_start, host_start = self.stopwatch.mark() if timed else None, self.stopwatch.now()
        fed, positions, spans, rows = forward_inputs([m.slots for m in members], pending, drafts, stepping)
        total = sum(len(f) for f in fed)
        # A sequence alone in the forward and in the cache (a lone request, or the last one left) steps as the
        # single-sequence engine does: the cache is its context, so no mask over it, and a chain is plain causal
        # attention; its rejected drafts are cropped away rather than left as garbage.
        alone = len(members) == 1 and len(members[0].slots) == cached
        tree_mask, where = attention_inputs([m.slots for m in members], spans, positions, drafts, cached, alone)
        asked = HiddenRequest(self.keep_hidden, [m.drafter.needs.hidden if m.drafter else False for m in members],
                              final_layer(self.target))
        # (a forward of chunks alone asks one row of logits, unused: every backend computes at least one)
        output = self.target.forward(torch.cat(fed), positions=where, tree_mask=tree_mask,
                                     rows=torch.cat(rows) if rows else torch.tensor([total - 1], device="cpu"),
                                     output_hidden=asked.request)
        if forward_start is not None:  # (its seconds come once the device has done it)
            observe = functools.partial(self.curve.observe, total, context=cached)
            self.stopwatch.measure(forward_start, self.stopwatch.mark(), observe)
        # 3. Verify each sequence on its rows; keep the slots of its context and accepted tokens.
        out: list[tuple[int, StepEvent, GenerationResult | None]] = []
        row = 0
        for k, (ident, m, p, draft, (offset, n, _), spent, steps) in enumerate(
                zip(idents, members, pending, drafts, spans, draft_seconds, stepping)):
            first = cached + offset
            if self.keep_hidden and output.hidden is not None:  # the context tokens' rows (not a draft's)
                kept = asked.columns(output.hidden[offset : offset + len(p)], 0)
                assert kept is not None  # (asked for)
                self.hidden.setdefault(ident, []).append(kept.to(torch.bfloat16))
            hidden = None if output.hidden is None else asked.columns(output.hidden[offset : offset + n], k + 1)
            if not steps:  # a chunk of its prompt
                m.slots.extend(range(first, first + len(p)))
                m.chunks += 1
                if hidden is not None:  # for its drafter's first step (`after_prefill`)
                    m.pieces.append(hidden)
                continue
            logits = output.logits[row : row + len(draft) + 1]  # [len(draft) + 1, vocab]
            row += len(draft) + 1
            if all(ident != failed for failed, _ in self.failures):  # (not where its drafting failed)
                # (the host's seconds since the forward began: its verification read waited for the forward)
                out += self._verify(ident, m, draft, logits, (len(p), spent, self.stopwatch.now() - host_start),
                                    hidden, first, alone)
        self._collect(gone=[ident for ident, _ in self.failures])
        tokens = sum(len(event.token_ids) for _, event, _ in out)
        self.stopwatch.measure(began, self.stopwatch.mark(), self.pace.took(tokens, self._share.took(chunked, total)))
        return out

    def _draft(self, idents: list[int], members: list[Member], stepping: list[bool]) -> tuple[list[Draft], list[float]]:
        """Each sequence's draft (none while it feeds its prompt) and its drafting seconds; where the forward carries
        several sequences, each drafter is told the batch's pace first (`Pace`: all of them wait for its drafting). A
        sequence whose drafting fails (a UserError of its own, or a fault) drafts nothing and joins `failures`."""
        pace = self.pace.per_token if len(members) > 1 else None
        drafts, seconds = [], []
        for ident, m, steps in zip(idents, members, stepping):
            start = self.stopwatch.now()
            if m.drafter is not None:
                m.drafter.batch_pace(pace)
            room = m.progress.room() - 1  # the step adds a token beyond its accepted drafts
            try:
                drafts.append(m.progress.propose(m.drafter if steps else None, room))  # (`engine.forced`)
            except Exception as error:  # (one request's failure is not its batch's)
                drafts.append(Draft.empty())
                self.failures.append((ident, error))
            seconds.append(self.stopwatch.now() - start)
        return drafts, seconds

    def _verify(self, ident: int, m: Member, draft: Draft, logits: torch.Tensor, spans: tuple[int, float, float],
                hidden: torch.Tensor | None, first: int, alone: bool
                ) -> list[tuple[int, StepEvent, GenerationResult | None]]:
        """A sequence's draft verified on its rows of the forward and concluded (`_conclude`); `spans`: context tokens
        fed before the draft, drafting and verification seconds. A failure of its own (a UserError: a constraint the
        grammar engine cannot follow; or a fault) ends it alone, in `failures`, the other sequences going on."""
        try:
            step = VerifiedStep(draft, m.progress.verify(m.verifier, draft, logits), logits, *spans, hidden)
            return self._conclude(ident, m, step, first, alone)
        except Exception as error:
            self.failures.append((ident, error))
            return []

    def _conclude(self, ident: int, m: Member, step: VerifiedStep, first: int, alone: bool
                  ) -> list[tuple[int, StepEvent, GenerationResult | None]]:
        """A sequence's verified step (its forward's rows from cache slot `first` on): the slots of its context and
        accepted tokens kept, its tokens appended, its drafter told how its draft fared; and its end, if it ends."""
        fed, path = step.num_pending, step.verdict.path
        if alone:  # the cache keeps its context and accepted drafts, as `SpeculativeEngine.step` keeps them
            self.target.compact(first + fed, path)  # (its slots were the cache's first ones, 0 .. first - 1)
            m.slots.extend(range(first, self.target.cache_length))
        else:
            m.slots.extend([*range(first, first + fed), *(first + fed + node for node in path)])
        if m.chunks and len(m.progress.steps) == 0:  # its first step, after its prompt's chunks
            step = after_prefill(step, len(m.slots) - fed - len(path) - m.progress.cached, m.pieces)
            m.pieces = []
        # 4. The sequence's tokens appended; its drafter learns how its draft fared.
        out: list[tuple[int, StepEvent, GenerationResult | None]] = [(ident, conclude(m.progress, m.drafter, step),
                                                                      None)]
        if m.progress.room() == 0:
            if (tail := m.progress.tail()) is not None:
                out.append((ident, tail, None))
            out[-1] = (ident, out[-1][1], m.progress.result(m.method))
            self._end(ident, ended=True)
        return out

    def _end(self, ident: int, ended: bool = False) -> None:
        """A sequence leaves: its drafter ends (leaving its owner's memory what it remembers); one that `ended` (not
        removed) leaves its context for later sequences to take a prefix of (`keep_ended`)."""
        m = self.members.pop(ident, None)
        if m is None:
            return
        if m.drafter is not None:
            m.drafter.end()
        if ended and self.keep_ended and m.share and len(m.slots):
            self._ended.append(Held(m.tenant, m.progress.context, m.slots.tensor))
            for h in self._ended[: -self.keep_ended]:  # (pushed out by newer ones: copied while their slots hold)
                self.saved.save(self.target, h)
            del self._ended[: -self.keep_ended]
        if self._doubled:  # (counted again at a sequence's end or start, not at every step)
            self._doubled = doubled([m.slots for m in self.members.values()])

    def _borrow(self) -> None:
        """Each sequence yet to feed its prompt (that shares: `add`'s `share`) takes the slots of the longest prefix of
        it, all but its last token, that another sequence of its tenant holds, or an ended one left, in the cache or
        copied out of it (then appended to the cache again) (module docstring, *Shared prefixes*); one that took a
        prefix and fed nothing yet (it waited: `slots.waiting`) takes a longer one a live sequence holds now. One that
        comes to an empty batch keeps only that prefix in the cache, so that it steps alone."""
        taken = False
        for m in [m for m in self.members.values()
                  if not len(m.slots) or m.share and len(m.slots) == m.progress.cached]:
            prompt, lone, fresh = m.progress.prompt_ids, len(self.members) == 1, not len(m.slots)
            held = [Held(o.tenant, o.progress.context, o.slots.tensor) for o in self.members.values()
                    if len(o.slots) and o.share]
            n, where = longest_prefix(prompt, len(prompt) - 1, m.tenant, held + (
                self._ended + self.saved.held if fresh else [])) if m.share else (0, None)
            if n <= len(m.slots) and not fresh:
                continue
            source = None if where is None else where.slots
            if isinstance(source, Entries):  # a copy: appended to the cache
                self.saved.taken(source)
                if lone:
                    self._drop_ended()
                    self.target.reset()
                m.slots = Slots(torch.arange(self.target.cache_length, self.target.cache_length + n))
                self.target.append_entries(source, n)
            elif source is not None:  # slots of the cache
                m.slots = Slots(source[:n].clone())
            m.progress.cached, taken = n, taken or source is not None
            if lone and self.target.cache_length > len(m.slots):  # ended ones' contexts
                self._drop_ended()
                self.target.compact(0, m.slots.tensor.tolist())  # (none: emptied)
                m.slots = Slots(torch.arange(len(m.slots)))
        if taken:
            self._doubled = doubled([m.slots for m in self.members.values()])

    def _drop_ended(self) -> None:
        """The ended sequences' contexts leave the cache (squeezed out, or the cache emptied): copied out of it first,
        within `keep_bytes` (`slots.SavedContexts`)."""
        for h in self._ended:
            self.saved.save(self.target, h)
        self._ended = []

    def _plan(self) -> dict[int, int]:
        """The prompt tokens each sequence still feeding its prompt feeds in this step (module docstring, *Prompts*;
        `PrefillShare.plan`), those that wait for an earlier one's prefix (`slots.waiting`) none."""
        if self.share_prefixes:
            self._borrow()
        prompts = {i: len(m.progress.prompt_ids) - len(m.slots) for i, m in self.members.items()
                   if len(m.slots) < len(m.progress.prompt_ids)}
        wait = waiting((i, m.tenant, m.progress.prompt_ids, len(m.slots) if len(m.slots) == m.progress.cached else None)
                       for i, m in self.members.items() if i in prompts and m.share) if self.share_prefixes else set()
        return self._share.plan(prompts, self._share.chunk(self.prefill_chunk),
                                {i: self.members[i].chunks for i in prompts}, len(prompts) == len(self.members), wait)

    def _collect(self, gone: list[int]) -> None:
        """The sequences `gone` (failed) dropped; the garbage squeezed out of the cache once it is GARBAGE_SHARE."""
        for ident in gone:
            self._end(ident)
        if not self.members:  # (the ended sequences' contexts kept, if any, for the next: `_borrow`)
            if not self._ended:
                self.target.reset()
                self.cache.let_go()
            return
        # (counted, not gathered: a step's host work must not grow with the contexts the batch holds)
        garbage = self.target.cache_length - sum(len(m.slots) for m in self.members.values()) + self._doubled
        # the last sequence left gets the cache to itself at once, so that it steps alone (`step`)
        if garbage == 0 or (garbage <= GARBAGE_SHARE * self.target.cache_length and len(self.members) > 1):
            return
        live = torch.unique(torch.cat([m.slots.tensor for m in self.members.values()]))  # sorted
        self._drop_ended()  # (their slots squeezed out)
        self.target.compact(0, live.tolist())
        for m in self.members.values():  # each slot moves to its rank among the live ones
            m.slots = Slots(torch.searchsorted(live, m.slots.tensor))
