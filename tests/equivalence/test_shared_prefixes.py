"""Shared prefixes in the batch engine: a sequence whose prompt begins as a live sequence of its tenant's context
takes that prefix's cache slots instead of feeding it, and decodes exactly as it would have alone, greedy and
sampled, whoever leaves first and however often the cache is compacted; another tenant's sequence shares nothing."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import FLAT, VOCAB, LetterTokenizer, auto_prototype, greedy_references, watching_head
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupTreeDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine import batch as batch_module
from specdecode.engine.batch import BatchEngine
from specdecode.engine.pacing import CHUNK_POLICIES
from specdecode.engine.slots import common_prefix, waiting
from specdecode.models.hf import HFCausalLM
from specdecode.models.static import StaticCausalLM
from specdecode.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX = 24  # the tokens every prompt begins with (a chat template's system prompt, say)


def prompts_with_a_prefix(count: int, seed: int = 11) -> list[list[int]]:
    """A random prefix, then for each prompt a repeated stretch of its own (prompt lookup finds something to copy),
    each stretch beginning with a token of its own, so that two prompts share exactly the prefix."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB, (PREFIX,), generator=g).tolist()
    prompts = []
    for i in range(count):
        stretch = [i] + torch.randint(0, VOCAB, (4 + i % 3,), generator=g).tolist()
        prompts.append(prefix + stretch * 3)
    return prompts


def drafter(kind: str):
    return {"ar": None, "pld": PromptLookupDrafter(num_tokens=6), "pld-tree": PromptLookupTreeDrafter(FLAT, budget=6),
            "auto": None}[kind]


def test_common_prefix():
    assert common_prefix([], [1], 5) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3], 5) == 3
    assert common_prefix([1, 2, 3], [1, 2], 5) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3], 1) == 1
    for length in (1, 7, 33):
        for n in range(length):  # every place of the first difference
            a = list(range(length))
            b = a[:n] + [-1] + a[n + 1 :]
            assert common_prefix(a, b, length) == n
            assert common_prefix(a, b, n // 2) == n // 2


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("garbage_share", [0.0, 0.25])  # compact at every step, by default
def test_a_tenants_sequences_share_a_prompts_prefix_and_decode_as_alone(tiny_target, monkeypatch, garbage_share,
                                                                        static):
    """Tenant "a"'s later sequences take the prefix from the first (one sends the first's very prompt: all of it
    but its last token is taken); tenant "b"'s first shares nothing, its second shares with it; the first
    sequence ends long before those that borrowed from it; one of them samples. Each output is what it is alone,
    and each fed only what it did not share."""
    monkeypatch.setattr(batch_module, "GARBAGE_SHARE", garbage_share)
    prompts = prompts_with_a_prefix(5)
    prompts.append(prompts[0])
    sampled = GenerationConfig(max_new_tokens=30, sampling=SamplingParams(temperature=0.8), seed=5)
    greedy = [GenerationConfig(max_new_tokens=n) for n in (12, 40, 30, 20, 30, 25)]
    configs = [*greedy[:4], sampled, greedy[5]]
    # (join at step, kind, tenant, prompt tokens expected shared)
    plan = [(0, "ar", "a", 0), (2, "pld", "a", PREFIX), (3, "ar", "b", 0), (4, "pld-tree", "a", PREFIX),
            (6, "pld", "b", PREFIX), (7, "ar", "a", len(prompts[0]) - 1)]
    references = greedy_references(tiny_target, prompts, 40)
    alone = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer()).generate(prompts[4], sampled).token_ids
    target = StaticCausalLM(tiny_target, capacity=512) if static else HFCausalLM(tiny_target)
    engine = BatchEngine(target, LetterTokenizer())
    engine.curve = FLAT  # speculation pays: the gate lets drafts through
    results, ids = {}, {}
    for step in range(300):
        for index, (join, kind, tenant, _) in enumerate(plan):
            if join == step:
                ids[engine.add(prompts[index], configs[index], drafter(kind), kind, tenant=tenant)] = index
        results.update({ids[i]: r for i, _, r in engine.step() if r is not None})
        held = [m.slots.tensor for m in engine.members.values()]
        unique = len(torch.unique(torch.cat(held))) if held else 0
        assert engine._doubled == sum(map(len, held)) - unique  # (what decides when the cache is compacted)
        if garbage_share == 0:  # compacted at every step: the cache holds each shared slot once
            assert target.cache_length == unique
        if len(results) == len(plan):
            break
    for index, (_, kind, _, shared) in enumerate(plan):
        expected = alone if index == 4 else references[index][: configs[index].max_new_tokens]
        assert results[index].token_ids == expected, f"sequence {index} ({kind})"
        assert results[index].cached_tokens == shared, f"sequence {index}"
        first = results[index].steps[0]  # its prompt fed whole in its first step: what it did not share
        assert first.forward_tokens - first.drafted == len(prompts[index]) - shared
    assert len(results[0].token_ids) < len(results[1].token_ids)  # the lender left first
    assert sum(s.accepted for s in results[1].steps) > 0  # prompt lookup did draft
    assert len(engine) == 0 and target.cache_length == 0


