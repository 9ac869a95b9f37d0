"""Acceptance recordings and their replay (`bench.acceptance`, `bench.replay_acceptance`) on tiny random models:
`specdecode bench --record-acceptance` writes every step's shape and acceptance, and a replay with the real
drafter running in full accepts exactly the recorded counts, for every drafter kind (a chain or tree of a draft
model, EAGLE-3's tree, Medusa's tree, prompt lookup), whatever the recorded shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (
    DRAFT_PRICES, TOKENS, random_eagle3_head, random_medusa_heads, random_prompts, tiny_chat_qwen2, tiny_qwen2,
    tiny_tokenizer,
)

from specdecode import metrics
from specdecode.api import load_models
from specdecode.bench import acceptance
from specdecode.bench.acceptance import RecordedRun, RecordedStep
from specdecode.bench.main import run
from specdecode.bench.replay_acceptance import (
    agreement, reference_continuation, relative_cost, replay_config, replay_engine, replayed_draft,
    settled_continuation,
)
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.drafters.eagle3 import Eagle3TreeDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.methods import choose
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.tree import structure


@pytest.fixture(scope="module")
def roomy_folder(tmp_path_factory):
    """A tiny chat model folder whose context holds the benchmark's prompts (the letter tokenizer makes them long)."""
    folder = tmp_path_factory.mktemp("tiny-roomy")
    tiny_chat_qwen2(vocab_size=len(TOKENS) + 10, max_positions=1024).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_the_bench_records_and_the_replay_accepts_exactly_what_was_recorded(roomy_folder, tmp_path):
    path = tmp_path / "recorded.json.gz"
    run(methods=["pld", "draft", "draft-tree"], categories=["code", "multi-turn"], per_category=1, max_new_tokens=24,
        repeats=1, out=tmp_path / "bench", target=str(roomy_folder), drafter=str(roomy_folder), dtype="float32",
        draft_dtype="float32", threads=1, backend="torch", temperature=0.0, top_k=0, top_p=1.0, seed=0,
        record_acceptance=path)
    settings, runs = acceptance.load(path)
    assert "--record-acceptance" in settings["command"] and path.stat().st_size < 20_000
    # one run per method and turn (multi-turn: two), the warm-up left out
    assert sorted((r.method, r.category, r.turn) for r in runs) == sorted(
        (m, c, t) for m in ("pld", "draft", "draft-tree") for c, turns in (("code", 1), ("multi-turn", 2))
        for t in range(turns))
    assert all(len(r.output_ids) == 24 and r.steps for r in runs)
    assert all(sum(s.accepted + 1 for s in r.steps) >= 24 for r in runs)  # every step adds accepted + 1 (the last cut)
    assert any(s.parents is not None for r in runs if r.method == "draft-tree" for s in r.steps)
    assert any(s.accepted for r in runs for s in r.steps)  # the tiny pair (one model twice) agrees

    models = load_models(str(roomy_folder), str(roomy_folder), dtype="float32", progress=False)
    for recorded in runs:
        continuation = reference_continuation(models.target, recorded.prompt_ids, len(recorded.output_ids))
        assert continuation == recorded.output_ids  # lossless greedy: the plain output
        engine, replayer = replay_engine(models.target, models.drafter_for(choose(recorded.method)), recorded,
                                         continuation)
        result = engine.generate(recorded.prompt_ids, replay_config(recorded))
        assert replayer.accepted == [s.accepted for s in recorded.steps], (recorded.method, recorded.task_id)
        assert result.token_ids == recorded.output_ids
        assert agreement(recorded, replayer)["exact"]


def synthetic_run(prompt: list[int], new_tokens: int, seed: int) -> RecordedRun:
    """Recorded steps of every kind at random (plain, stepped aside, chains, trees with an accepted path of any
    length), each fitting the room left, adding up to `new_tokens`."""
    generator = torch.Generator().manual_seed(seed)

    def draw(n: int) -> int:  # 0 .. n - 1
        return int(torch.randint(n, (), generator=generator))

    steps, made = [], 0
    while made < new_tokens:
        room = new_tokens - made - 1  # draft tokens this step may still accept (the engine's max_tokens)
        kind = draw(4) if room > 0 else 0
        if kind == 0:
            step = RecordedStep(0, 0, aside=bool(draw(2)))
        elif kind == 1:
            drafted = 1 + draw(min(room, 8))
            step = RecordedStep(drafted, draw(drafted + 1))
        else:
            parents: list[int] = []
            depths: list[int] = []
            for node in range(1 + draw(12)):
                parent = draw(node + 1) - 1
                if parent >= 0 and depths[parent] >= room:
                    parent = -1
                parents.append(parent)
                depths.append(1 if parent < 0 else depths[parent] + 1)
            end = draw(len(parents))
            path = [end]
            while parents[path[0]] >= 0:
                path.insert(0, parents[path[0]])
            path = path[: draw(len(path) + 1)]  # a prefix of a root-to-node path
            step = RecordedStep(len(parents), len(path), tuple(parents), tuple(path))
        steps.append(step)
        made += step.accepted + 1
    return RecordedRun("synthetic", "none", "none/0", 0, 0, prompt, [0] * new_tokens, steps)


