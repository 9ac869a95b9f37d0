"""Dynamic trees grown on the device (`tree.growth`, the policy off the CPU), checked on the CPU.

The same drafter grows the same tree either way when both grow the same number of rounds: the draft model's
tree and the EAGLE and EAGLE-3 heads' (the latter over a draft vocabulary of half the target's), on the dynamic
and the static path, greedy and sampled. A greedy tree after a sequence's first is also pruned on the device
and verified there (`Draft.layout`), read with its verdict: one read a greedy step, however deep the tree
(`test_syncs`' counting); its verification decides as the host's does; greedy output is plain decoding's, with
penalties, log-probabilities and a grammar too; and the number of rounds follows what the trees before paid.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import VOCAB, random_eagle3_head, random_eagle_head, random_prompts
from specdecode import devices
from specdecode.drafters import auto
from specdecode.drafters.composite import Source
from specdecode.drafters.draft_model_tree import FIRST_ROUNDS, DraftModelTreeDrafter
from specdecode.drafters.merging import beside, parents_of
from specdecode.drafters.eagle import EagleTreeDrafter
from specdecode.drafters.eagle3 import Eagle3TreeDrafter, eagle3_state
from specdecode.drafters.options import DrafterOptions
from specdecode.drafters.static_heads import eagle_state
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.models.hf import HFCausalLM
from specdecode.models.static import StaticCausalLM, pack, place
from specdecode.tree import structure
from specdecode.tree.growth import DeviceTree, layer_sizes, read_tree, select
from specdecode.types import DeviceLayout, Draft, SamplingParams
from specdecode.verify.tree import verify, verify_tree_greedy
from test_head_syncs import FLAT, recording
from test_syncs import GREEDY, PROMPT, SAMPLED, syncs_per_step, tracked

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only]  # the CPU plays the device

KINDS = ("draft", "eagle", "eagle3")
DEPTH = 5  # the trees' depth: four growing rounds after the root's children
PARAMS = pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
PATHS = pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])


def lm(model, static: bool) -> HFCausalLM:
    return StaticCausalLM(model) if static else HFCausalLM(model)


def drafter(kind: str, target_lm: HFCausalLM, on_host: bool, static: bool, draft_cost: float = 1e-9, **options):
    """A dynamic tree drafter of `kind` whose rounds always pay (a draft forward nearly free, a head's rounds
    timed by a clock that stands still), growing on the host or on the device."""
    options = dict(top_k=3, width=3, max_depth=DEPTH, budget=12) | options
    model = target_lm.model
    if kind == "draft":
        made = DraftModelTreeDrafter(lm(copy.deepcopy(model), static), FLAT, draft_cost=draft_cost, **options)
    elif kind == "eagle":
        head = random_eagle_head(model)
        made = EagleTreeDrafter(head, model, FLAT, draft_cost=draft_cost, state=eagle_state(head, target_lm),
                                clock=lambda: 0.0, **options)
    else:
        head = random_eagle3_head(model, vocab=VOCAB // 2)
        made = Eagle3TreeDrafter(head, model, FLAT, draft_cost=draft_cost, state=eagle3_state(head, target_lm),
                                 clock=lambda: 0.0, **options)
    made.grows_on_host = on_host
    return made


def recorded_drafts(engine: SpeculativeEngine, prompt: list[int], params, max_new_tokens: int = 24):
    """(the output, each step's draft as (tokens, parents, scores))."""
    drafts = recording(engine.drafter)
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, sampling=params, seed=0))
    return result.token_ids, [(d.tokens.tolist(), None if d.parents is None else d.parents.tolist(),
                               [] if d.scores is None else d.scores.tolist()) for d in drafts]


@pytest.mark.parametrize("kind", KINDS)
@PATHS
@PARAMS
def test_a_tree_grown_on_the_device_is_the_one_grown_on_the_host(tiny_target, kind, static, params):
    """Growing the same number of rounds (every round pays here, up to the depth), the device's tree has the
    host's nodes, in the host's order, with the host's scores, at every step of a whole generation."""
    assert_grown_alike(tiny_target, kind, static, params, budget=12)


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_tree_grown_on_the_device_is_the_one_grown_on_the_host(tiny_target, kind):
    """As above with a budget that keeps every node grown (3 + 4 * 9): the deepest nodes' tokens and scores, which
    a budget of 12 prunes, come of the draft's masks over four levels of ancestors."""
    assert_grown_alike(tiny_target, kind, False, GREEDY, budget=3 + (DEPTH - 1) * 9)


