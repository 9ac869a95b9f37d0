"""Host reads per step of the trained heads' drafting (EAGLE, EAGLE-3, Medusa), counted on the CPU as
`test_syncs` counts the engine's: the heads compute on the tracked target's hidden states, so what they
draft stands for device data too, and each read of it on the host counts.

The budgets: a head's chain drafted on the device (as off the CPU) is read once, so a step reads twice
with its verification; stopping early (on the CPU) reads one probability per token drafted; a head's
tree reads each level it grows once; Medusa reads its heads' guesses once.
"""

from __future__ import annotations

import pytest

from conftest import FLAT, auto_prototype, random_eagle3_head, random_eagle_head, random_medusa_heads
from specdecode import devices
from specdecode.drafters.eagle import EagleDrafter, EagleTreeDrafter
from specdecode.drafters.eagle3 import Eagle3Drafter, Eagle3TreeDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.verify.typical import verify_typical
from test_syncs import GREEDY, PROMPT, SAMPLED, syncs_per_step, tracked

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only]  # the CPU's stand-in for a device

CHAINS = {"eagle": (EagleDrafter, random_eagle_head), "eagle3": (Eagle3Drafter, random_eagle3_head)}
TREES = {"eagle": (EagleTreeDrafter, random_eagle_head), "eagle3": (Eagle3TreeDrafter, random_eagle3_head)}
PARAMS = pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])


def head_chain(kind: str, target, stops_early: bool) -> EagleDrafter:
    """A head's chain of up to 5 tokens, cut where its confidence falls under 0.01 (after 1 or 2 tokens
    with these random heads: the cut is exercised), read as on the CPU (`stops_early`) or as elsewhere."""
    drafter_class, head = CHAINS[kind]
    drafter = drafter_class(head(target), target, max_tokens=5, min_confidence=0.01)
    drafter.stops_early = stops_early  # (the test picks the policy: the CPU's or a GPU's)
    return drafter


def recording(drafter) -> list:
    """The list each of the drafter's proposals is appended to from now on."""
    drafts, propose = [], drafter.propose

    def recorded(*args):
        drafts.append(propose(*args))
        return drafts[-1]

    drafter.propose = recorded
    return drafts


def drafts_and_syncs_of(engine: SpeculativeEngine, params=GREEDY, max_new_tokens: int = 24):
    """(each step's draft, each step's host reads)."""
    drafts = recording(engine.drafter)
    counts, _ = syncs_per_step(engine, params, max_new_tokens)
    return drafts, counts


def drafts_and_syncs(engine: SpeculativeEngine, params, max_new_tokens: int = 24):
    """(each step's draft as (tokens, scores) lists, each step's host reads), the drafts read on the host
    only after the count."""
    drafts, counts = drafts_and_syncs_of(engine, params, max_new_tokens)
    return [(d.tokens.tolist(), [] if d.scores is None else d.scores.tolist()) for d in drafts], counts


@pytest.mark.parametrize("kind", CHAINS)
@PARAMS
def test_a_head_chain_drafted_on_the_device_is_read_once(tiny_target, kind, params):
    """Off the CPU the chain is drafted whole on the device: one read for the draft, one to verify it."""
    engine = SpeculativeEngine(tracked(tiny_target), drafter=head_chain(kind, tiny_target, stops_early=False),
                               gate=False)
    drafts, counts = drafts_and_syncs(engine, params)
    assert any(tokens for tokens, _ in drafts)
    assert counts[0] == 1 and max(counts) == 2, counts  # the first step: no features yet, verification alone


@pytest.mark.parametrize("kind", CHAINS)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@PARAMS
def test_a_head_chain_read_with_its_verdict_reads_once(tiny_target, kind, static, params):
    """Off the CPU a chain after a sequence's first is drafted without a read, as long as the one before stayed
    confident, and verified whole: its probabilities come with the verdict, one read a step; the output is plain
    decoding's, greedy or sampled with a seed (matched against the tokens plain decoding samples: `sampling`)."""
    from specdecode.drafters.eagle3 import eagle3_state
    from specdecode.drafters.static_heads import eagle_state
    from specdecode.models.hf import HFCausalLM
    from specdecode.models.static import StaticCausalLM

    target_lm = tracked(tiny_target, static)
    drafter_class, random_head = CHAINS[kind]
    head = random_head(tiny_target)
    state = (eagle_state if kind == "eagle" else eagle3_state)(head, target_lm)
    drafter = drafter_class(head, tiny_target, max_tokens=6, min_confidence=0.001, state=state)
    drafter.stops_early, drafter.reads_late = False, True  # a GPU's policy
    drafts, counts = drafts_and_syncs(SpeculativeEngine(target_lm, drafter=drafter, gate=False), params)
    first = next(i for i, (tokens, _) in enumerate(drafts) if tokens)
    assert counts[first] == 2 and set(counts[first + 1 :]) == {1}, counts
    assert all(scores == [] for _, scores in drafts[first + 1 :])  # verified whole: no scores for the gate
    assert len({len(tokens) for tokens, _ in drafts[first + 1 :]}) > 1  # lengths follow the confidence
    plain = (StaticCausalLM if static else HFCausalLM)(tiny_target)
    config = GenerationConfig(max_new_tokens=24, sampling=params, seed=3)
    assert (SpeculativeEngine(target_lm, drafter=drafter).generate(PROMPT, config).token_ids
            == SpeculativeEngine(plain).generate(PROMPT, config).token_ids)


