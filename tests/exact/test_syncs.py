"""Host synchronisations per step, counted on the CPU: the budget a GPU run depends on.

On a GPU every read of a device tensor on the host (`.tolist()`, `.item()`, `int()` of a tensor...) waits
for the queued kernels. `devices.track` makes a CPU model's outputs stand for device data and
`devices.SyncCounter` counts each host read of them or of anything computed from them, so the budget
holds in CI without a GPU: one transfer per greedy verification, chain or tree; a bounded number per
sampled chain and one per tree level when sampling; none per drafted token of the draft model.

The explicit waits (`torch.cuda.synchronize`, a stream's or an event's, `devices.synchronize`) count too, as
"synchronize": a clock that waits for the device at every reading would cost a step several of them, so the
engines time the device's work with events read late (`devices.EventStopwatch`), driven here by fake events.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass

import pytest
import torch

from conftest import random_prompts
from specdecode import devices
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.engine.batch import BatchEngine
from specdecode.models.costs import CostCurve
from specdecode.models.live_curve import LiveCurve
from specdecode.models.hf import HFCausalLM
from specdecode.models.static import StaticCausalLM
from specdecode.tree import structure
from specdecode.types import Draft, SamplingParams
from specdecode.verify.tree import verify
from test_live_curve import FakeClock, TimedLM

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only]  # the CPU's stand-in for a device

PROMPT = random_prompts(1, seed=3, low=12, high=13)[0] * 3  # repeated, so prompt lookup finds copies
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=1.0)
FIXED_CURVE = CostCurve.linear(0.05)


def tracked(model, static: bool = False) -> HFCausalLM:
    """The model, on the dynamic path or the static one (`models.static`), its outputs standing for a device's."""
    lm = StaticCausalLM(model) if static else HFCausalLM(model)
    devices.track(lm)
    return lm


PATHS = pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])


def reads_per_step(engine: SpeculativeEngine, params: SamplingParams, max_new_tokens: int = 24,
                   logprobs: int | None = None):
    """(each step's host synchronisations by kind, the step's events), the drafter's observe included."""
    counts: list[collections.Counter[str]] = []
    events = []
    config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=params, seed=0, logprobs=logprobs)
    with devices.SyncCounter("cpu") as counter:
        for event in engine.stream(PROMPT, config):
            counts.append(collections.Counter(counter.counts))
            events.append(event)
            counter.reset()
    return counts, events


def syncs_per_step(engine: SpeculativeEngine, params: SamplingParams, max_new_tokens: int = 24,
                   logprobs: int | None = None):
    """(host synchronisations in each step, the step's events), the drafter's observe included."""
    counts, events = reads_per_step(engine, params, max_new_tokens, logprobs)
    return [count.total() for count in counts], events


def test_the_counter_sees_reads_of_device_data_only():
    data = torch.arange(5).as_subclass(devices.Tracked)
    host = torch.arange(5)
    with devices.SyncCounter("cpu") as counter:
        host.tolist(), int(host[0]), bool(host.any())  # host data: free
        (data * 2).tolist()  # computed from device data: still device data
        int(data.argmax()), float(data[1]), data.nonzero(), data[data > 2]
        # a 0-d index of device data is read on the host as an int (on a GPU torch's sync debug mode reports it); a
        # 1-d one of one element stays on the device
        host[data.argmax()], host[data.argmax().view(1)]
        host[data.argmax()] = 0
    assert counter.counts == {"tolist": 1, "__int__": 1, "__float__": 1, "nonzero": 1, "boolean index": 1,
                              "scalar index": 2}


@PATHS
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_chain_step_reads_the_device_once(tiny_target, params, static):
    engine = SpeculativeEngine(tracked(tiny_target, static), drafter=PromptLookupDrafter())
    counts, events = syncs_per_step(engine, params)
    assert any(e.stats.drafted for e in events)  # it did speculate
    assert counts and max(counts) == 1, counts


@PATHS
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_draft_model_drafts_without_reading_each_token(tiny_target, params, static):
    """With its chain drafted whole (as on a GPU), a step reads the device once: at verification."""
    drafter = DraftModelDrafter(tracked(copy.deepcopy(tiny_target), static), adaptive=False, num_tokens=5)
    _ = drafter.model.device  # (a CPU model: the test asks for the GPU's policy by hand); a read with no effect
    drafter.confidence_threshold = 0.0
    assert not drafter.stops_early
    engine = SpeculativeEngine(tracked(tiny_target, static), drafter=drafter)
    counts, events = syncs_per_step(engine, params)
    assert max(e.stats.drafted for e in events) == 5 and all(e.stats.accepted for e in events[1:4])
    assert max(counts) == 1, counts