def test_nothing_is_shared_when_sharing_is_off_or_hidden_states_are_kept(tiny_target):
    prompts = prompts_with_a_prefix(2)
    for engine in (BatchEngine(HFCausalLM(tiny_target), share_prefixes=False),
                   BatchEngine(HFCausalLM(tiny_target), keep_hidden=True)):
        engine.add(prompts[0], GenerationConfig(max_new_tokens=8))
        engine.step()
        engine.add(prompts[1], GenerationConfig(max_new_tokens=8))
        results = [r for _ in range(40) for _, _, r in engine.step() if r is not None]
        assert [r.cached_tokens for r in results] == [0, 0]


def test_a_head_reads_its_own_rows_after_a_shared_prefix(tiny_target):
    """A prompt that shares a prefix and feeds the rest in chunks: its drafter (a Medusa head, and `auto`) is handed
    the hidden states of what it fed, counted as fed (`after_prefill`), and its output is plain decoding's."""
    long = prompts_with_a_prefix(3, seed=12)
    long = [p + p[PREFIX:] * 3 for p in long]  # shared prefix, then a rest fed over several chunks
    references = greedy_references(tiny_target, long, 12)
    seen: list[tuple[int, int]] = []
    head = watching_head(tiny_target, seen)
    engine = BatchEngine(HFCausalLM(tiny_target), LetterTokenizer())
    engine.curve, engine.prefill_chunk = FLAT, 16
    config = GenerationConfig(max_new_tokens=12)
    ids = {engine.add(long[0], GenerationConfig(max_new_tokens=40)): 0}
    results = {}
    for step in range(200):
        if step == 8:  # the first has fed its prompt
            ids[engine.add(long[1], config, head.for_sequence(), "medusa")] = 1
            ids[engine.add(long[2], config, auto_prototype(tiny_target).for_sequence(), "auto")] = 2
        results.update({ids[i]: r for i, _, r in engine.step() if r is not None})
        if len(results) == 3:
            break
    assert [results[i].token_ids for i in (1, 2)] == [references[i] for i in (1, 2)]
    assert results[1].cached_tokens == results[2].cached_tokens == PREFIX
    fed = len(long[1]) - PREFIX
    assert seen[0][0] == fed and seen[0][1] >= fed  # (rows beyond: its draft's)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("chunk", [256, 16], ids=["whole", "chunked"])
