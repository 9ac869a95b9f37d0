"""Chunked prefill: a long prompt is fed a chunk a forward, by the single-sequence engine and in the batch,
with the output it has when fed whole; in the batch, long prompts take turns with the other sequences'
steps (`engine.pacing.PrefillShare`) on a clock the test turns, so no count here depends on the machine.

The fake model checks every forward's cache chain (`fakes.FakeLM`): a chunk fed at the wrong positions, or
seeing the wrong slots, raises."""

from __future__ import annotations

import pytest
import torch

from conftest import LetterTokenizer, random_eagle3_head, random_eagle_head, tiny_qwen2
from fakes import TARGET, VOCAB, FakeLM
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.eagle3 import Eagle3Drafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine.batch import BatchEngine, PrefillShare
from specdecode.engine.prompts import Prefilled, prefill, prefill_spans
from specdecode.engine.sequence import StepEvent
from specdecode.errors import UserError
from specdecode.models import costs, int4
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.models.int8 import quantize_invariant

pytestmark = pytest.mark.usefixtures("one_thread")
LEAN_BITS = [8, pytest.param(4, marks=pytest.mark.skipif(not int4.available(), reason="no int4 kernel"))]


def prompt(length: int, seed: int = 0) -> list[int]:
    """A prompt that repeats a stretch now and then (prompt lookup finds something to copy)."""
    g = torch.Generator().manual_seed(seed)
    stretch = torch.randint(0, VOCAB, (7,), generator=g).tolist()
    return [t for i in range(0, length, 10) for t in stretch + torch.randint(0, VOCAB, (3,), generator=g).tolist()
            ][:length]