def real_drafters(target, draft, curve) -> dict:
    target_lm, draft_lm = HFCausalLM(target), HFCausalLM(draft)
    return {
        "draft": lambda: DraftModelDrafter(draft_lm, num_tokens=4, **DRAFT_PRICES),
        "draft-tree": lambda: DraftModelTreeDrafter(draft_lm, curve, draft_cost=0.4),
        "eagle3-tree": lambda: Eagle3TreeDrafter(random_eagle3_head(target), target, curve),
        "medusa-tree": lambda: MedusaDrafter(random_medusa_heads(target), target, curve, tree=True),
        "pld": lambda: PromptLookupDrafter(),
        "target_lm": lambda: target_lm,
    }


@pytest.mark.parametrize("method", ["draft", "draft-tree", "eagle3-tree", "medusa-tree", "pld"])
def test_a_replay_accepts_every_recorded_shape_exactly_whatever_the_real_drafter(method):
    target, draft = tiny_qwen2(seed=0, layers=3), tiny_qwen2(seed=1, layers=1, hidden=32)
    drafters = real_drafters(target, draft, CostCurve.linear(0.03))
    target_lm = drafters["target_lm"]()
    for i, prompt in enumerate(random_prompts(3, seed=4, low=8, high=40)):
        recorded = synthetic_run(prompt, 40, seed=i)
        continuation = settled_continuation(target_lm, drafters[method], recorded)
        assert continuation == reference_continuation(target_lm, prompt, 40)  # float32: no near-tie to settle
        engine, replayer = replay_engine(target_lm, drafters[method](), recorded, continuation)
        result = engine.generate(prompt, replay_config(recorded))
        assert replayer.accepted == [s.accepted for s in recorded.steps]
        assert [s.drafted for s in result.steps] == [s.drafted for s in recorded.steps]
        assert result.token_ids == continuation
        # asked at every step but the last, when no room is left to draft (the engine asks no drafter then)
        assert len(recorded.steps) - 1 <= len(replayer.proposed) <= len(recorded.steps)
        assert all(p == 0 for p, s in zip(replayer.proposed, recorded.steps) if s.aside)


def test_a_replayed_draft_puts_the_continuation_on_the_path_and_wrong_tokens_elsewhere():
    #        0     1     2
    #       / \    |
    #      3   4   5
    #      |
    #      6
    step = RecordedStep(7, 2, (-1, -1, -1, 0, 0, 2, 3), (0, 4))
    draft = replayed_draft(step, [10, 20, 30, 40], vocab=50, max_depth=8)
    assert draft.tokens.tolist() == [10, 11, 11, 21, 20, 21, 31]
    assert draft.parents is not None and draft.parents.tolist() == [-1, -1, -1, 0, 0, 2, 3]
    cut = replayed_draft(step, [10, 20, 30, 40], vocab=50, max_depth=2)  # room for two: node 6 left out
    assert cut.parents is not None and cut.parents.tolist() == [-1, -1, -1, 0, 0, 2]
    structure.check(cut.parents)
    chain = replayed_draft(RecordedStep(4, 1), [7, 8, 9, 49], vocab=50, max_depth=3)
    assert chain.tokens.tolist() == [7, 9, 10] and chain.parents is None


def test_the_cost_curve_prediction_by_hand():
    curve = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5}
    assert [relative_cost(curve, w) for w in (1, 3, 8, 16)] == [1.0, 1.2, 1.5, 3.0]
    # two steps: 3 tokens at width 5 (1.5) with 0.5 of a forward drafting; 1 token at width 1 (1.0), no drafting
    assert metrics.stepwise_speedup([3, 1], [1.5, 1.0], [0.5, 0.0]) == pytest.approx(4 / 3)


def test_a_recording_round_trips_through_its_file(tmp_path: Path):
    runs = [synthetic_run([1, 2, 3], 20, seed=1)]
    for name in ("r.json", "r.json.gz"):
        acceptance.save(tmp_path / name, runs, {"command": "x"})
        settings, loaded = acceptance.load(tmp_path / name)
        assert settings == {"command": "x"} and loaded == runs