def assert_grown_alike(tiny_target, kind: str, static: bool, params, budget: int) -> None:
    runs = []
    for on_host in (True, False):
        target_lm = lm(tiny_target, static)
        tree = drafter(kind, target_lm, on_host, static, budget=budget)
        tree.rounds = DEPTH - 1
        runs.append(recorded_drafts(SpeculativeEngine(target_lm, drafter=tree, gate=False), PROMPT, params))
    (host_output, host), (device_output, device) = runs
    assert host_output == device_output and len(host) == len(device)
    assert max(len(parents or []) for _, parents, _ in host) == budget  # full trees: the budget's nodes
    for (tokens, parents, scores), (d_tokens, d_parents, d_scores) in zip(host, device):
        assert (tokens, parents) == (d_tokens, d_parents)
        assert scores == pytest.approx(d_scores, rel=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@PATHS
@PARAMS
def test_a_step_reads_the_device_once_however_deep_the_tree(tiny_target, kind, static, params):
    """A sequence's first tree grown on the device is read to choose how many nodes to keep (two reads with the
    verdict); every later one is pruned on the device and read with its verdict: one read a step, greedy or sampled
    (a seeded sequence's tree is matched against the tokens plain decoding samples: `sampling`), where the host's
    growth reads once per level (`test_head_syncs`)."""
    target_lm = tracked(tiny_target, static)
    tree = drafter(kind, target_lm, on_host=False, static=static)
    if kind == "draft":
        devices.track(tree.model)
    engine = SpeculativeEngine(target_lm, drafter=tree, gate=False)
    counts, events = syncs_per_step(engine, params)
    depths = [e.stats.draft_depth or 0 for e in events]
    assert max(depths) >= (3 if params.greedy else 2), depths  # trees of several levels (sampled ones score lower)
    first = next(i for i, e in enumerate(events) if e.stats.drafted)
    assert counts[first] == 2 and set(counts[first + 1 :]) == {1}, counts


@PATHS
@PARAMS
def test_auto_with_an_eagle3_head_reads_once_a_step(tiny_target, static, params):
    """`auto` where its head is EAGLE-3 (a `--head` given, or the one shipped): the head's tree grown and pruned on
    the device goes beside the copies' merged nodes, so a step reads once after the head's first tree, and the output
    is plain decoding's, greedy or sampled with a seed."""
    target_lm = tracked(tiny_target, static)
    head = drafter("eagle3", target_lm, on_host=False, static=static, budget=None)
    made = auto.compose([*auto.copy_sources(target_lm, DrafterOptions(), FLAT), Source(head, "expensive")], FLAT,
                        final_layer=tiny_target.config.num_hidden_layers)
    engine = SpeculativeEngine(target_lm, drafter=made)
    drafts = recording(made)
    counts, _ = syncs_per_step(engine, params, max_new_tokens=32)
    assert counts.count(2) == 1 and set(counts) == {1, 2}, counts  # the head's first tree read to size it
    assert any(d.layout is not None for d in drafts)
    config = GenerationConfig(max_new_tokens=32, sampling=params, seed=3)
    assert (engine.generate(PROMPT, config).token_ids
            == SpeculativeEngine(HFCausalLM(tiny_target)).generate(PROMPT, config).token_ids)


@pytest.mark.parametrize("kind", KINDS)
@PARAMS
def test_the_output_is_plain_decodings(tiny_target, kind, params):
    """Greedy, and sampled with a seed: the trees grown, pruned and verified on the device give plain decoding's
    tokens."""
    prompts = random_prompts(3, seed=11, low=6, high=20)
    plain = SpeculativeEngine(HFCausalLM(tiny_target))
    engine = SpeculativeEngine(target_lm := HFCausalLM(tiny_target),
                               drafter=drafter(kind, target_lm, on_host=False, static=False, budget=None))
    for number, prompt in enumerate(prompts):
        config = GenerationConfig(max_new_tokens=30, sampling=params, seed=number)
        result = engine.generate(prompt, config)
        assert result.token_ids == plain.generate(prompt, config).token_ids
        assert any(step.drafted for step in result.steps)


@pytest.mark.parametrize("kind", ["draft", "eagle3", "auto"])
def test_penalties_log_probabilities_and_a_grammar_see_the_tree_as_plain_decoding_does(kind):
    """What reads a tree's structure on the host (penalties, a constraint's masks and cuts) reads the device's as
    any device data; log-probabilities ride with the verdict. Each output, and its log-probabilities, is plain
    decoding's under the same settings. `auto`: its head's device tree beside its copies' nodes."""
    from conftest import TOKENS, auto_prototype, tiny_chat_qwen2, tiny_tokenizer
    from specdecode.constraints import Constraint

    tokenizer = tiny_tokenizer()
    target = tiny_chat_qwen2(len(TOKENS) + 10, layers=3)
    prompt = tokenizer.encode("the cat sat on the mat. the cat sat on the cat. a dog sat on the mat.")
    penalties = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2)
    grammar = Constraint.regex("(the cat|a dog)( sat on the (mat|cat))+")
    configs = [GenerationConfig(max_new_tokens=20, sampling=penalties), GenerationConfig(max_new_tokens=20, logprobs=2),
               GenerationConfig(max_new_tokens=20, constraint=grammar)]
    plain = SpeculativeEngine(HFCausalLM(target), tokenizer)
    target_lm = HFCausalLM(target)
    if kind == "auto":
        made = auto_prototype(target, reads_late=True)  # (its head on a GPU's policy)
    else:
        made = drafter(kind, target_lm, on_host=False, static=False, budget=None)
    engine = SpeculativeEngine(target_lm, tokenizer, drafter=made)
    for config in configs:
        engine.generate(prompt, config)  # a first tree, read: the later ones are kept on the device
        expected, result = plain.generate(prompt, config), engine.generate(prompt, config)
        assert result.token_ids == expected.token_ids
        if config.logprobs:  # (float32 over a wider forward: equal to its last digits)
            assert [(e.token, [t for t, _ in e.top]) for e in result.logprobs] == [
                (e.token, [t for t, _ in e.top]) for e in expected.logprobs]
            assert [e.logprob for e in result.logprobs] == pytest.approx([e.logprob for e in expected.logprobs],
                                                                         abs=1e-4)
        assert any(step.drafted for step in result.steps)