def test_sequences_that_come_together_with_one_prompt_feed_it_once(tiny_target, chunk, static):
    """A request's sampled choices, or clients sending one document at once: sequences of one tenant that join in the
    same step with prompts that begin alike wait for the first to feed it (whole, or chunk by chunk) and take it from
    there (`slots.waiting`), each answer its own alone; another tenant's feeds its own (and one that shares less than
    half of itself: `test_waiting_for_an_earlier_prompt`)."""
    base = prompts_with_a_prefix(1, seed=13)[0] * 3  # 3 x 39 tokens: several chunks of 16
    other = base[:10] + [(t + 1) % VOCAB for t in base[10:]]  # shares 10 tokens: too few to wait for
    prompts = [base, base, base + [5, 6], base, other]
    tenants = ["a", "a", "a", "b", "a"]
    sampled = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=0.9), seed=3)
    greedy = GenerationConfig(max_new_tokens=12)
    configs = [greedy, greedy, sampled, greedy, greedy]
    references = greedy_references(tiny_target, prompts, 12)
    alone = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer()).generate(prompts[2], sampled).token_ids
    target = StaticCausalLM(tiny_target, capacity=512) if static else HFCausalLM(tiny_target)
    engine = BatchEngine(target, LetterTokenizer())
    engine.curve, engine.prefill_chunk = FLAT, chunk
    ids = {engine.add(p, c, drafter("pld"), "pld", tenant=t): i
           for i, (p, c, t) in enumerate(zip(prompts, configs, tenants))}
    results = {}
    for _ in range(300):
        results.update({ids[i]: r for i, _, r in engine.step() if r is not None})
        if len(results) == len(prompts):
            break
    for index in range(len(prompts)):
        assert results[index].token_ids == (alone if index == 2 else references[index]), f"sequence {index}"
    shared = [results[i].cached_tokens for i in range(len(prompts))]
    assert shared[:4] == [0, len(base) - 1, len(base), 0]  # (the last takes its 10 once the first holds them)
    for index, prompt in enumerate(prompts):  # each fed only what it did not take
        first = results[index].steps[0]
        if chunk >= len(prompt):
            assert first.forward_tokens - first.drafted == len(prompt) - shared[index]


def test_waiting_for_an_earlier_prompt():
    a, b = list(range(20)), list(range(10)) + [99] * 10
    assert waiting([(0, "t", a, 0), (1, "t", a, 0), (2, "t", a + [7], 0)]) == {1, 2}
    assert waiting([(0, "t", a, None), (1, "t", a, 0)]) == {1}  # the first feeds its own chunks
    assert waiting([(0, "t", a, 0), (1, "u", a, 0)]) == set()  # another tenant's
    assert waiting([(0, "t", a, 0), (1, "t", b, 0)]) == {1}  # 10 of its 19 to take: over half
    assert waiting([(0, "t", a, 0), (1, "t", b + [1, 2], 0)]) == set()  # 10 of 21: under half
    assert waiting([(0, "t", a, 0), (1, "t", a, 19)]) == set()  # it holds all it could take
    assert waiting([(0, "t", a, 0), (1, "t", a, None)]) == set()  # it fed some itself


def run_one(engine: BatchEngine, prompt: list[int], tenant, n: int = 10, kind: str = "pld"):
    """One request to its end in an otherwise empty batch (a client's turn of a conversation)."""
    ident = engine.add(prompt, GenerationConfig(max_new_tokens=n), drafter(kind), kind, tenant=tenant)
    return next(r for _ in range(100) for i, _, r in engine.step() if i == ident and r is not None)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_conversations_next_turn_takes_the_last_turns_context(tiny_target, static):
    """With `keep_ended`, an ended sequence's context stays in the cache of an emptied batch: the next turn of the
    conversation (its prompt: the last one, its answer, a new message) takes all of it but the answer's last token,
    then steps alone; another tenant's request, or none of the conversation, takes nothing and finds the cache as
    a fresh batch would. Every answer is what the prompt gets alone; without `keep_ended` nothing is kept."""
    target = StaticCausalLM(tiny_target, capacity=512) if static else HFCausalLM(tiny_target)
    engine = BatchEngine(target, LetterTokenizer(), keep_ended=2)
    engine.curve = FLAT
    masked, forward = [], target.forward

    def recorded(*args, tree_mask=None, **kwargs):  # whether a forward masks (over the cache): not alone
        masked.append(tree_mask is not None)
        return forward(*args, tree_mask=tree_mask, **kwargs)

    target.forward = recorded
    first = prompts_with_a_prefix(1, seed=13)[0]
    answer = run_one(engine, first, "a")
    assert answer.cached_tokens == 0 and answer.token_ids == greedy_references(tiny_target, [first], 10)[0]
    assert target.cache_length > 0  # kept for the next turn
    turn = first + answer.token_ids + [5, 6, 7]
    again = run_one(engine, turn, "a")
    assert again.cached_tokens == len(first) + len(answer.token_ids) - 1  # (its last token was never fed)
    assert again.token_ids == greedy_references(tiny_target, [turn], 10)[0]
    assert again.steps[0].forward_tokens - again.steps[0].drafted == len(turn) - again.cached_tokens
    other = run_one(engine, turn, "b")  # the same prompt, another tenant: the cache as a fresh batch's
    assert other.cached_tokens == 0 and other.token_ids == again.token_ids
    assert len(engine._ended) == 1 and target.cache_length == len(turn) + len(other.token_ids) - 1
    assert not any(masked)  # each stepped alone, as the single-sequence engine steps (chains: causal attention)
    fresh = BatchEngine(HFCausalLM(tiny_target), LetterTokenizer())
    run_one(fresh, first, "a")
    assert run_one(fresh, turn, "a").cached_tokens == 0 and fresh.target.cache_length == 0