@PATHS
def test_a_draft_tree_step_reads_the_device_once_per_level(tiny_target, static):
    """The draft model grows its tree a level per draft forward and reads each level's top tokens in one
    transfer; the target's verification reads once."""
    shape = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0))  # a fixed shape: four levels deep
    drafter = DraftModelTreeDrafter(tracked(copy.deepcopy(tiny_target), static), FIXED_CURVE, choices=shape)
    engine = SpeculativeEngine(tracked(tiny_target, static), drafter=drafter, gate=False)
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


def test_attention_on_cuda_is_fixed_once_without_cudnn_and_elsewhere_nothing_changes(monkeypatch):
    """`devices.settle_attention` turns cuDNN's attention off for a CUDA device, once (a second model changes
    nothing more), and leaves the flags alone for the CPU."""
    calls: list[bool] = []
    state = {"cudnn": True}
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: state["cudnn"])
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp",
                        lambda enabled: (calls.append(enabled), state.update(cudnn=enabled)))
    devices.settle_attention(torch.device("cpu"))
    devices.settle_attention(None)
    assert calls == []
    devices.settle_attention(torch.device("cuda"))
    devices.settle_attention("cuda:0")
    assert calls == [False] and not state["cudnn"]


def test_the_kernel_choice_is_made_in_one_place_and_never_toggled():
    """The package switches torch's attention kernels in one place, `devices.settle_attention` (at load), and
    never with `sdpa_kernel` (a context that switches the process-wide flags around a forward and back)."""
    from pathlib import Path

    root = Path(devices.__file__).parent
    found = [f"{path.relative_to(root)}:{number}" for path in sorted(root.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if "sdpa_kernel" in line or ("_sdp(" in line and path.name != "devices.py")]
    assert not found, f"attention kernels switched outside devices.settle_attention: {found}"


def test_no_forward_toggles_the_attention_kernels(tiny_target, monkeypatch):
    """The choice is made at load, never around a forward: torch keeps it for the whole process, so a forward that
    switched it (and switched it back) would switch it under forwards of other threads too (the server's builders).
    The target's forward on both paths, an EAGLE-3 head's and the self-speculative layers' change nothing."""
    import torch.nn.attention as attention_module

    from conftest import random_eagle3_head

    toggles: list[str] = []
    for name in ("enable_cudnn_sdp", "enable_flash_sdp", "enable_mem_efficient_sdp", "enable_math_sdp"):
        monkeypatch.setattr(torch.backends.cuda, name, lambda *args, name=name: toggles.append(name))
    monkeypatch.setattr(attention_module, "sdpa_kernel", lambda *args, **kwargs: toggles.append("sdpa_kernel"))
    for lm in (HFCausalLM(tiny_target), StaticCausalLM(tiny_target)):
        lm.forward(torch.tensor(PROMPT[:5]))
        lm.forward(torch.tensor(PROMPT[5:7]))
    head = random_eagle3_head(tiny_target)
    attention = head.midlayer.self_attn
    d = attention.q_proj.in_features  # the head's attention reads [n, 2 hidden]
    attention(torch.randn(3, d), torch.arange(3), torch.ones(3, 3, dtype=torch.bool).tril(), None)
    assert toggles == []


# --- Explicit waits, and timing without them ----------------------------------------------------------------


@pytest.fixture
def no_device_waits(monkeypatch):
    """The explicit waits as no-ops, patched before any counter wraps them, so they run without a GPU."""
    for owner in (torch.cuda, torch.cuda.Stream, torch.cuda.Event, torch.mps):
        monkeypatch.setattr(owner, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda.Event, "wait", lambda *args, **kwargs: None)


def test_the_counter_counts_explicit_waits_of_the_host_once_each(no_device_waits):
    """Each wait counts once (`devices.synchronize` calls torch's), in every counter active; an event's `wait`
    (the device waits, not the host) does not count; leaving the last counter restores the calls."""
    patched = torch.cuda.synchronize
    with devices.SyncCounter("cpu") as outer:
        with devices.SyncCounter("cpu") as inner:
            devices.synchronize("cuda")
            torch.cuda.synchronize()
            torch.cuda.Stream.synchronize(object())
            torch.cuda.Event.synchronize(object())
            torch.mps.synchronize()
            torch.cuda.Event.wait(object())
        assert inner.counts == {"synchronize": 5}
        devices.synchronize("cuda")
    assert outer.counts == {"synchronize": 6}
    assert torch.cuda.synchronize is patched and not hasattr(devices.synchronize, "__wrapped__")


class FakeQueue:
    """A pretend device's queue of events, for `devices.EventStopwatch` without CUDA: each event is recorded at
    the fake clock's time and passed once the device has run past it, which here is at the next forward
    (`QueuedLM`): by then the step before has read its verdict, which waited for everything queued before."""

    def __init__(self, clock: FakeClock):
        self.clock, self.recorded, self.passed = clock, 0, 0

    def record(self) -> FakeEvent:
        self.recorded += 1
        return FakeEvent(self, self.recorded, self.clock.now)

    def run(self) -> None:
        self.passed = self.recorded


@dataclass
class FakeEvent:
    queue: FakeQueue
    index: int
    time: float

    def query(self) -> bool:
        return self.index <= self.queue.passed

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "an event read before the device passed it"
        return (end.time - self.time) * 1000.0


class QueuedLM(TimedLM):
    """A tiny model whose forwards take fake time (`TimedLM`) and let the fake device catch up first."""

    def __init__(self, model, slope: float = 0.5):
        super().__init__(model, FakeClock(), slope)
        self.queue = FakeQueue(self.clock)
        self.fed: list[int] = []  # tokens of each forward

    def forward(self, token_ids, **kwargs):
        self.queue.run()
        self.fed.append(token_ids.numel())
        return super().forward(token_ids, **kwargs)


class RecordingCurve(LiveCurve):
    def __init__(self):
        super().__init__(FIXED_CURVE)
        self.observed: list[tuple[int, float]] = []

    def observe(self, n: int, seconds: float, context: int | None = None) -> None:
        self.observed.append((n, seconds))
        super().observe(n, seconds, context)


def timed_engine(target, clock=None) -> SpeculativeEngine:
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(), clock=clock)
    engine.curve, engine.prefill_chunk = RecordingCurve(), 64
    return engine