class Clock:
    """Time as the test says: the model advances it by the tokens each forward feeds."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingLM(FakeLM):
    """A FakeLM that records the tokens each forward feeds, and spends `token_seconds(cache length)` of `clock`
    a token (default: one tick)."""

    def __init__(self, clock: Clock | None = None, token_seconds=lambda cached: 1.0):
        super().__init__(TARGET, max_context=2048)
        self.clock, self.token_seconds, self.fed = clock or Clock(), token_seconds, []

    def forward(self, token_ids, **options):
        self.fed.append(token_ids.tolist())
        self.clock.now += self.token_seconds(self.cache_length) * token_ids.numel()
        return super().forward(token_ids, **options)


def test_prefill_spans_leave_the_last_chunk_to_the_first_step():
    assert prefill_spans(10, 4) == [(0, 4), (4, 8)]  # the first step feeds tokens 8 and 9
    assert prefill_spans(8, 4) == [(0, 4)]  # ... and 4 .. 7: a whole chunk
    assert prefill_spans(4, 4) == prefill_spans(1, 4) == []


def test_the_chunk_is_what_the_curve_prefills_in_chunk_seconds():
    curve = CostCurve.linear(0.05)
    assert costs.prefill_chunk(curve) == costs.DEFAULT_CHUNK  # no prefill figure
    assert costs.prefill_chunk(CostCurve(curve.sizes, curve.relative, prefill=costs.CHUNK_SECONDS / 50)) == 50
    assert costs.prefill_chunk(CostCurve(curve.sizes, curve.relative, prefill=1.0)) == costs.MIN_CHUNK
    assert costs.prefill_chunk(CostCurve(curve.sizes, curve.relative, prefill=1e-9)) == costs.MAX_CHUNK


# --- One sequence -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ar", "pld"])
def test_a_long_prompt_is_fed_a_chunk_a_forward_with_the_output_it_has_whole(kind):
    ids, config = prompt(45), GenerationConfig(max_new_tokens=20)

    def run(chunk: int):
        target = CountingLM()
        drafter = PromptLookupDrafter(num_tokens=4) if kind == "pld" else None
        engine = SpeculativeEngine(target, LetterTokenizer(), drafter, gate=False)
        engine.prefill_chunk = chunk
        stream = engine.stream(ids, config)
        items = list(stream.items())
        return items, stream.result, target.fed

    items, chunked, fed = run(8)
    _, whole, fed_whole = run(1000)
    assert [i for i in items if isinstance(i, Prefilled)] == [Prefilled(n, 45) for n in (8, 16, 24, 32, 40)]
    assert all(isinstance(i, StepEvent) for i in items[5:])
    assert [len(f) for f in fed[:5]] == [8] * 5 and len(fed[5]) - chunked.steps[0].drafted == 5  # the rest
    assert len(fed_whole[0]) - whole.steps[0].drafted == 45
    assert chunked.token_ids == whole.token_ids
    assert chunked.steps[0].forward_tokens == whole.steps[0].forward_tokens  # the whole prompt, as before
    assert [s.accepted for s in chunked.steps] == [s.accepted for s in whole.steps]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_drafter_that_reads_hidden_states_gets_the_whole_prompts(tiny_target, kind):
    """EAGLE's heads draft from the target's hidden states of every context token: after a chunked prefill
    they get the prompt's as if one forward had fed it, and draft what they draft then."""
    ids, config = prompt(40, seed=3), GenerationConfig(max_new_tokens=12)

    def run(chunk: int):
        if kind == "eagle":
            drafter = EagleDrafter(random_eagle_head(tiny_target, seed=1), tiny_target, max_tokens=3,
                                   min_confidence=0.0)
        else:
            drafter = Eagle3Drafter(random_eagle3_head(tiny_target, seed=1), tiny_target, max_tokens=3,
                                    min_confidence=0.0)
        engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter, gate=False)
        engine.prefill_chunk = chunk
        result = engine.generate(ids, config)
        return result, torch.stack(drafter.state.features)

    chunked, features = run(7)
    whole, whole_features = run(1000)
    assert chunked.token_ids == whole.token_ids
    assert sum(s.drafted for s in chunked.steps) == sum(s.drafted for s in whole.steps) > 0
    assert features.shape == whole_features.shape and features.shape[0] >= len(ids)
    torch.testing.assert_close(features, whole_features, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", LEAN_BITS)
def test_the_lean_paths_chunked_prefill_is_the_whole_prefill_bit_for_bit(bits):
    """On the quantized paths (`models.lean`) no row's result depends on the other rows of its forward, so a
    prompt fed in chunks leaves the cache it leaves fed whole, and the same logits after it, bit for bit."""
    model = quantize_invariant(tiny_qwen2(seed=7, layers=3), bits=bits)
    chunked, whole = HFCausalLM(model), HFCausalLM(model)
    assert chunked._lean is not None
    ids = prompt(60, seed=9)
    assert [p.fed for p in prefill(chunked, ids, 7)] == [7, 14, 21, 28, 35, 42, 49, 56]
    last = chunked.forward(torch.tensor(ids[56:]), num_logits=1).logits
    assert torch.equal(last, whole.forward(torch.tensor(ids), num_logits=1).logits)
    for mine, theirs in zip(chunked._cache.layers, whole._cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


# --- The batch --------------------------------------------------------------------------------------------


def batch(chunk: int, token_seconds=lambda cached: 1.0) -> tuple[BatchEngine, CountingLM]:
    clock = Clock()
    target = CountingLM(clock, token_seconds)
    engine = BatchEngine(target, LetterTokenizer(), gate=False, clock=clock)
    engine.prefill_chunk = chunk
    return engine, target


def alone(ids: list[int], n: int) -> list[int]:
    engine = SpeculativeEngine(FakeLM(TARGET, max_context=2048))
    return engine.generate(ids, GenerationConfig(max_new_tokens=n)).token_ids


@pytest.mark.parametrize("policy", ["turns", "every"])
def test_a_long_prompt_shares_the_steps_with_a_sequence_decoding(policy):
    """A sequence decodes while another's 30-token prompt is fed in chunks of 4. "turns": a chunk (4 prompt tokens, and
    the decoding sequence's token: 5 ticks) goes into a step once the steps after the previous chunk have taken as
    long: here five one-token steps. "every" (vLLM's and Sarathi-Serve's chunked prefill): a chunk in every step, the
    decoding sequence's token in each. Either way each answer is its alone."""
    engine, target = batch(chunk=4)
    engine._share = PrefillShare(policy=policy)
    decoding = engine.add(prompt(3, seed=1), GenerationConfig(max_new_tokens=60))
    engine.step()
    long = engine.add(prompt(30, seed=2), GenerationConfig(max_new_tokens=3))
    pattern, results = [], {}
    while long not in results:
        steps = {ident: result for ident, _, result in engine.step()}
        results.update({i: r for i, r in steps.items() if r is not None})
        pattern.append("C" if len(target.fed[-1]) == 5 else "d" if list(steps) == [decoding] else "+")
    # seven chunks (28 tokens) each with a token of the other sequence; then the prompt's rest (2 tokens) fits in a
    # chunk: it steps at once, then both decode
    between = "ddddd" if policy == "turns" else ""
    assert "".join(pattern) == ("C" + between) * 6 + "C" + "+++"
    assert results[long].token_ids == alone(prompt(30, seed=2), 3)
    output = engine.members[decoding].progress.output
    assert decoding not in results and output == alone(prompt(3, seed=1), len(output)) and len(output) == 1 + len(
        pattern)


@pytest.mark.parametrize("length", [40, 400])
def test_a_newcomer_waits_for_the_chunk_under_way_not_for_the_prompt(length):
    """However long another sequence's prompt, a newcomer's two tokens come in its first two steps."""
    engine, target = batch(chunk=8)
    engine.add(prompt(length, seed=4), GenerationConfig(max_new_tokens=2))
    engine.step()  # a chunk is fed: under way as the newcomer arrives
    newcomer = engine.add(prompt(5, seed=5), GenerationConfig(max_new_tokens=2))
    first, second = engine.step(), engine.step()
    assert [ident for ident, _, _ in first] == [newcomer] and len(target.fed[-2]) == 5  # its prompt alone
    [(ident, _, result)] = second
    assert ident == newcomer and result.token_ids == alone(prompt(5, seed=5), 2)


def test_long_prompts_take_turns_the_one_with_the_fewest_chunks_first():
    engine, target = batch(chunk=5)
    a = engine.add(prompt(23, seed=6), GenerationConfig(max_new_tokens=2))
    engine.step()
    b = engine.add(prompt(23, seed=7), GenerationConfig(max_new_tokens=2))
    order = []
    while engine.members:
        before = {i: len(m.slots) for i, m in engine.members.items()}
        engine.step()
        order.append("".join(name for name, i in (("a", a), ("b", b))
                             if i in engine.members and len(engine.members[i].slots) > before.get(i, 0)))
    # b catches up (it has fed fewer chunks), then they alternate, until a's rest (3 tokens) fits in a chunk
    assert order[:7] == ["b", "a", "b", "a", "b", "a", "a"]
    assert all(len(f) <= 5 for f in target.fed)


def test_prompts_that_fit_in_a_chunk_are_fed_whole_oldest_first_one_chunk_in_all():
    engine, target = batch(chunk=7)
    idents = [engine.add(prompt(3, seed=s), GenerationConfig(max_new_tokens=1)) for s in range(3)]
    first = [ident for ident, _, _ in engine.step()]
    second = [ident for ident, _, _ in engine.step()]
    assert first == idents[:2] and second == idents[2:]  # 3 + 3 fit in 7, the third's 3 wait
    assert [len(f) for f in target.fed] == [6, 3]


def test_chunks_shrink_to_what_takes_chunk_seconds_as_their_tokens_cost_more():
    """A token costs a hundredth of CHUNK_SECONDS, and half as much again every 100 tokens of context
    before it (attention grows with the context): the first chunk is the curve's (64 tokens), then each is
    what takes CHUNK_SECONDS at the pace of the one before, so none takes much longer however deep into the
    prompt."""
    def cost(cached: int) -> float:
        return costs.CHUNK_SECONDS / 100 * (1 + cached / 200)

    engine, target = batch(chunk=64, token_seconds=cost)
    engine.add(prompt(1200, seed=8), GenerationConfig(max_new_tokens=1))
    cached, seconds = 0, []
    while engine.members:
        engine.step()
        seconds.append(cost(cached) * len(target.fed[-1]))
        cached += len(target.fed[-1])
    sizes = [len(f) for f in target.fed]
    assert sizes[:3] == [64, 64, 64] and sizes[-2] < 20 and sizes[:-1] == sorted(sizes[:-1], reverse=True)
    assert max(seconds) < 1.25 * costs.CHUNK_SECONDS  # (a chunk is sized at the pace of the one before)


def test_the_batch_asks_the_targets_curve_for_its_chunk():
    engine = BatchEngine(FakeLM(TARGET, curve=CostCurve((1, 2), (1.0, 1.1), prefill=costs.CHUNK_SECONDS / 25)))
    assert engine.prefill_chunk == 25 == SpeculativeEngine(engine.target).prefill_chunk
    # a batch told to hold its steps' prompt tokens to a quarter of that feeds a quarter as many
    quick = FakeLM(TARGET, curve=CostCurve((1, 2), (1.0, 1.1), prefill=costs.CHUNK_SECONDS / 100))
    assert BatchEngine(quick, chunk_seconds=costs.CHUNK_SECONDS / 4).prefill_chunk == 25


def test_chunks_take_the_seconds_the_batch_is_given():
    share = PrefillShare(seconds=0.25)
    share.took(True, 100)(1.0)  # the last chunk: 100 tokens in a second
    assert share.chunk(1000) == 25 and share.chunk(10) == 10


def test_a_chunk_takes_some_time_and_goes_by_a_known_policy():
    with pytest.raises(UserError, match="chunk_seconds"):
        PrefillShare(seconds=0.0)
    with pytest.raises(UserError, match="turns, every"):
        BatchEngine(FakeLM(TARGET), chunk_policy="sometimes")
    with pytest.raises(UserError, match="chunk_seconds"):
        BatchEngine(FakeLM(TARGET), chunk_seconds=-1.0)
