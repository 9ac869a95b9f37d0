"""EAGLE-3: the head's layout and storage, the target's layer inputs reaching it, lossless drafting (chain
and tree) with a random head, and training-time test lowering every draft step's loss."""

from __future__ import annotations

import pytest
import torch

from conftest import LetterTokenizer, greedy_references, greedy_runs, random_prompts
from conftest import random_eagle3_head as random_head
from specdecode.drafters import eagle3 as eagle3_drafters
from specdecode.drafters import eagle3_head
from specdecode.drafters import heads
from specdecode.drafters.eagle3 import Eagle3Drafter, Eagle3TreeDrafter
from specdecode.drafters.eagle3_head import Eagle3Head, default_layers
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.models.costs import CostCurve
from specdecode.models import int4
from specdecode.models.hf import HFCausalLM
from specdecode.training import eagle3 as training
from specdecode.training.corpus import Sequence
from specdecode.training.features import extract, load

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.4))


def test_layout_follows_the_eagle3_checkpoint(tiny_target):
    head = random_head(tiny_target, vocab=40)
    d = tiny_target.config.hidden_size
    shapes = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    assert shapes["fc.weight"] == (d, 3 * d)
    assert shapes["midlayer.self_attn.q_proj.weight"][1] == 2 * d
    assert shapes["d2t"] == (40,) and shapes["t2d"] == (tiny_target.config.vocab_size,)
    assert bool(head.t2d[head.draft_ids].all()) and int(head.t2d.sum()) == 40
    assert not any("lm_head" in name or "embed" in name for name in shapes)  # the target's, never stored
    assert default_layers(28) == (2, 14, 25) and default_layers(3) == (0, 1, 2)
    with pytest.raises(UserError):
        default_layers(2)


def test_save_and_load_round_trip_in_shards(tiny_target, tmp_path, monkeypatch):
    head = random_head(tiny_target, vocab=60)
    monkeypatch.setattr(eagle3_head, "MAX_FILE_BYTES", 4096)  # several shards for a tiny head
    head.save(tmp_path, {"note": "test"})
    files = sorted(tmp_path.glob("eagle3-*.safetensors"))
    from safetensors import safe_open

    assert len(files) > 1
    for f in files:  # under the limit (with the header), or one tensor bigger than it alone
        with safe_open(str(f), "pt") as opened:
            assert f.stat().st_size < 4096 + 2048 or len(list(opened.keys())) == 1
    loaded, record = Eagle3Head.load(tmp_path, device=tiny_target.device)
    assert record["note"] == "test" and loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name],
                           tensor.to(torch.bfloat16).float() if tensor.is_floating_point() else tensor)
    with pytest.raises(UserError, match="no EAGLE-3 head"):
        Eagle3Head.load(tmp_path / "missing")


def test_the_engine_hands_over_the_three_layers_inputs(tiny_target):
    head = random_head(tiny_target)
    drafter = Eagle3Drafter(head, tiny_target, max_tokens=3, min_confidence=0.0)
    prompt = random_prompts(1, seed=5)[0]
    result = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter, gate=False).generate(
        prompt, GenerationConfig(max_new_tokens=6))
    context = prompt + result.token_ids
    with torch.inference_mode():
        states = tiny_target.model(input_ids=torch.tensor([context], device=tiny_target.device),
                                   output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in head.config.aux_layers], dim=-1)  # [n, 3d]
    kept = torch.stack(drafter.state.features)
    assert kept.shape[1] == 3 * tiny_target.config.hidden_size
    torch.testing.assert_close(kept, expected[: len(kept)], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("vocab", [60])  # a truncated vocabulary (the full one: equivalence/test_every_method.py)
def test_greedy_eagle3_equals_plain_decoding(tiny_target, vocab, kind):
    prompts = random_prompts(4, seed=23)
    references = greedy_references(tiny_target, prompts, 24)
    head = random_head(tiny_target, vocab)
    drafter = (Eagle3Drafter(head, tiny_target, max_tokens=5, min_confidence=0.0) if kind == "chain" else
               Eagle3TreeDrafter(head, tiny_target, FLAT, draft_cost=0.001, top_k=2, width=2, max_depth=4))
    engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter, gate=False)
    drafted = sum(sum(s.drafted for s in result.steps)
                  for *_, result in greedy_runs(engine, prompts, references, [1, 9, 24]))
    assert drafted > 0


