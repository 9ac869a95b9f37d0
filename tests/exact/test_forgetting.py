"""What `forget` drops and what a request starts from: a server's engine for requests without an owner forgets before
each, as a benchmark's repeats do (`--memory request`), so nothing an earlier request taught may survive it, the
statistics drafts are chosen by included (they steer what is drafted, so outputs alone never show them kept). And a
batched suffix sequence leaves its owner's memory what the unbatched drafter keeps: its output and the last
`max_match` tokens of its prompt."""

from __future__ import annotations

from conftest import tiny_qwen2
from specdecode.drafters.base import Memory
from specdecode.drafters.composite import CompositeDrafter
from specdecode.drafters.prompt_lookup import CopyAcceptance, PromptLookupDrafter
from specdecode.drafters.source_payoff import FIRST_REST, Payoff
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine import SpeculativeEngine
from specdecode.engine.payoff import PLAIN
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM

BUCKET = CopyAcceptance.bucket(3)


def test_the_composites_per_source_acceptance_is_forgotten():
    composite = CompositeDrafter([PromptLookupDrafter()], CostCurve.linear(0.5, sizes=tuple(range(1, 65))))
    prior = composite.rate(0)
    composite._acceptance[0].accepted = 50.0  # as after many accepted drafts
    composite.begin([1, 2, 3], forget=True)
    assert composite.rate(0) == prior


def test_the_suffix_drafters_match_rates_are_forgotten_alone_and_in_an_owners_memory():
    fresh = CopyAcceptance().rates(BUCKET)
    drafter = SuffixDrafter()
    drafter.begin([1, 2, 3])
    drafter._shared.record(BUCKET, 0, 8)  # earlier requests' matches, all rejected
    drafter.begin([4, 5, 6], forget=True)
    assert drafter._shared.rates(BUCKET) == fresh
    memory = Memory()
    sequence = SuffixDrafter().for_sequence(memory)
    sequence.begin([1, 2, 3])
    sequence._shared.record(BUCKET, 0, 8)
    sequence.begin([4, 5, 6], forget=True)
    part = memory.part("suffix", lambda: None)
    assert part.rates is sequence._shared and part.rates.rates(BUCKET) == fresh


def test_a_new_request_starts_every_sources_payoff_ledger_afresh():
    payoff = Payoff(1)
    for _ in range(40):  # a source that never pays: benched, its rest doubling
        payoff.record([0], [5.0], 0)
    assert payoff.ledgers[0].rest > FIRST_REST
    payoff.begin()
    assert payoff.ledgers[0].rest == FIRST_REST


def test_an_engines_forget_starts_its_step_aside_switch_afresh():
    engine = SpeculativeEngine(HFCausalLM(tiny_qwen2(0)), None, PromptLookupDrafter(), step_aside=True)
    engine.step_aside.leader = PLAIN  # as after timings where plain decoding led
    engine.step_aside.rates[PLAIN].add(1.0, 10)
    engine.forget()
    assert engine.step_aside.leader != PLAIN and engine.step_aside.rates[PLAIN].tokens == 0


def test_a_batched_suffix_sequence_leaves_only_its_prompts_last_tokens():
    memory = Memory()
    sequence = SuffixDrafter().for_sequence(memory)
    prompt = list(range(1, 301))
    sequence.begin(prompt)
    sequence.end()
    index = memory.part("suffix", lambda: None).index
    [kept] = index.sequences()
    assert index.tokens_of(kept).tolist() == prompt[-index.max_match:]