def test_ended_contexts_squeezed_out_of_the_cache_are_not_taken(tiny_target, monkeypatch):
    """Ended sequences' contexts kept while others decode are garbage: once the cache is squeezed (here at every
    step) they are gone, and a later sequence whose prompt begins as one of them feeds its prompt, or takes it from
    a live sequence, never from slots that moved. Every answer is what its prompt gets alone."""
    monkeypatch.setattr(batch_module, "GARBAGE_SHARE", 0.0)
    prompts = prompts_with_a_prefix(4, seed=14)
    engine = BatchEngine(HFCausalLM(tiny_target), LetterTokenizer(), keep_ended=4)
    engine.curve = FLAT
    plan = [(0, 6), (0, 40), (10, 8), (12, 8)]  # (join at step, tokens): the first ends while the second decodes
    results, ids = {}, {}
    for step in range(200):
        for index, (join, n) in enumerate(plan):
            if join == step:
                prompt = prompts[index] if index < 2 else prompts[0] + results[0].token_ids + [index]
                ids[engine.add(prompt, GenerationConfig(max_new_tokens=n), drafter("pld"), tenant="a")] = index
        results.update({ids[i]: r for i, _, r in engine.step() if r is not None})
        if len(results) == len(plan):
            break
    # the third takes the prefix from the live second sequence (the first's context was squeezed out), the fourth
    # all but its last token from the third's
    for index, shared in [(2, PREFIX), (3, len(prompts[0]) + len(results[0].token_ids))]:
        prompt = prompts[0] + results[0].token_ids + [index]
        assert results[index].token_ids == greedy_references(tiny_target, [prompt], 8)[0]
        assert results[index].cached_tokens == shared


def test_a_batch_emptied_by_a_removal_keeps_nothing(tiny_target):
    """A sequence removed (its client left, or its forward failed) leaves nothing to take, and once it was the last,
    the cache is emptied with every ended context kept before: the next request feeds its whole prompt."""
    engine = BatchEngine(HFCausalLM(tiny_target), LetterTokenizer(), keep_ended=2)
    engine.curve = FLAT
    first = prompts_with_a_prefix(1, seed=15)[0]
    run_one(engine, first, "a")
    assert engine.target.cache_length > 0  # kept
    ident = engine.add(first + [1, 2], GenerationConfig(max_new_tokens=20), drafter("pld"), "pld", tenant="a")
    engine.step()
    assert engine.members[ident].progress.cached == len(first)
    engine.remove(ident)
    assert engine.target.cache_length == 0 and not engine._ended
    again = run_one(engine, first, "a")
    assert again.cached_tokens == 0 and again.token_ids == greedy_references(tiny_target, [first], 10)[0]