@pytest.mark.cpu_only  # the quantized kernels are the CPU's
@pytest.mark.skipif(not int4.available(), reason="no quantized kernels")
@pytest.mark.parametrize("bits", [8, 4])
def test_a_head_drafts_from_a_quantized_copy_close_to_it(tiny_target, monkeypatch, bits):
    """`heads.for_drafting`: the drafting copy's linear layers and LM head on the quantized kernels, the
    trained head left as it was, the draft distributions close to the float head's."""
    monkeypatch.setattr(heads, "DRAFT_BITS", bits)
    head = random_head(tiny_target, vocab=60, intermediate=64)
    state = eagle3_drafters.Eagle3State(head, tiny_target)
    assert (all(type(m) is not torch.nn.Linear for m in state.head.modules())
            and type(state.lm_head) is not torch.nn.Linear)
    assert type(head.fc) is torch.nn.Linear  # the head itself is untouched
    rows = tiny_target.get_output_embeddings().weight.detach()[head.draft_ids]
    x = torch.randn(32, head.config.hidden_size, generator=torch.Generator().manual_seed(1))
    embeddings = torch.randn(32, head.config.hidden_size, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(32, 32, dtype=torch.bool).tril()
    with torch.inference_mode():
        exact = torch.softmax(head.logits(head(x, embeddings, torch.arange(32), mask)[0], rows), -1)
        drafted = state.probs(state.head(x, embeddings, torch.arange(32), mask)[0])
    assert (exact - drafted).abs().max() < (0.02 if bits == 8 else 0.1)
    assert (exact.argmax(-1) == drafted.argmax(-1)).float().mean() >= 0.75


def test_off_the_cpu_a_head_drafts_in_float32_on_the_targets_device(tiny_target, monkeypatch):
    """`heads.for_drafting` swaps in the CPU's quantized kernels only on the CPU: given the rows of an LM head
    on another device (`meta` stands in for a GPU), the drafting copy and its logits layer are float32
    nn.Linear layers there, even where the host CPU runs the kernels."""
    monkeypatch.setattr(heads, "DRAFT_BITS", 4)
    monkeypatch.setattr(int4, "available", lambda: True)
    head = random_head(tiny_target, vocab=60, intermediate=64)
    drafting, logits = heads.for_drafting(head, torch.empty(60, head.config.hidden_size, device="meta"))
    assert type(drafting.fc) is torch.nn.Linear and type(logits) is torch.nn.Linear
    assert all(p.device.type == "meta" and p.dtype == torch.float32
               for p in [*drafting.parameters(), *logits.parameters()])


def test_unroll_attends_as_drafting_does(tiny_target, monkeypatch):
    """Training-time test's step j at row t equals drafting j + 1 tokens after the context x_0..x_{t+1}
    through the inference cache: same outputs, so training sees what inference will (the head in float32
    here; drafting quantizes it where the machine can: `heads.for_drafting`)."""
    monkeypatch.setattr(heads, "DRAFT_BITS", None)
    head = random_head(tiny_target, vocab=60)
    tokens = torch.tensor(random_prompts(1, seed=9, low=20, high=21)[0], device=tiny_target.device)
    with torch.inference_mode():
        states = tiny_target.model(input_ids=tokens[None], output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0] for i in head.config.aux_layers], dim=-1)
    steps = 3
    with torch.no_grad():
        outputs = training.unroll(head, tiny_target.get_input_embeddings(), tokens, aux, steps)
        t = 7
        state = eagle3_drafters.Eagle3State(head, tiny_target)
        state.features = list(aux[: t + 1])
        out = state.sync(tokens[: t + 2].tolist())  # pairs 0..t: step 0 at row t
        torch.testing.assert_close(out, outputs[0][t], atol=1e-5, rtol=1e-5)
        for step in range(1, steps):  # the data's tokens fed as the drafts
            out = state.run(out[None], [int(tokens[t + step + 1])], torch.tensor([t + step], device=tokens.device))[-1]
            torch.testing.assert_close(out, outputs[step][t], atol=1e-5, rtol=1e-5)