@pytest.mark.parametrize("kind", CHAINS)
def test_stopping_early_drafts_the_chain_the_device_cuts(tiny_target, kind):
    """Read token by token (the CPU's way) or whole and cut afterwards (a GPU's way), a head drafts the same
    chains with the same scores; token by token, a step reads the probability of each token it drafts and
    of the one that stopped it, and verifies with one more read."""
    early, early_counts = drafts_and_syncs(
        SpeculativeEngine(tracked(tiny_target), drafter=head_chain(kind, tiny_target, True), gate=False), GREEDY)
    whole, _ = drafts_and_syncs(
        SpeculativeEngine(tracked(tiny_target), drafter=head_chain(kind, tiny_target, False), gate=False), GREEDY)
    assert early == whole
    lengths = [len(tokens) for tokens, _ in early]
    assert 0 < max(lengths) < 5  # cut by the confidence, not by max_tokens
    assert all(count <= length + 2 for count, length in zip(early_counts, lengths)), (early_counts, lengths)


@pytest.mark.parametrize("kind", TREES)
@PARAMS
def test_a_head_tree_reads_each_level_once(tiny_target, kind, params):
    """Growing EAGLE-2's tree, the head's children of each level reach the host in one read (`_add_children`,
    called once per level) and nothing else of the drafting is read; verification reads once more, greedy or
    sampled (a seeded sequence's tree is matched against the tokens plain decoding samples: `sampling`)."""
    drafter_class, head = TREES[kind]
    drafter = drafter_class(head(tiny_target), tiny_target, FLAT, draft_cost=0.001, top_k=2, width=2, max_depth=4)
    levels, add_children = [0], drafter._add_children

    def counted(*args):
        levels[-1] += 1
        return add_children(*args)

    drafter._add_children = counted
    engine = SpeculativeEngine(tracked(tiny_target), drafter=drafter, gate=False)
    config = GenerationConfig(max_new_tokens=24, sampling=params, seed=0)
    counts, depths = [], []
    with devices.SyncCounter("cpu") as counter:
        for event in engine.stream(PROMPT, config):
            counts.append(counter.total)
            depths.append(event.stats.draft_depth or 0)
            levels.append(0)
            counter.reset()
    levels.pop()
    assert max(levels) >= 3  # trees grew past their first level
    for count, grown in zip(counts, levels):
        assert count == grown + 1, (counts, levels, depths)


@PARAMS
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_medusa_reads_its_heads_guesses_once(tiny_target, tree, params):
    """A Medusa chain reads its scores once (the engine's gate cuts it by them, the calibration learns from
    them), a tree its heads' top-k once; verification once more."""
    drafter = MedusaDrafter(random_medusa_heads(tiny_target), tiny_target, FLAT, tree=tree)
    engine = SpeculativeEngine(tracked(tiny_target), drafter=drafter)  # the gate cuts a chain by its scores
    drafts, counts = drafts_and_syncs(engine, params)
    assert any(tokens for tokens, _ in drafts)
    assert max(counts) == 2, counts  # greedy or sampled: a seeded sequence's tree is matched in one read


def token_paths(draft) -> set[tuple[int, ...]]:
    """A tree draft's nodes as the token paths that lead to them (none: an empty draft)."""
    if draft.parents is None:
        return set()
    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return set(paths)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("runner", [None, "eager"], ids=["dynamic", "static"])