def ticking(target):
    """The target, its `now` a tick later for each token a forward feeds: a clock that does not depend on the
    machine."""
    forward, target.now = target.forward, 0.0

    def counted(token_ids, **options):
        target.now += token_ids.numel()
        return forward(token_ids, **options)

    target.forward = counted
    return target


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_random_joins_removals_and_tenants_decode_as_alone(tiny_target, monkeypatch, seed, static):
    """Random traffic: sequences join (prompts that begin as one of a few stems, or as an ended sequence's context),
    some are removed, two tenants, contexts kept or not (in the cache, and copied out of it), the cache squeezed at
    every step, by default or never, prompts fed whole or in chunks (taking turns, or one in every step). Every answer
    is its prompt's greedy continuation alone; at every step the double count is the slots' true one and every slot
    lies in the cache. On both paths: the static one's compaction and appended copies write the slots a later
    sequence's shared prefix reads in order (a path written reversed, or a copy's last entries appended instead of
    its first, changed no single sequence's output, and failed most seeds here)."""
    rng = random.Random(seed)
    monkeypatch.setattr(batch_module, "GARBAGE_SHARE", rng.choice([0.0, 0.25, 10.0]))
    # (the turns of long prompts by a clock of the tokens fed, not by time)
    target = ticking(StaticCausalLM(tiny_target, capacity=512) if static else HFCausalLM(tiny_target))
    engine = BatchEngine(target, LetterTokenizer(), keep_ended=rng.choice([0, 1, 3]),
                         keep_bytes=rng.choice([0, 1 << 16, 1 << 30]), chunk_policy=rng.choice(CHUNK_POLICIES),
                         clock=lambda: target.now)
    engine.curve = FLAT
    engine.prefill_chunk = rng.choice([8, 256])
    stems = [[rng.randrange(VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    contexts, live, answers = [], {}, []
    for _ in range(100):
        if rng.random() < 0.35 and len(live) < 6:
            stem = list(rng.choice(contexts)) if contexts and rng.random() < 0.4 else rng.choice(stems)[
                : rng.randrange(1, 40)]
            prompt = (stem + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))])[:200]
            kind, n = rng.choice(["ar", "pld", "pld-tree"]), rng.randrange(1, 24)
            ident = engine.add(prompt, GenerationConfig(max_new_tokens=n), drafter(kind), kind,
                               tenant=rng.choice("ab"))
            live[ident] = (prompt, n)
        if live and rng.random() < 0.05:
            engine.remove(removed := rng.choice(list(live)))
            del live[removed]
        for ident, _, result in engine.step():
            if result is not None:
                prompt, n = live.pop(ident)
                answers.append((prompt, n, result))
                contexts.append(prompt + result.token_ids)
        held = [m.slots.tensor for m in engine.members.values()]
        unique = len(torch.unique(torch.cat(held))) if held else 0
        assert engine._doubled == sum(map(len, held)) - unique
        assert all(int(t.max()) < engine.target.cache_length for t in held if len(t))
    for prompt, n, result in answers:
        assert result.token_ids == greedy_references(tiny_target, [prompt], n)[0]
    assert len(answers) > 10 and sum(result.cached_tokens for _, _, result in answers) > 0


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_contexts_squeezed_out_of_the_cache_are_taken_from_their_copies(tiny_target, monkeypatch, static):
    """With `keep_bytes`, an ended sequence's context squeezed out of the cache (here at every step) is copied out
    of it first: a conversation's next turn that comes while others decode takes all of it but its last token from
    the copy (appended to the cache again), and decodes as it does alone; another tenant's takes nothing of it."""
    monkeypatch.setattr(batch_module, "GARBAGE_SHARE", 0.0)
    prompts = prompts_with_a_prefix(4, seed=14)
    target = StaticCausalLM(tiny_target, capacity=512) if static else HFCausalLM(tiny_target)
    engine = BatchEngine(target, LetterTokenizer(), keep_ended=4, keep_bytes=1 << 30)
    engine.curve = FLAT
    plan = [(0, 6, "a"), (0, 40, "a"), (10, 8, "a"), (12, 8, "b")]  # (join at step, tokens, tenant)
    results, ids = {}, {}
    for step in range(200):
        for index, (join, n, tenant) in enumerate(plan):
            if join == step:
                prompt = prompts[index] if index < 2 else prompts[0] + results[0].token_ids + [index]
                ids[engine.add(prompt, GenerationConfig(max_new_tokens=n), drafter("pld"), tenant=tenant)] = index
        results.update({ids[i]: r for i, _, r in engine.step() if r is not None})
        if len(results) == len(plan):
            break
    turn = len(prompts[0]) + len(results[0].token_ids) - 1  # (the first's last token was never fed)
    for index, shared in [(2, turn), (3, 0)]:
        prompt = prompts[0] + results[0].token_ids + [index]
        assert results[index].token_ids == greedy_references(tiny_target, [prompt], 8)[0]
        assert results[index].cached_tokens == shared
    # copied: the third's and fourth's (the first's dropped for the third's, which holds all of it; the second, the
    # last to end, is still in the cache)
    assert [(h.tenant, len(h.slots)) for h in engine.saved.held] == [("a", turn + 1 + 8), ("b", turn + 1 + 8)]


