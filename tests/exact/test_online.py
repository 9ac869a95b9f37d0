"""Online adaptation of an EAGLE-3 head (`drafters.online`): exact whatever it learns, learning from the
sequences it drafted for (more of a repeated text accepted), taken back to the trained head by `forget`,
and the trained head itself never changed."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import LetterTokenizer, greedy_references, greedy_runs, random_eagle3_head, random_prompts
from specdecode.drafters.eagle3 import Eagle3Drafter, Eagle3TreeDrafter
from specdecode.drafters.online import OnlineAdaptation
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")


def _drafter(kind: str, head, target, **learning):
    adaptation = OnlineAdaptation(head, target, **learning)
    if kind == "chain":
        return Eagle3Drafter(head, target, min_confidence=0.0, adaptation=adaptation)
    return Eagle3TreeDrafter(head, target, CostCurve.linear(0.02), budget=6, adaptation=adaptation)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_an_adapting_head_stays_exact_and_learns_the_text_it_drafts_for(tiny_target, kind):
    head = random_eagle3_head(tiny_target, vocab=60)
    trained = {name: tensor.clone() for name, tensor in head.state_dict().items()}
    # a learning rate that shows learning within a few sequences
    drafter = _drafter(kind, head, tiny_target, learning_rate=3e-3, steps=6)
    engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter, gate=False)
    prompts = random_prompts(2, seed=21, low=10, high=11)
    references = greedy_references(tiny_target, prompts, 24)
    accepted = []
    for _ in range(6):  # the same two prompts again and again: exact every time
        runs = greedy_runs(engine, prompts, references, [24])
        accepted.append(sum(sum(s.accepted for s in r.steps) for *_, r in runs))
    assert drafter.state.adaptation.updates > 0
    assert accepted[-1] > accepted[0] + 4, accepted
    losses = drafter.state.adaptation.losses
    assert losses[-1] < losses[0], losses
    assert all(torch.equal(tensor, trained[name]) for name, tensor in head.state_dict().items())  # not the given head


def test_forget_takes_the_head_back_to_the_trained_one(tiny_target):
    head = random_eagle3_head(tiny_target, vocab=60)
    drafter = _drafter("chain", head, tiny_target)
    engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter, gate=False)
    prompt = random_prompts(1, seed=4, low=10, high=11)[0]
    config = GenerationConfig(max_new_tokens=24)
    first = engine.generate(prompt, config)
    engine.generate(prompt, config)
    assert drafter.state.adaptation.updates > 0
    engine.forget()
    again = engine.generate(prompt, config)  # drafted by the trained head, as the first time
    assert drafter.state.adaptation.updates == 0
    assert [s.accepted for s in again.steps] == [s.accepted for s in first.steps]


def test_a_short_sequence_teaches_nothing(tiny_target):
    head = random_eagle3_head(tiny_target, vocab=60)
    adaptation = OnlineAdaptation(head, tiny_target)
    assert not adaptation.learn([1, 2, 3], torch.zeros(3, 3 * tiny_target.config.hidden_size))
    assert adaptation.updates == 0


def test_a_long_sequence_is_learnt_from_its_last_window(tiny_target, monkeypatch):
    """A step's memory grows with the square of what it learns from (the head's attention mask): a whole 8k-token
    sequence took GiB outside any budget. Only its last LEARN_TOKENS are learnt from, as offline windows."""
    from specdecode.drafters import online

    head = random_eagle3_head(tiny_target, vocab=60)
    adaptation = OnlineAdaptation(head, tiny_target, steps=1)
    seen, real = [], online.unroll

    def counted(head, embed, tokens, features, steps):
        seen.append(len(tokens))
        return real(head, embed, tokens, features, steps)

    monkeypatch.setattr(online, "unroll", counted)
    n = online.LEARN_TOKENS + 300
    tokens = torch.randint(0, 60, (n,)).tolist()
    adaptation.learn(tokens, torch.zeros(n, 3 * tiny_target.config.hidden_size))
    assert seen == [online.LEARN_TOKENS]
    assert adaptation.replay[-1][0].tolist() == tokens[-online.LEARN_TOKENS:]


def test_an_adapting_drafter_reports_what_it_holds(tiny_target):
    """A server caps its owners' drafters by `memory_bytes`: the learning head and its optimiser's two moments
    come on top of the drafting copies, the replay buffer grows with the text learnt from, and the target's
    weights (embedding, LM head) count nothing."""
    head = random_eagle3_head(tiny_target, vocab=60)
    plain = Eagle3Drafter(head, tiny_target, min_confidence=0.0)
    drafter = _drafter("chain", head, tiny_target)
    parameters = sum(p.numel() * 4 for p in head.parameters())  # float32
    assert plain.memory_bytes() > parameters  # as loaded, and as it drafts (quantized where the machine can)
    assert drafter.memory_bytes() >= plain.memory_bytes() + parameters
    assert drafter.memory_bytes() < plain.memory_bytes() + 2 * parameters
    bf16 = copy.deepcopy(tiny_target).to(torch.bfloat16)  # the embedding is read as it is, not copied in float32
    table = OnlineAdaptation(head, bf16).table
    assert table.untyped_storage().data_ptr() == bf16.get_input_embeddings().weight.untyped_storage().data_ptr()
    engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter, gate=False)
    before = drafter.memory_bytes()
    for prompt in random_prompts(2, seed=8, low=10, high=11):
        engine.generate(prompt, GenerationConfig(max_new_tokens=24))
    assert drafter.state.adaptation.updates > 0  # its optimiser now has moments, its replay a sequence
    assert drafter.memory_bytes() >= before + 2 * parameters
