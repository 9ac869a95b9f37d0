"""Behaviour of the loop: stopping, streaming, statistics, seeds, bad input, sampled output."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import VOCAB, LetterTokenizer, random_medusa_heads, random_prompts, tiny_qwen2
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.drafters.eagle import EagleHead, EagleTreeDrafter, head_config
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupTreeDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.types import SamplingParams

PROMPT = random_prompts(1, seed=11)[0]


@pytest.fixture
def spec_engine(tiny_target):
    drafter = DraftModelDrafter(HFCausalLM(copy.deepcopy(tiny_target)), confidence_threshold=0)
    return SpeculativeEngine(HFCausalLM(tiny_target), LetterTokenizer(), drafter=drafter)


def plain_ids(tiny_target, n=40):
    return SpeculativeEngine(HFCausalLM(tiny_target)).generate(PROMPT, GenerationConfig(max_new_tokens=n)).token_ids


def test_eos_stops_and_is_kept(tiny_target, spec_engine):
    ids = plain_ids(tiny_target)
    eos = ids[9]
    first = ids.index(eos)
    spec_engine.target.eos_token_ids = frozenset({eos})
    result = spec_engine.generate(PROMPT, GenerationConfig(max_new_tokens=40))
    assert result.token_ids == ids[: first + 1] and result.finish_reason == "eos"
    ignored = spec_engine.generate(PROMPT, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    assert ignored.token_ids == ids and ignored.finish_reason == "length"


def test_stop_string_cuts_text_and_tokens(tiny_target, spec_engine):
    ids = plain_ids(tiny_target)
    text = LetterTokenizer().decode(ids)
    stop = text[12:14]
    cut = text.index(stop)
    result = spec_engine.generate(PROMPT, GenerationConfig(max_new_tokens=40, stop=(stop, "not-there")))
    assert result.finish_reason == "stop"
    assert result.text == text[:cut]
    assert result.token_ids == ids[: cut + len(stop)]  # up to the token completing the stop string


def test_streaming_concatenates_to_result(tiny_target, spec_engine):
    stream = spec_engine.stream(PROMPT, GenerationConfig(max_new_tokens=33))
    events = list(stream)
    result = stream.result
    assert [t for e in events for t in e.token_ids] == result.token_ids == plain_ids(tiny_target, 33)
    assert "".join(e.text for e in events) == result.text == LetterTokenizer().decode(result.token_ids)
    origins = [o for e in events for o in e.origins]
    assert len(origins) == 33 and "accepted" in origins
    assert set(origins) <= {"accepted", "corrected", "bonus", "target"}


def test_statistics_add_up(spec_engine):
    result = spec_engine.generate(PROMPT, GenerationConfig(max_new_tokens=30))
    steps = result.steps
    assert sum(s.new_tokens for s in steps) == result.new_tokens == 30
    assert result.mean_accepted_tokens == pytest.approx(30 / len(steps))
    assert all(s.accepted <= s.drafted for s in steps)
    assert steps[0].forward_tokens == len(PROMPT) + steps[0].drafted  # the prefill is the first forward
    assert result.accepted_per_position[0] == 1.0  # the drafter is the target itself
    summary = result.summary()
    assert summary["target_forwards"] == len(steps) and summary["method"] == "draft"


def test_context_limit_ends_generation(tiny_target):
    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=PromptLookupDrafter())
    long_prompt = (PROMPT * 100)[:500]  # the tiny model holds 512 positions
    result = engine.generate(long_prompt, GenerationConfig(max_new_tokens=100))
    assert result.new_tokens == 12 and result.finish_reason == "length"


def test_gate_verifies_only_what_pays_on_the_cost_curve(tiny_target):
    """A scored chain is cut to the prefix that pays: all of it where width is free, none of it where a
    forward over k tokens costs k (then no draft token can pay, except beside the prefill, whose own
    width makes a few more tokens relatively cheap), and the output is the same either way."""
    from specdecode.models.costs import CostCurve

    prompt = PROMPT * 4  # repeats: prompt lookup finds matches at every step
    config = GenerationConfig(max_new_tokens=40)
    outputs, drafted = {}, {}
    for name, curve in [("free", CostCurve.linear(0.0)), ("linear", CostCurve.linear(1.0))]:
        engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=PromptLookupDrafter(num_tokens=8))
        engine.curve = curve
        result = engine.generate(prompt, config)
        outputs[name], drafted[name] = result.token_ids, sum(s.drafted for s in result.steps[1:])
    ungated = SpeculativeEngine(HFCausalLM(tiny_target), drafter=PromptLookupDrafter(num_tokens=8), gate=False)
    result = ungated.generate(prompt, config)
    assert drafted["linear"] == 0 and drafted["free"] == sum(s.drafted for s in result.steps[1:]) > 0
    assert outputs["free"] == outputs["linear"] == result.token_ids


@pytest.mark.parametrize(
    "prompt, config_kwargs",
    [([], {}), ([1] * 600, {}), ([VOCAB + 5], {}), (PROMPT, {"max_new_tokens": 0}), (PROMPT, {"max_new_tokens": -3})],
)
def test_bad_input_is_a_user_error(tiny_target, prompt, config_kwargs):
    with pytest.raises(UserError):
        SpeculativeEngine(HFCausalLM(tiny_target)).generate(prompt, GenerationConfig(**config_kwargs))


def test_seed_reproduces_sampled_run(spec_engine):
    config = GenerationConfig(max_new_tokens=25, sampling=SamplingParams(temperature=1.0), seed=42)
    first = spec_engine.generate(PROMPT, config).token_ids
    assert spec_engine.generate(PROMPT, config).token_ids == first
    other = GenerationConfig(max_new_tokens=25, sampling=SamplingParams(temperature=1.0), seed=43)
    assert spec_engine.generate(PROMPT, other).token_ids != first


@pytest.mark.parametrize("kind", ["chain", "draft-tree", "pld-tree", "eagle-tree", "medusa-tree"])
def test_sampled_output_follows_target_distribution(kind):
    """End to end through the engine: the joint distribution of the first two sampled tokens under
    speculative sampling (a draft model's chain; a draft model's fixed-shape tree; a prompt-lookup trie,
    whose branches are fixed in advance; an EAGLE head's dynamic tree, drafting the second token from
    the first forward's features) equals the target's exact distribution (small vocabulary)."""
    from scipy.stats import chisquare

    vocab = 6
    target_model = tiny_qwen2(seed=21, layers=2, hidden=32, vocab=vocab)
    draft_model = tiny_qwen2(seed=22, layers=1, hidden=32, vocab=vocab)
    with torch.no_grad():  # flatten the distributions so every pair has mass
        target_model.lm_head.weight.mul_(0.15)
        draft_model.lm_head.weight.mul_(0.15)
    prompt = [1, 4, 2, 1, 4, 2, 5, 2, 0, 2]  # "2" was followed by 1, 5 and 0: a three-branch trie
    params = SamplingParams(temperature=1.0)
    # exact joint distribution of the next two tokens
    with torch.no_grad():
        first = target_model(torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
        seconds = target_model(torch.tensor([[*prompt, t] for t in range(vocab)])).logits[:, -1].float().softmax(-1)
    expected = (first[:, None] * seconds).flatten()  # [vocab * vocab]

    drafter = {
        "chain": lambda: DraftModelDrafter(HFCausalLM(draft_model), num_tokens=2, adaptive=False, confidence_threshold=0),
        "draft-tree": lambda: DraftModelTreeDrafter(
            HFCausalLM(draft_model), CostCurve.linear(0.05), choices=[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]
        ),
        "pld-tree": lambda: PromptLookupTreeDrafter(CostCurve.linear(0.0), max_ngram=1, num_tokens=2),
        "eagle-tree": lambda: EagleTreeDrafter(
            EagleHead(head_config(target_model.config, 16), torch.arange(vocab)).eval(), target_model,
            CostCurve.linear(0.0), draft_cost=1e-3, top_k=2, width=2, max_depth=2),
        "medusa-tree": lambda: MedusaDrafter(random_medusa_heads(target_model), target_model, CostCurve.linear(0.0),
                                             tree=True, top_k=2, max_nodes=6, draft_cost=1e-3),
    }[kind]()
    engine = SpeculativeEngine(HFCausalLM(target_model), drafter=drafter)
    counts = torch.zeros(vocab * vocab)
    runs, drafted_trees = 1500, 0
    for seed in range(runs):
        # (EAGLE and Medusa draft from the second step on, so they need room for a two-deep tree after the
        # first token)
        new_tokens = 4 if kind in ("eagle-tree", "medusa-tree") else 2
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=new_tokens, sampling=params, seed=seed))
        ids = result.token_ids
        counts[ids[0] * vocab + ids[1]] += 1
        drafted_trees += any(s.draft_depth for s in result.steps)
    if kind in ("eagle-tree", "medusa-tree"):
        assert drafted_trees > runs // 2  # the second token came through a verified tree
    elif kind != "chain":
        assert isinstance(drafter.propose(prompt, 2, params, None).parents, torch.Tensor)  # it drafts trees
    assert chisquare(counts.numpy(), (expected * runs).numpy()).pvalue > 1e-3