@PARAMS
def test_medusa_read_with_its_verdict_reads_once(tiny_target, tree, runner, params):
    """Off the CPU, Medusa's chain is verified whole and its tree made, pruned and verified on the device (after a
    sequence's first tree, read to size it), their scores read with the verdict: one read a step, greedy or sampled
    with a seed. The tree has the host's best-first nodes (a fixed budget), and the output is plain decoding's."""
    from specdecode.models.hf import HFCausalLM

    heads = random_medusa_heads(tiny_target)
    drafters = []
    for reads_late in (False, True):
        drafter = MedusaDrafter(heads, tiny_target, FLAT, tree=tree, budget=12 if tree else None, runner=runner)
        drafter.reads_late = reads_late
        drafters.append(drafter)
    (host, _), (late, counts) = (drafts_and_syncs_of(SpeculativeEngine(tracked(tiny_target), drafter=d), params)
                                 for d in drafters)
    first = next(i for i, draft in enumerate(late) if len(draft))
    assert counts[first] == (2 if tree else 1) and set(counts[first + 1 :]) == {1}, counts
    if tree:
        assert all(d.layout is not None for d in late[first + 1 :])
        assert [token_paths(d) for d in host] == [token_paths(d) for d in late]
    config = GenerationConfig(max_new_tokens=24, sampling=params, seed=3)
    assert (SpeculativeEngine(tracked(tiny_target), drafter=drafters[1]).generate(PROMPT, config).token_ids
            == SpeculativeEngine(HFCausalLM(tiny_target)).generate(PROMPT, config).token_ids)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_batchs_heads_are_read_once_a_step_for_all_its_sequences(tiny_target, tree):
    """In the batch engine Medusa's heads run for its sequences in one call (`BatchedHeads`) whose top-k reach the
    host in one transfer: after each sequence's first head step, a step of n sequences reads n + 1 times (each
    verification, and the heads once) where it read 2n; each sequence's output is its plain decoding's."""
    from specdecode.engine.batch import BatchEngine
    from specdecode.models.hf import HFCausalLM

    made = MedusaDrafter(random_medusa_heads(tiny_target), tiny_target, FLAT, tree=tree)
    engine = BatchEngine(tracked(tiny_target))
    prompts = [PROMPT[3 * k :] for k in range(4)]
    config = GenerationConfig(max_new_tokens=16)
    idents = [engine.add(prompt, config, made.for_sequence(), "medusa") for prompt in prompts]
    counts, outputs = [], {}
    while len(engine):
        with devices.SyncCounter("cpu") as counter:
            stepped = engine.step()
        counts.append((counter.total, len({ident for ident, _, _ in stepped})))
        outputs |= {ident: result.token_ids for ident, _, result in stepped if result is not None}
    assert all(reads <= sequences + 1 for reads, sequences in counts[2:]), counts
    assert counts[2] == (5, 4), counts
    plain = SpeculativeEngine(HFCausalLM(tiny_target))
    assert [outputs[ident] for ident in idents] == [plain.generate(p, config).token_ids for p in prompts]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@PARAMS
def test_auto_verifies_its_heads_tree_beside_the_copies_in_one_read(tiny_target, static, params):
    """Off the CPU `auto`'s head keeps its tree on the device, and the composite verifies it beside the copies'
    merged nodes as one forest (`merging.beside`) without reading it: after the head's first tree (read to size
    it) a step reads the device once, greedy or sampled with a seed, and the output is plain decoding's, with no
    tensor made on the wrong device (`conftest.wrong_device_trap`)."""
    from conftest import wrong_device_trap
    from specdecode.models.hf import HFCausalLM

    made = auto_prototype(tiny_target, reads_late=True)  # (the test picks a GPU's policy)
    head = made.sources[-1].drafter
    engine = SpeculativeEngine(tracked(tiny_target, static), drafter=made)
    drafts, trees = recording(made), recording(head)
    counts, _ = syncs_per_step(engine, params, max_new_tokens=32)
    assert counts.count(2) == 1 and set(counts) == {1, 2}, counts  # the head's first tree read to size it
    forests = [(d, next(t for t in trees if t.riders and d.riders[0] is t.riders[0]))
               for d in drafts if d.layout is not None]
    assert any(len(forest) > len(tree) for forest, tree in forests)  # copies beside the head's tree
    config = GenerationConfig(max_new_tokens=32, sampling=params, seed=3)
    with wrong_device_trap():
        output = engine.generate(PROMPT, config)
    assert output.token_ids == SpeculativeEngine(HFCausalLM(tiny_target)).generate(PROMPT, config).token_ids
    assert sum(step.accepted for step in output.steps) > 0 or not params.greedy  # (sampled: rarely a copy)


@pytest.mark.parametrize("reads_late", [False, True], ids=["read-first", "read-late"])
def test_typical_acceptance_reads_twice(tiny_target, reads_late):
    """Typical acceptance reads the nodes' tokens, probabilities and thresholds together, then the token it
    samples after the accepted path; with Medusa's tree read once, a step reads three times; with the tree left on
    the device (a GPU's policy), its structure and scores come with typical acceptance's first read: twice."""
    drafter = MedusaDrafter(random_medusa_heads(tiny_target), tiny_target, FLAT, tree=True)
    drafter.reads_late = reads_late
    engine = SpeculativeEngine(tracked(tiny_target), drafter=drafter, gate=False, verifier=verify_typical)
    drafts, counts = drafts_and_syncs(engine, SAMPLED)
    assert any(tokens for tokens, _ in drafts)
    assert counts[0] == 1, counts  # the first step: no feature yet, no draft
    if not reads_late:
        assert max(counts) == 3, counts
    else:  # the first tree read to size the next (three reads), the later ones with the verdict
        first = next(i for i, (tokens, _) in enumerate(drafts) if tokens)
        assert counts[first] == 3 and set(counts[first + 1 :]) <= {1, 2} and 2 in counts[first + 1 :], counts
