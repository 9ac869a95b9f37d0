"""Host synchronisations per step, counted on the CPU: the budget a GPU run depends on.

On a GPU every read of a device tensor on the host (`.tolist()`, `.item()`, `int()` of a tensor...) waits
for the queued kernels. `devices.track` makes a CPU model's outputs stand for device data and
`devices.SyncCounter` counts each host read of them or of anything computed from them, so the budget
holds in CI without a GPU: one transfer per greedy verification, chain or tree; a bounded number per
sampled chain and one per tree level when sampling; none per drafted token of the draft model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import random_prompts
from specdecode import devices
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.tree import structure
from specdecode.types import Draft, SamplingParams
from specdecode.verify.tree import verify

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only]  # the CPU's stand-in for a device

PROMPT = random_prompts(1, seed=3, low=12, high=13)[0] * 3  # repeated, so prompt lookup finds copies
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=1.0)
FIXED_CURVE = CostCurve.linear(0.05)


def tracked(model) -> HFCausalLM:
    lm = HFCausalLM(model)
    devices.track(lm)
    return lm


def syncs_per_step(engine: SpeculativeEngine, params: SamplingParams, max_new_tokens: int = 24):
    """(host reads of device data in each step, the step's events), the drafter's observe included."""
    counts, events = [], []
    config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=params, seed=0)
    with devices.SyncCounter("cpu") as counter:
        for event in engine.stream(PROMPT, config):
            counts.append(counter.total)
            events.append(event)
            counter.reset()
    return counts, events


def test_the_counter_sees_reads_of_device_data_only():
    data = torch.arange(5).as_subclass(devices.Tracked)
    host = torch.arange(5)
    with devices.SyncCounter("cpu") as counter:
        host.tolist(), int(host[0]), bool(host.any())  # host data: free
        (data * 2).tolist()  # computed from device data: still device data
        int(data.argmax()), float(data[1]), data.nonzero(), data[data > 2]
    assert counter.counts == {"tolist": 1, "__int__": 1, "__float__": 1, "nonzero": 1, "boolean index": 1}


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_chain_step_reads_the_device_once(tiny_target, params):
    engine = SpeculativeEngine(tracked(tiny_target), drafter=PromptLookupDrafter())
    counts, events = syncs_per_step(engine, params)
    assert any(e.stats.drafted for e in events)  # it did speculate
    assert counts and max(counts) == 1, counts


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_draft_model_drafts_without_reading_each_token(tiny_target, params):
    """With its chain drafted whole (as on a GPU), a step reads the device once: at verification."""
    drafter = DraftModelDrafter(tracked(copy.deepcopy(tiny_target)), adaptive=False, num_tokens=5)
    drafter.model.device  # (a CPU model: the test asks for the GPU's policy by hand)
    drafter.confidence_threshold = 0.0
    assert not drafter.stops_early
    engine = SpeculativeEngine(tracked(tiny_target), drafter=drafter)
    counts, events = syncs_per_step(engine, params)
    assert max(e.stats.drafted for e in events) == 5 and all(e.stats.accepted for e in events[1:4])
    assert max(counts) == 1, counts


def test_a_draft_tree_step_reads_the_device_once_per_level(tiny_target):
    """The draft model grows its tree a level per draft forward and reads each level's top tokens in one
    transfer; the target's verification reads once."""
    shape = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0))  # a fixed shape: four levels deep
    drafter = DraftModelTreeDrafter(tracked(copy.deepcopy(tiny_target)), FIXED_CURVE, choices=shape)
    engine = SpeculativeEngine(tracked(tiny_target), drafter=drafter, gate=False)
    counts, events = syncs_per_step(engine, GREEDY)
    depths = [e.stats.draft_depth or 0 for e in events]
    assert max(depths) > 1
    assert all(count <= depth + 1 for count, depth in zip(counts, depths)), (counts, depths)


def test_greedy_tree_verification_reads_the_device_once():
    parents = torch.tensor([-1, -1, 0, 0, 2, 4])
    logits = torch.randn(len(parents) + 1, 11).as_subclass(devices.Tracked)
    draft = Draft(tokens=torch.randint(11, (len(parents),)).as_subclass(devices.Tracked), parents=parents)
    with devices.SyncCounter("cpu") as counter:
        verify(logits, draft, GREEDY, None)
    assert counter.total == 1


def test_sampled_tree_verification_reads_the_device_once_per_level():
    parents = torch.tensor([-1, -1, 0, 0, 2, 4])  # depth 4
    target = torch.full((len(parents) + 1, 5), 0.2)
    tokens = torch.tensor([1, 2, 1, 1, 1, 1])
    draft = Draft(tokens=tokens.as_subclass(devices.Tracked), parents=parents)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        with devices.SyncCounter("cpu") as counter:
            verdict = verify(target.log().as_subclass(devices.Tracked), draft, SAMPLED, generator)
        assert counter.total == len(verdict.path) + 1  # one per level it reached
    assert int(structure.depths(parents).max()) == 4


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_constrained_step_reads_the_device_no_more(params):
    """Under a constraint the masks are built on the host and sent to the device (no read): a prompt-lookup
    step still reads the device once, forced tokens drafted or not."""
    from conftest import TOKENS, tiny_chat_qwen2, tiny_tokenizer
    from specdecode.constraints import Constraint

    tokenizer = tiny_tokenizer()
    engine = SpeculativeEngine(tracked(tiny_chat_qwen2(len(TOKENS) + 10)), tokenizer, drafter=PromptLookupDrafter())
    regex = "(the cat|a dog)( sat on the (mat|cat))+"
    prompt = tokenizer.encode("the cat sat on the mat. the cat sat on the cat. a dog sat on the mat.")
    config = GenerationConfig(max_new_tokens=24, sampling=params, seed=0, constraint=Constraint.regex(regex))
    counts, events = [], []
    with devices.SyncCounter("cpu") as counter:
        for event in engine.stream(prompt, config):
            counts.append(counter.total)
            events.append(event)
            counter.reset()
    assert sum(e.stats.forced for e in events) > 0 and any(e.stats.drafted > e.stats.forced for e in events)
    assert counts and max(counts) == 1, counts


def test_attention_on_cuda_leaves_out_cudnn_and_elsewhere_changes_nothing():
    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    with devices.attention(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    with devices.attention(torch.device("cpu")), devices.attention(None):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before[0]
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == before


def test_every_forward_runs_its_attention_inside_the_devices_choice(tiny_target, monkeypatch):
    """The target's forward, an EAGLE-3 head's and the self-speculative layers' all ask `devices.attention`
    for their device: a new path that forgot would decode on CUDA with cuDNN's per-length graph builds."""
    from conftest import random_eagle3_head
    from specdecode.drafters.self_speculative.layers import run_layers

    asked: list[str] = []
    real = devices.attention

    def recording(device):
        asked.append(torch.device(device).type)
        return real(device)

    monkeypatch.setattr(devices, "attention", recording)
    lm = HFCausalLM(tiny_target)
    lm.forward(torch.tensor(PROMPT[:5]))
    assert asked == ["cpu"]
    head = random_eagle3_head(tiny_target)
    attention = head.midlayer.self_attn
    d = attention.q_proj.in_features  # the head's attention reads [n, 2 hidden]
    attention(torch.randn(3, d), torch.arange(3), torch.ones(3, 3, dtype=torch.bool).tril(), None)
    assert asked == ["cpu", "cpu"]
    run_layers(tiny_target, [0], torch.tensor(PROMPT[:1]), torch.arange(1), None, None)
    assert asked[2:] == ["cpu"]