def test_the_device_verdict_is_the_hosts():
    """`verify_tree_on_device` accepts the path `verify_tree_greedy` accepts, with the same last token, bonus and
    riders, on random trees (siblings distinct, as top-k children are) whose target takes one of a node's children
    most of the time; and the tree's selection and ancestors made on the device are the host's
    (`structure.top_nodes`, `select`, `ancestor_mask`)."""
    generator = torch.Generator().manual_seed(0)
    vocab, accepted = 64, []

    def draw(high: int) -> int:
        return int(torch.randint(high, (1,), generator=generator))

    for _ in range(200):
        n = draw(29) + 1
        parents = torch.tensor([draw(i + 1) - 1 for i in range(n)])
        scores = torch.rand(n, generator=generator)
        for node in range(n):  # a score never grows from a parent to its child; a tie now and then
            if parents[node] >= 0:
                scores[node] = scores[parents[node]] * (1.0 if node % 7 == 0 else scores[node])
        tokens = torch.randperm(vocab, generator=generator)[:n]  # distinct
        budget = draw(n) + 1
        kept_tokens, kept_parents, kept_scores, above, depths = select(tokens, parents, scores, budget,
                                                                       int(structure.depths(parents).max()))
        keep = structure.top_nodes(parents, scores, budget)
        assert torch.equal(kept_parents, structure.select(parents, keep)) and torch.equal(kept_tokens, tokens[keep])
        assert torch.equal(above, structure.ancestor_mask(kept_parents))
        assert torch.equal(depths, structure.depths(kept_parents)) and torch.equal(kept_scores, scores[keep])
        logits = torch.randn(len(keep) + 1, vocab, generator=generator)
        children = structure.children(kept_parents)
        for row, kids in enumerate(children):  # row 0: the context's; row i + 1: node i's
            if kids and draw(10) < 7:
                logits[row, kept_tokens[kids[draw(len(kids))]]] += 10.0
        rider = torch.arange(3.0)
        host = verify_tree_greedy(logits, kept_tokens, kept_parents, (rider,))
        draft = Draft(tokens=kept_tokens, parents=kept_parents, layout=DeviceLayout(above, depths),
                      riders=(rider * 2,))
        device = verify(logits, draft, SamplingParams(), None, (rider,))
        assert device == host and draft.read == [[0.0, 2.0, 4.0]]
        accepted.append(host.num_accepted)
    assert max(accepted) >= 3 and min(accepted) == 0


