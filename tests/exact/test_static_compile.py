"""The static path's discipline, proved without a GPU: its step functions trace whole and never recompile.

A CUDA graph replays one fixed sequence of kernels: a step that reads a value on the host, or whose shapes depend on
values, cannot be captured, and a step with a new shape needs a new capture. `torch.compile` with `fullgraph=True,
dynamic=False` refuses the first (a graph break is an error) and counts the second (each new graph is a
compilation): so on the CPU, with dynamo tracing the same step functions the GPU captures (the target's and the
draft model's `StaticDecoder.step`, the EAGLE heads' `StaticHeadState.step` and `StaticEagle3State.step`, their
chains' `chain_step` and trees' `tree_step`, Medusa's heads' call and its tree read late), a whole generation must
compile nothing once every bucket has been seen (a first generation warms them up), while its acceptance varies from
step to step. The backend is "eager": dynamo's tracing and guards are what is tested, not inductor's code.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from conftest import greedy_references, noisy_copy, random_prompts, tiny_qwen2
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.drafters.eagle import EagleTreeDrafter
from specdecode.drafters.eagle_head import EagleHead, head_config
from specdecode.drafters.static_heads import StaticHeadState
from specdecode.drafters.eagle3 import Eagle3Drafter, Eagle3TreeDrafter, StaticEagle3State
from specdecode.drafters.eagle3_head import Eagle3Config, Eagle3Head
from specdecode.drafters.medusa import MedusaDrafter, MedusaHeads
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.models.graphs import RUNNERS, make_runner
from specdecode.models.costs import CostCurve
from specdecode.models.static import BUCKETS, StaticCausalLM

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only]

FREE = CostCurve.linear(0.01)  # width nearly free: the gate keeps wide drafts, so every bucket is met
# a repeated prompt: prompt lookup and the draft models find copies, and the greedy output loops, so some steps
# accept their whole draft and others nothing
PROMPTS = [random_prompts(1, seed=seed, low=10, high=14)[0] * 3 for seed in (3, 4, 5)]


def compiled(model, capacity: int = 256) -> StaticCausalLM:
    return StaticCausalLM(model, runner="compile", backend="eager", capacity=capacity)


def drafters(target: StaticCausalLM, draft: StaticCausalLM, heads: dict) -> dict:
    eagle = StaticHeadState(heads["eagle"], target.model, "compile", capacity=256, backend="eager")
    eagle3 = StaticEagle3State(heads["eagle3"], target.model, "compile", capacity=256, backend="eager")
    chain = DraftModelDrafter(draft, adaptive=False, num_tokens=6)
    chain.confidence_threshold = 0.0  # six tokens every step, whatever the draft model's confidence
    tree = {"draft_cost": 0.001, "top_k": 2, "width": 4, "max_depth": 5}
    return {
        "ar": None,
        "pld": PromptLookupDrafter(),
        "draft": chain,
        "draft-tree": DraftModelTreeDrafter(draft, curve=FREE, draft_cost=0.01, top_k=2, width=4, max_depth=5),
        "eagle-tree": EagleTreeDrafter(heads["eagle"], target.model, FREE, state=eagle, **tree),
        "eagle3-tree": Eagle3TreeDrafter(heads["eagle3"], target.model, FREE, state=eagle3, **tree),
        # a chain of six every step, whatever the head's confidence: one chain step function per length
        "eagle3": Eagle3Drafter(heads["eagle3"], target.model, max_tokens=6, min_confidence=0.0,
                                state=StaticEagle3State(heads["eagle3"], target.model, "compile", capacity=256,
                                                        backend="eager")),
        "medusa-tree": MedusaDrafter(heads["medusa"], target.model, FREE, tree=True, top_k=2, max_nodes=16,
                                     draft_cost=0.001, runner="compile", backend="eager"),
        # trees grown on the device, as off the CPU (`tree.growth`): the draft model's a round at a time, its masks
        # made on the device; EAGLE-3's whole tree as one step function per number of rounds
        "draft-tree-device": on_device(DraftModelTreeDrafter(draft, curve=FREE, draft_cost=0.01, top_k=2, width=4,
                                                             max_depth=5)),
        "eagle3-tree-device": on_device(Eagle3TreeDrafter(
            heads["eagle3"], target.model, FREE, **tree,
            state=StaticEagle3State(heads["eagle3"], target.model, "compile", capacity=256, backend="eager"))),
        # Medusa's tree read late, as off the CPU: made and pruned by one step function per depth and budget
        # (`growth.best_paths`), its budget fixed here (a GPU meets each budget's graph once)
        "medusa-tree-device": read_late(MedusaDrafter(heads["medusa"], target.model, FREE, tree=True, top_k=2,
                                                      max_nodes=16, budget=6, runner="compile", backend="eager")),
    }


def read_late(drafter):
    drafter.reads_late = True
    return drafter


def on_device(drafter):
    drafter.grows_on_host = False
    return drafter


def counting(function, calls: dict, name: str):
    def counted(*args):
        calls[name] += 1
        return function(*args)
    return counted


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen2(0, layers=3)
    draft = noisy_copy(target, 0.3, seed=1)  # agrees with the target often, not always
    # random heads drafting among the few tokens the target's answers loop over: right now and then
    answers = torch.tensor(sorted({token for answer in greedy_references(target, PROMPTS, 40) for token in answer}))
    torch.manual_seed(0)
    medusa = MedusaHeads(target.config.hidden_size, 3, answers)
    for block in medusa.blocks:  # near the identity: each head guesses about the target's next token
        torch.nn.init.normal_(block.weight, std=0.05)
    heads = {
        "eagle": EagleHead(head_config(target.config, 32), answers),
        "eagle3": Eagle3Head(Eagle3Config.for_target(target.config, 32, len(answers)), answers),
        "medusa": medusa,
    }
    return target, draft, {kind: head.float().eval() for kind, head in heads.items()}


@pytest.mark.parametrize("method", ["ar", "pld", "draft", "draft-tree", "eagle-tree", "eagle3", "eagle3-tree",
                                    "medusa-tree", "draft-tree-device", "eagle3-tree-device", "medusa-tree-device"])
def test_a_generation_after_warm_up_compiles_nothing_and_breaks_no_graph(method, models):
    target_model, draft_model, heads = models
    torch._dynamo.reset()
    target, draft = compiled(target_model), compiled(draft_model)
    drafter = drafters(target, draft, heads)[method]
    engine = SpeculativeEngine(target, drafter=drafter, gate=False)
    engine.curve = FREE
    config = GenerationConfig(max_new_tokens=40)
    # the warm-up: every bucket of every step function compiles once
    target.capture(hidden=(False if drafter is None else drafter.needs.hidden,))
    draft.capture()
    runners = {"target": target.runner, "draft": draft.runner}
    if method in ("eagle-tree", "eagle3-tree", "medusa-tree"):  # the head's runner: its state's, or Medusa's own
        head = getattr(drafter, "state", drafter)
        head.capture()
        runners["head"] = head.runner
    if method in ("eagle3", "eagle3-tree-device", "medusa-tree-device"):  # its chains or trees, one step function
        if method == "medusa-tree-device":                                 # per shape met: a first generation
            drafter.capture()                                              # warms them up
        for prompt in PROMPTS:
            engine.generate(prompt, config)
        state = getattr(drafter, "state", drafter)
        runners["head"] = state.chain_runner if method == "eagle3" else state.tree_runner
    calls = dict.fromkeys(runners, 0)
    for name, runner in runners.items():
        runner.compiled = counting(runner.compiled, calls, name)
    counters.clear()
    results = [engine.generate(prompt, config) for prompt in PROMPTS]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])  # nothing compiled again
    # they did run compiled
    assert calls["target"] and (not method.startswith("draft") or calls["draft"]) and calls.get("head", 1)
    accepted = {step.accepted for result in results for step in result.steps}
    if method != "ar":
        assert len(accepted) > 1, accepted  # acceptance varied


def test_every_bucket_compiles_once_without_a_graph_break(models):
    target_model, _, _ = models
    torch._dynamo.reset()
    counters.clear()
    target = compiled(target_model)
    target.capture(hidden=(False, True))
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 2 * len(BUCKETS)


@pytest.mark.parametrize("name", RUNNERS)
def test_every_runner_runs_the_step_as_written_or_refuses_a_device_it_cannot_use(name):
    """Each runner (`models.graphs.RUNNERS`) gives the step function's own outputs, on outputs it may keep (a
    graph's replay writes the same buffers again); a CUDA graph's runner refuses any other device with a clear
    error (`pytest --device cuda` runs the graphs here too)."""
    import conftest

    device = conftest.DEVICE

    def step(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.softmax(x * scale, dim=-1)
        return y, y.argmax(-1)

    if "graphs" in name and device.type != "cuda":
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
            make_runner(name, step, device, backend="eager")
        return
    runner = make_runner(name, step, device, backend="eager")
    inputs = [torch.randn(3, 7, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    outputs = [runner((x,), (2.0,)) for x in inputs]  # the first use captures or compiles; later ones replay
    for x, (y, top) in zip(inputs, outputs):
        expected, expected_top = step(x.to(device), 2.0)
        assert torch.allclose(y, expected) and torch.equal(top, expected_top)