def test_a_waited_clock_is_counted_at_every_step(tiny_target, no_device_waits):
    """`devices.clock` waits for the device at every reading: an engine timed with it synchronises each step."""
    engine = timed_engine(tracked(tiny_target), clock=devices.clock("cuda"))
    counts, _ = reads_per_step(engine, GREEDY)
    assert all(count["synchronize"] > 0 for count in counts), counts


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_events_time_a_step_without_a_wait(tiny_target, no_device_waits, params):
    """Timed by events read late, a chain step reads the device once and waits for it nowhere else."""
    target = QueuedLM(tiny_target)
    devices.track(target)
    engine = timed_engine(target)
    engine.stopwatch = devices.EventStopwatch(target.queue.record)
    counts, events = reads_per_step(engine, params)
    assert any(e.stats.drafted for e in events) and engine.curve.observed
    assert all(count["synchronize"] == 0 and count.total() == 1 for count in counts), counts


def test_every_forward_reaches_the_curve_and_the_switch_a_step_late(tiny_target):
    """Each forward after the prompt's is timed on the device's clock and delivered once the device has passed
    it, a step later; the step-aside switch gets the steps' seconds the same way; none is lost."""
    target = QueuedLM(tiny_target)
    engine = timed_engine(target)
    engine.stopwatch = devices.EventStopwatch(target.queue.record)
    delivered = [len(engine.curve.observed) for _ in engine.stream(PROMPT, GenerationConfig(max_new_tokens=24))]
    assert delivered == [0] + list(range(len(delivered) - 1)), delivered
    target.queue.run()
    engine.stopwatch.settle()
    expected = [(n, 1.0 + 0.5 * (n - 1)) for n in target.fed[1:]]  # every forward but the prompt's
    assert engine.curve.observed == [(n, pytest.approx(seconds)) for n, seconds in expected]
    aside = engine.step_aside
    assert aside is not None and sum(rate.tokens for rate in aside.rates.values()) > 0


def test_the_batch_engine_times_every_forward_a_step_late_without_a_wait(tiny_target, no_device_waits):
    """The same in the batch: every forward but the prompts' reaches the curve a step late, and a step reads the
    device once per sequence it verifies (no wait besides)."""
    target = QueuedLM(tiny_target)
    devices.track(target)
    engine = BatchEngine(target)
    engine.curve, engine.prefill_chunk = RecordingCurve(), 64
    engine.stopwatch = devices.EventStopwatch(target.queue.record)
    for prompt in (PROMPT[:20], PROMPT[5:30]):
        engine.add(prompt, GenerationConfig(max_new_tokens=16), PromptLookupDrafter())
    delivered, counts = [], []
    while len(engine):
        with devices.SyncCounter("cpu") as counter:
            stepped = {ident for ident, _, _ in engine.step()}
        delivered.append(len(engine.curve.observed))
        counts.append((collections.Counter(counter.counts), len(stepped)))
    assert delivered == [0] + list(range(len(delivered) - 1)), delivered
    assert all(count["synchronize"] == 0 and count.total() == sequences for count, sequences in counts), counts
    target.queue.run()
    engine.stopwatch.settle()
    assert engine.curve.observed == [(n, pytest.approx(1.0 + 0.5 * (n - 1))) for n in target.fed[1:]]