def test_a_device_tree_beside_host_nodes_is_verified_as_one_forest():
    """`merging.beside` (how `auto` verifies its head's device tree with its copies' nodes unread): the forest keeps
    each part's structure under the context, its device layout is the forest's own (`ancestor_mask`, `depths`), and
    its verdict accepts the longest path that follows the target (where both parts propose one path, the deeper
    copy of it; the host's walk takes the first and may stop short), with the tree's riders, then the forest's
    tokens, read in the same transfer."""
    generator = torch.Generator().manual_seed(1)
    vocab = 8  # few tokens: the two parts often propose the same paths

    def draw(high: int) -> int:
        return int(torch.randint(high, (1,), generator=generator))

    def random_tree(n: int) -> tuple[torch.Tensor, torch.Tensor]:  # (tokens, parents), siblings distinct
        parents, tokens = [], []
        for i in range(n):
            parent = draw(i + 1) - 1
            taken = {t for t, p in zip(tokens, parents) if p == parent}
            free = [t for t in range(vocab) if t not in taken]
            if not free:
                break
            parents.append(parent)
            tokens.append(free[draw(len(free))])
        return torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)

    accepted_beside = 0
    for trial in range(200):
        tokens, parents = random_tree(draw(12) + 1)
        scores = torch.rand(len(tokens), generator=generator)
        tree = Draft(tokens=tokens, parents=parents, scores=scores, riders=(scores * 2,),
                     layout=DeviceLayout(structure.ancestor_mask(parents), structure.depths(parents)))
        other_tokens, other_parents = random_tree(draw(6))
        chain = trial % 3 == 0  # a copy's chain, or a merged trie
        other = Draft(tokens=other_tokens if not chain else torch.randint(vocab, (4,), generator=generator),
                      parents=None if chain else other_parents)
        forest = beside(tree, other)
        first = len(tree)
        assert forest.parents is not None and forest.layout is not None
        expected_parents = torch.cat([parents, torch.where(parents_of(other) < 0, -1, parents_of(other) + first)])
        assert torch.equal(forest.parents, expected_parents)
        assert torch.equal(forest.layout.ancestors, structure.ancestor_mask(expected_parents))
        assert torch.equal(forest.layout.depths, structure.depths(expected_parents))
        assert torch.equal(forest.tokens, torch.cat([tokens, other.tokens]))
        # the target's next token is a function of the path (two nodes of one path have the same row), mostly a child
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(forest.tokens.tolist(), expected_parents.tolist()):
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        following: dict[tuple[int, ...], int] = {}
        for path in [(), *paths]:
            if path not in following:
                kids = [p[-1] for p in paths if p[:-1] == path]
                following[path] = kids[draw(len(kids))] if kids and draw(10) < 8 else draw(vocab)
        logits = torch.zeros(len(forest) + 1, vocab)
        for row, path in enumerate([(), *paths]):
            logits[row, following[path]] = 1.0
        greedy = [following[()]]
        while tuple(greedy) in following:
            greedy.append(following[tuple(greedy)])
        deepest = max((len(path) for path in paths if list(path) == greedy[: len(path)]), default=0)
        device = verify(logits, forest, SamplingParams(), None)
        assert device.num_accepted == deepest and list(device.tokens) == greedy[: deepest + 1]  # the longest path
        assert [paths[node] for node in device.path] == [tuple(greedy[:k]) for k in range(1, deepest + 1)]
        host = verify_tree_greedy(logits, forest.tokens, expected_parents)  # (the first of two same paths)
        assert host.num_accepted <= deepest and list(host.tokens[:-1]) == greedy[: host.num_accepted]
        assert forest.read == [(scores * 2).tolist(), forest.tokens.tolist()]
        accepted_beside += bool(device.path) and device.path[-1] >= first
    assert accepted_beside > 10  # paths through the host nodes were accepted too


def test_the_rounds_follow_what_the_trees_before_paid(tiny_target):
    """A sequence's first tree grows FIRST_ROUNDS rounds. A round that costs nothing always pays: the rounds then
    grow by one a step up to max_depth - 1. A round that costs ten target forwards never does: the next tree is
    the root's children alone."""
    target_lm = HFCausalLM(tiny_target)
    cheap = drafter("draft", target_lm, on_host=False, static=False, budget=None, max_depth=FIRST_ROUNDS + 3)
    engine = SpeculativeEngine(target_lm, drafter=cheap, gate=False)
    seen = []
    propose = cheap.propose
    cheap.propose = lambda *args: (seen.append(cheap.rounds), propose(*args))[1]
    engine.generate(PROMPT, GenerationConfig(max_new_tokens=20))
    most = FIRST_ROUNDS + 2
    assert seen[:3] == [FIRST_ROUNDS, FIRST_ROUNDS + 1, most] and set(seen[3:]) == {most}
    dear = drafter("draft", target_lm, on_host=False, static=False, budget=None, draft_cost=10.0)
    engine = SpeculativeEngine(target_lm, drafter=dear, gate=False)
    result = engine.generate(PROMPT, GenerationConfig(max_new_tokens=8))
    assert dear.rounds == 0 and max(step.draft_depth or 0 for step in result.steps[1:]) <= 1