def test_a_lone_request_takes_a_copy_into_an_emptied_cache(tiny_target):
    """A conversation's turn ends; another tenant's request, alone, squeezes its context out of the cache (copied);
    the next turn, alone again, takes it from the copy into an emptied cache and steps alone (no mask over the
    cache), as the single-sequence engine does. Without `keep_bytes` it feeds its whole prompt."""
    first = prompts_with_a_prefix(1, seed=16)[0]
    for budget in (0, 1 << 30):
        target = HFCausalLM(tiny_target)
        engine = BatchEngine(target, LetterTokenizer(), keep_ended=2, keep_bytes=budget)
        engine.curve = FLAT
        masked, forward = [], target.forward

        def recorded(*args, tree_mask=None, forward=forward, masked=masked, **kwargs):
            masked.append(tree_mask is not None)
            return forward(*args, tree_mask=tree_mask, **kwargs)

        target.forward = recorded
        answer = run_one(engine, first, "a")
        run_one(engine, [9, 8, 7, 6], "b")
        turn = first + answer.token_ids + [5, 6, 7]
        again = run_one(engine, turn, "a")
        assert again.token_ids == greedy_references(tiny_target, [turn], 10)[0]
        assert again.cached_tokens == (len(first) + len(answer.token_ids) - 1 if budget else 0)
        assert not any(masked)


def test_saved_contexts_keep_within_their_budget(tiny_target):
    """Each tenant's copies hold at most `budget` bytes, its least recently saved or taken dropped first, and a
    tenant pushes out only its own; a context that begins as a newer one of its tenant holds all of is dropped for
    it, another tenant's is not."""
    from specdecode.engine.slots import Held, SavedContexts

    target = HFCausalLM(tiny_target)
    target.forward(torch.arange(40))
    per_token = target.entries(torch.arange(1)).nbytes
    saved = SavedContexts(budget=25 * per_token)
    context, other = list(range(40)), list(range(40, 80))
    saved.save(target, Held("a", context, torch.arange(10)))
    saved.save(target, Held("b", context, torch.arange(10)))
    saved.save(target, Held("a", context, torch.arange(12)))  # holds all of a's first
    assert [(h.tenant, len(h.slots)) for h in saved.held] == [("b", 10), ("a", 12)]
    assert torch.equal(saved.held[1].slots.tensors[0], target.entries(torch.arange(12)).tensors[0])
    saved.save(target, Held("b", other, torch.arange(8)))
    saved.taken(saved.held[0].slots)  # b's first: now b's last to drop
    saved.save(target, Held("b", other[:1] + context, torch.arange(9)))  # 27 tokens of b's: b's other goes
    assert [(h.tenant, len(h.slots)) for h in saved.held] == [("a", 12), ("b", 10), ("b", 9)]
    saved.save(target, Held("a", other, torch.arange(20)))  # 32 of a's: a's first goes, b's stay
    assert [(h.tenant, len(h.slots)) for h in saved.held] == [("b", 10), ("b", 9), ("a", 20)]
    assert saved.nbytes == 39 * per_token
    copies: list[int] = []
    target.entries = lambda slots: copies.append(len(slots))  # type: ignore[method-assign]
    saved.save(target, Held("c", other, torch.arange(26)))  # over a tenant's budget: not kept, nor copied
    none = SavedContexts(budget=0)
    none.save(target, Held("a", context, torch.arange(10)))  # nothing kept, nothing copied
    assert [h.tenant for h in saved.held] == ["b", "b", "a"] and not none.held and not copies