def test_training_lowers_every_steps_loss_and_the_trained_head_drafts_losslessly(tiny_target, tmp_path):
    prompts = random_prompts(24, seed=31, low=8, high=9)
    sequences = []
    for prompt in prompts:  # the target's own greedy answers, as `specdecode train data` makes them
        answer = greedy_references(tiny_target, [prompt[:8]], 32)[0]
        ids = prompt[:8] + answer
        sequences.append(Sequence("answers", ids, [False] * 8 + [True] * len(answer)))
    layers = default_layers(tiny_target.config.num_hidden_layers)
    extract(tiny_target, sequences, tmp_path / "features", {"target": "tiny"}, progress=False, layers=layers)
    _, shards = load(tmp_path / "features")
    settings = training.TrainingSettings(intermediate_size=32, vocab_size=50, sequence_tokens=40, steps=3,
                                         epochs=30, learning_rate=3e-3, warmup_steps=5, batch_windows=4,
                                         eval_positions=3)
    head, record = training.train(tiny_target, shards, settings, layers, progress=False, log=lambda *_: None)
    first, last = record.losses[0], record.losses[-1]
    # cross-entropy against a random tiny target's flat distributions: its floor is their entropy (~3 nats)
    assert all(last[f"step{k}"] < first[f"step{k}"] - 0.3 for k in (1, 2, 3)), (first, last)
    assert len(record.held_out_accuracy) == 3 and all(0 <= a <= 1 for a in record.held_out_accuracy)
    training.save(head, record, tmp_path / "head", {"target": "tiny"})
    loaded, _ = Eagle3Head.load(tmp_path / "head")
    references = greedy_references(tiny_target, [p[:8] for p in prompts[:6]], 20)

    def accepted(drafting_head) -> int:  # on prompts it learnt from: exact, and accepted far more than at random
        engine = SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(),
                                   Eagle3Drafter(drafting_head, tiny_target, min_confidence=0.0), gate=False)
        runs = greedy_runs(engine, [p[:8] for p in prompts[:6]], references, [20])
        return sum(sum(s.accepted for s in r.steps) for *_, r in runs)

    untrained = Eagle3Head(loaded.config, loaded.draft_ids).float().eval()
    assert accepted(loaded) > 2 * accepted(untrained) + 5

    # carried on (`--init`): from the trained weights and vocabulary, so its first losses are the trained ones
    again = training.TrainingSettings(**(vars(settings) | {"epochs": 4, "vocab_size": 16, "intermediate_size": 8}))
    carried, carried_record = training.train(tiny_target, shards, again, layers, progress=False,
                                             log=lambda *_: None, init=loaded)
    assert torch.equal(carried.draft_ids.cpu(), loaded.draft_ids) and carried.config == loaded.config
    assert all(carried_record.losses[0][f"step{k}"] < first[f"step{k}"] - 0.3 for k in (1, 2, 3))
    with pytest.raises(UserError, match="another target or other layers"):
        training.train(tiny_target, shards, again, (0, 1, 1), progress=False, log=lambda *_: None, init=loaded)


def test_a_head_to_start_from_is_checked_against_the_target_by_its_fields():
    """`train eagle3 --init`: checked as the target loads, before the features; the message names what differs."""
    from conftest import tiny_qwen2
    from specdecode.errors import UserError
    from specdecode.training.eagle3 import check_init

    target = tiny_qwen2(0, layers=4)
    init = random_head(target)
    layers = default_layers(target.config.num_hidden_layers)
    check_init(init, target.config, layers)  # its own target: fits
    wider = tiny_qwen2(0, layers=4, hidden=96)
    with pytest.raises(UserError, match=r"hidden_size 64 \(this target: 96\)") as error:
        check_init(init, wider.config, layers)
    assert "\n" not in str(error.value) and "Eagle3Config(" not in str(error.value)