def test_what_is_written_on_the_device_is_what_is_packed_on_the_host():
    """`place` writes positions and a mask into inputs packed without them as `pack` packs them on the host."""
    generator = torch.Generator().manual_seed(0)
    for n, m, width in [(3, 3, 4), (3, 9, 4), (5, 20, 8), (1, 1, 1)]:
        mask, positions = torch.rand(n, m, generator=generator) > 0.5, torch.randperm(n, generator=generator) + 50
        blank = pack(40, n, width, torch.zeros(n, dtype=torch.long), torch.zeros(n, m, dtype=torch.bool))
        assert torch.equal(place(blank.clone(), n, width, positions, mask), pack(40, n, width, positions, mask))
        assert torch.equal(place(pack(40, n, width, positions, torch.zeros(n, m, dtype=torch.bool)), n, width, None,
                                 mask), pack(40, n, width, positions, mask))


def test_a_device_tree_drops_what_the_distribution_excluded():
    """Nodes scoring 0 (a token the processed distribution excludes) and their children are dropped on reading;
    the rest keep their order, with parents renumbered."""
    tree = DeviceTree(torch.tensor([0.6, 0.4, 0.0]), torch.tensor([5, 6, 7]), width=2, rounds=1)
    tokens, parents, mask = tree.expand()
    assert tokens.tolist() == [5, 6] and parents is None and mask.tolist() == [[True, False], [False, True]]
    tree.add(torch.tensor([[0.5, 0.0], [1.0, 0.0]]), torch.tensor([[8, 9], [10, 11]]))
    sizes = layer_sizes(3, 2, 2, 1)
    assert sizes == [3, 4] and layer_sizes(3, 3, 4, 2) == [3, 9, 12]  # a round expands no more nodes than it has
    assert read_tree(*tree.nodes(), sizes) == ([5, 6, 8, 10], [-1, -1, 0, 1], pytest.approx([0.6, 0.4, 0.3, 0.4]),
                                               [0, 2])


@pytest.mark.parametrize("kind", [*KINDS, "eagle-chain", "medusa-chain", "medusa-tree"])
@PATHS
def test_no_tensor_of_the_devices_policy_lands_on_the_wrong_device(tiny_target, kind, static):
    """Every tensor the trees grown on the device (and the chains and Medusa's drafts read with their verdicts) make
    without naming a device goes to `meta` (`conftest.wrong_device_trap`): one made on the host where the model's
    device was meant fails here on the CPU as it would on a GPU. Greedy output is still plain decoding's, sampled
    runs through and gives plain decoding's sampled tokens."""
    from conftest import random_medusa_heads, wrong_device_trap
    from specdecode.drafters.eagle import EagleDrafter
    from specdecode.drafters.medusa import MedusaDrafter

    target_lm = lm(tiny_target, static)
    if kind.startswith("medusa"):
        made = MedusaDrafter(random_medusa_heads(tiny_target), tiny_target, FLAT, tree=kind == "medusa-tree",
                             runner="eager" if static else None)
        made.reads_late = True
    elif kind == "eagle-chain":
        head = random_eagle_head(tiny_target)
        made = EagleDrafter(head, tiny_target, max_tokens=5, min_confidence=0.001, state=eagle_state(head, target_lm))
        made.stops_early, made.reads_late = False, True
    else:
        made = drafter(kind, target_lm, on_host=False, static=static, budget=None)
    engine = SpeculativeEngine(target_lm, drafter=made, gate=False)
    plain = SpeculativeEngine(lm(tiny_target, static))
    config = GenerationConfig(max_new_tokens=16)
    expected = plain.generate(PROMPT, config).token_ids
    sampled_config = GenerationConfig(max_new_tokens=8, sampling=SAMPLED, seed=1)
    expected_sampled = plain.generate(PROMPT, sampled_config).token_ids
    with wrong_device_trap():
        greedy = engine.generate(PROMPT, config)
        sampled = engine.generate(PROMPT, sampled_config)
    assert greedy.token_ids == expected and sum(step.drafted for step in greedy.steps) > 0
    assert sampled.token_ids == expected_sampled