def test_a_sequence_that_shares_nothing_takes_lends_and_leaves_nothing(tiny_target):
    """`add(..., share=False)` (a request's `cache_prompt: false`): a sequence whose prompt begins as a live one's
    feeds all of it; a later one whose prompt begins as its context takes only what the live one holds; once it has
    ended nothing of it is kept, in the cache or copied. Every answer is what its prompt gets alone."""
    engine = BatchEngine(HFCausalLM(tiny_target), LetterTokenizer(), keep_ended=2, keep_bytes=1 << 30)
    engine.curve = FLAT
    prompts = prompts_with_a_prefix(2, seed=17)
    ids = {engine.add(prompts[0], GenerationConfig(max_new_tokens=60), drafter("pld"), tenant="a"): 0}
    engine.step()
    ids[engine.add(prompts[1], GenerationConfig(max_new_tokens=6), drafter("pld"), tenant="a", share=False)] = 1
    results = {}
    while 1 not in results:
        results.update({ids[i]: r for i, _, r in engine.step() if r is not None})
    assert results[1].cached_tokens == 0 and not engine._ended and not engine.saved.held
    later = prompts[1] + results[1].token_ids + [3]
    ids[engine.add(later, GenerationConfig(max_new_tokens=6), drafter("pld"), tenant="a")] = 2
    while 2 not in results:
        results.update({ids[i]: r for i, _, r in engine.step() if r is not None})
    assert results[2].cached_tokens == PREFIX
    for index, prompt in [(1, prompts[1]), (2, later)]:
        assert results[index].token_ids == greedy_references(tiny_target, [prompt], 6)[0]


def test_an_ended_context_pushed_out_by_newer_ones_is_copied(tiny_target, monkeypatch):
    """More sequences end than `keep_ended` keeps in the cache (not squeezed while several decode, here): the oldest
    is copied as it is pushed out, and a later prompt that begins as its context takes it from the copy (and decodes
    as alone)."""
    monkeypatch.setattr(batch_module, "GARBAGE_SHARE", 10.0)
    engine = BatchEngine(HFCausalLM(tiny_target), LetterTokenizer(), keep_ended=1, keep_bytes=1 << 30)
    engine.curve = FLAT
    prompts = prompts_with_a_prefix(3, seed=18)
    live = engine.add(prompts[2], GenerationConfig(max_new_tokens=80), drafter("pld"), tenant="a")
    results: dict[int, object] = {}
    ids = {engine.add(p, GenerationConfig(max_new_tokens=n), drafter("pld"), tenant="b"): i
           for i, (p, n) in enumerate([(prompts[0], 4), (prompts[1], 8)])}
    while len(results) < 2:
        results.update({ids[i]: r for i, _, r in engine.step() if r is not None and i in ids})
    first = results[0]
    assert live in engine.members  # (so the cache was squeezed only once both had ended, the second kept till then)
    turn = prompts[0] + first.token_ids + [1]
    ident = engine.add(turn, GenerationConfig(max_new_tokens=6), drafter("pld"), tenant="b")
    result = next(r for _ in range(100) for i, _, r in engine.step() if i == ident and r is not None)
    assert result.cached_tokens == len(prompts[0]) + len(first.token_ids) - 1
    assert result.token_ids == greedy_references(tiny_target, [turn], 6)[0]
