"""The llama.cpp backend on a tiny random Qwen2 written as a float32 GGUF: logits like transformers',
tree verification through sequence ids, compaction, and greedy speculative == greedy plain for every
drafter it runs. Skipped when llama-cpp-python is not installed (`pip install specdecode[llamacpp]`)."""

from __future__ import annotations

import pytest
import torch

from conftest import TOKENS, noisy_copy, random_prompts, tiny_chat_qwen2, tiny_qwen2, write_tiny_gguf
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.draft_model_tree import DraftModelTreeDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupTreeDrafter
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.models.costs import CostCurve
from specdecode.models.llamacpp import tree_sequences
from specdecode.tree import structure

VOCAB = len(TOKENS)
CURVE = CostCurve.linear(0.5)


def test_tree_sequences_reproduce_the_mask():
    # pending token p, then nodes a (root child), b (child of a), c (root child), d (child of a)
    parents = torch.tensor([-1, 0, -1, 0])
    _, mask = structure.verification_inputs(parents, num_pending=1, context_length=5)
    seqs = tree_sequences(mask)
    leaves = {1: "b", 2: "c", 3: "d"}  # one sequence per leaf, in node order
    assert seqs == [[1, 2, 3], [1, 3], [1], [2], [3]]
    assert len(leaves) == 3
    assert tree_sequences(torch.ones(4, 4, dtype=torch.bool).tril()) is None  # a chain
    with pytest.raises(ValueError):
        tree_sequences(torch.tensor([[1, 0, 1], [0, 1, 0], [0, 0, 1]], dtype=torch.bool))  # attends ahead


llama_cpp = pytest.importorskip("llama_cpp")

from specdecode.models.llamacpp import LlamaCppLM  # noqa: E402


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    target = tiny_chat_qwen2(vocab_size=VOCAB, seed=5)
    write_tiny_gguf(target, folder / "target.gguf")
    write_tiny_gguf(noisy_copy(target, 0.3, 1), folder / "draft.gguf")
    return target, folder / "target.gguf", folder / "draft.gguf"


def test_logits_match_transformers(tiny_pair):
    model, path, _ = tiny_pair
    lm = LlamaCppLM(path, n_ctx=128)
    prompt = [5, 70, 200, 31, 9, 44]
    ours = lm.forward(torch.tensor(prompt)).logits  # [6, vocab]
    with torch.no_grad():
        theirs = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=2e-3)
    step = lm.forward(torch.tensor([12])).logits[0]
    with torch.no_grad():
        expected = model(torch.tensor([prompt + [12]])).logits[0, -1]
    torch.testing.assert_close(step, expected, atol=2e-3, rtol=2e-3)
    assert lm.cache_length == 7 and lm.vocab_size == VOCAB


PREFIX = [3, 14, 15, 92, 65]
PARENTS = torch.tensor([-1, 0, -1, 2, 0])  # a, b (of a), c, d (of c), e (of a)
NODES = torch.tensor([7, 8, 9, 10, 11])
PATHS = {0: [7], 1: [7, 8], 2: [9], 3: [9, 10], 4: [7, 11]}  # each node's tokens from the root


def tree_fed(path) -> tuple[LlamaCppLM, torch.Tensor]:
    """A model that has fed PREFIX and then the tree (PARENTS, NODES) in one forward, and that forward's logits."""
    lm = LlamaCppLM(path, n_ctx=128)
    lm.forward(torch.tensor(PREFIX[:-1]))
    positions, mask = structure.verification_inputs(PARENTS, num_pending=1, context_length=len(PREFIX))
    return lm, lm.forward(torch.cat([torch.tensor(PREFIX[-1:]), NODES]), positions=positions, tree_mask=mask).logits


def test_tree_nodes_match_sequential_paths_and_compaction(tiny_pair):
    _, path, _ = tiny_pair
    _, logits = tree_fed(path)
    fresh = LlamaCppLM(path, n_ctx=128)
    for node, tokens_on_path in PATHS.items():
        fresh.reset()
        expected = fresh.forward(torch.tensor(PREFIX + tokens_on_path), num_logits=1).logits[0]
        torch.testing.assert_close(logits[node + 1], expected, atol=1e-4, rtol=1e-4)
    # keep the path c -> d (nodes 2, 3), whose every branch holds d, and a -> e (0, 4), where a's first branch (b's
    # leaf) does not hold e: the cache continues like a fresh prefill of PREFIX and the path's tokens
    for kept in ([2, 3], [0, 4]):
        lm, _ = tree_fed(path)
        lm.compact(len(PREFIX), kept)
        assert lm.cache_length == len(PREFIX) + 2
        fresh.reset()
        fresh.forward(torch.tensor(PREFIX + PATHS[kept[-1]]))
        # (as tight as the float arithmetic allows: with flash attention it was 1e-3 apart, a near-tie's flip)
        torch.testing.assert_close(lm.forward(torch.tensor([4])).logits, fresh.forward(torch.tensor([4])).logits,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["pld", "pld-tree", "draft", "draft-fixed-length"])
def test_greedy_speculative_equals_plain(tiny_pair, kind):
    _, target_path, draft_path = tiny_pair
    target = LlamaCppLM(target_path, n_ctx=128)
    drafter = {
        "pld": lambda: PromptLookupDrafter(max_ngram=2, num_tokens=5),
        "pld-tree": lambda: PromptLookupTreeDrafter(CURVE, max_ngram=2, num_tokens=5),
        "draft": lambda: DraftModelDrafter(LlamaCppLM(draft_path, n_ctx=128), num_tokens=4, draft_cost=0.4,
                                           curve=CURVE),
        "draft-fixed-length": lambda: DraftModelDrafter(
            LlamaCppLM(draft_path, n_ctx=128), num_tokens=5, adaptive=False, confidence_threshold=0
        ),
    }[kind]()
    plain = SpeculativeEngine(target)
    spec = SpeculativeEngine(target, drafter=drafter)
    drafted = 0
    for prompt in random_prompts(8, seed=9, vocab=VOCAB):
        config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
        reference = plain.generate(prompt, config).token_ids
        result = spec.generate(prompt, config)
        assert result.token_ids == reference
        drafted += sum(s.drafted for s in result.steps)
    assert drafted > 0


def test_trees_after_a_prompt_longer_than_one_decode(tmp_path):
    """On the first step a tree method's forward carries the whole prompt before its tree; a prompt longer
    than one llama_decode batch (512 tokens) is decoded as a chain first, then the tree."""
    from specdecode.drafters.lookahead import LookaheadDrafter
    from specdecode.models.llamacpp import MAX_BATCH

    model = tiny_qwen2(seed=7, vocab=VOCAB, max_positions=1024)
    write_tiny_gguf(model, tmp_path / "long.gguf")
    target = LlamaCppLM(tmp_path / "long.gguf", n_ctx=1024)
    phrase = random_prompts(1, seed=3, low=40, high=41, vocab=VOCAB)[0]
    prompt = (phrase * 20)[:MAX_BATCH + 190]  # repeats itself: prompt lookup drafts on the first step
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    reference = SpeculativeEngine(target).generate(prompt, config).token_ids
    for drafter in (PromptLookupTreeDrafter(CURVE, max_ngram=3, num_tokens=5), LookaheadDrafter(max_context=1024)):
        result = SpeculativeEngine(target, drafter=drafter).generate(prompt, config)
        assert result.token_ids == reference, drafter.name
        assert result.steps[0].forward_tokens > MAX_BATCH
    assert result.steps[0].auxiliary_tokens > 0  # lookahead's window rode in the first forward


def test_draft_model_tree_is_a_clear_error(tiny_pair):
    _, target_path, draft_path = tiny_pair
    drafter = DraftModelTreeDrafter(LlamaCppLM(draft_path, n_ctx=128), CURVE, choices=[(0,), (0, 0), (0, 0, 0)])
    engine = SpeculativeEngine(LlamaCppLM(target_path, n_ctx=128), drafter=drafter)
    with pytest.raises(UserError, match="cannot grow"):
        engine.generate([1, 2, 3, 4], GenerationConfig(max_new_tokens=8))
    # the method's own builder refuses both tree forms before a step (a grown tree failed mid-answer, a traceback)
    from specdecode.drafters.draft_model_tree import build_draft_model
    from specdecode.drafters.options import DrafterOptions

    draft, target = LlamaCppLM(draft_path, n_ctx=128), LlamaCppLM(target_path, n_ctx=128)
    for options in (DrafterOptions(tree=True), DrafterOptions(tree=True, choices=((0,), (0, 0)))):
        with pytest.raises(UserError, match="draft-tree grows its tree in the draft model's own cache"):
            build_draft_model(target, draft, options)
    assert build_draft_model(target, draft, DrafterOptions()) is not None  # the chain runs


@pytest.mark.slow
def test_real_pair_greedy_speculative_equals_plain_on_llamacpp():
    """The default pair's GGUF files as they are (Q4_K_M) in llama.cpp: every method this backend runs
    gives plain greedy decoding's tokens, or parts from them only at a near-tie. llama.cpp's decode of a
    batch of tokens rounds differently from one-token decodes (its Q4 kernels take 4 rows at a time), so
    a top-1/top-2 margin of a few hundredths can flip; a bug would part at a large margin. The cost
    curves are fixed (tests/conftest.py), so which batches are formed does not follow the machine's load."""
    from specdecode.api import load_models
    from specdecode.bench.exactness import diagnose

    models = load_models(backend="llamacpp", progress=False)
    config = GenerationConfig(max_new_tokens=24)  # short: the real-pair tests share CI's 20 minutes with the rest
    identical = 0
    for prompt in ["Write a Python function that returns the n-th Fibonacci number.",
                   "Rename the variable x to count and return the code:\n\nx = 0\nfor item in items:\n    x += 1\n"]:
        ids = models.encode(prompt, chat=True)
        plain = models.engine("ar").generate(ids, config)
        assert plain.new_tokens > 10
        for name in ["draft", "pld", "pld-tree", "lookahead"]:
            result = models.engine(name).generate(ids, config)
            divergence = diagnose(models.target, ids, plain.token_ids, result.token_ids)
            assert divergence is None or divergence.likely_tie, f"{name}: {divergence.describe()}"
            identical += divergence is None
    assert identical >= 4  # near-ties are rare: most runs are identical


def test_cli_generate_on_llamacpp(tiny_pair, tiny_folder, monkeypatch, capsys):
    import json
    import sys

    from specdecode.cli import main

    _, target_path, draft_path = tiny_pair

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["specdecode", "generate", "the the the", "--backend", "llamacpp", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        out, err = capsys.readouterr()
        return exit_info.value.code or 0, out, err

    common = ["--target", str(target_path), "--drafter", str(draft_path), "--json", "--max-new-tokens", "12"]
    code, plain, _ = run("--method", "ar", *common)
    assert code == 0
    for method in (["--method", "pld", "--tree"], ["--method", "pld-tree"], ["--method", "draft"]):
        code, out, _ = run(*method, *common)
        assert code == 0 and json.loads(out)["token_ids"] == json.loads(plain)["token_ids"]
    code, _, err = run("--method", "ar", "--target", str(tiny_folder))  # a folder, not a .gguf
    assert code == 2 and "Traceback" not in err and "gguf" in err
    code, _, err = run("--method", "ar", "--target", "/nowhere/target.gguf")  # said as a missing file
    assert code == 2 and "no such file: /nowhere/target.gguf" in " ".join(err.split()), err
    # a method llama.cpp cannot run is refused before anything loads (here, a target that is not there)
    for method, words in (("eagle3", "hidden states"), ("draft-tree", "draft model's own cache")):
        code, _, err = run("--method", method, "--target", "/nowhere/target.gguf")
        assert code == 2 and words in " ".join(err.split()) and "--backend torch" in err, err


def test_a_llamacpp_server_offers_what_llamacpp_runs(tiny_pair):
    """The methods a llama.cpp server offers (and lists in its refusals) are those the backend runs."""
    from specdecode.api import load_models
    from specdecode.methods import choose, variant_names
    from specdecode.serve.offer import Offer

    _, target_path, draft_path = tiny_pair
    models = load_models(str(target_path), str(draft_path), backend="llamacpp", progress=False)
    names = Offer.resolve(models, "pld", None).names()
    assert {"pld", "pld-tree", "draft", "auto", "composite-tree"} <= set(names)
    assert names == [name for name in variant_names() if choose(name).runs_on("llamacpp")]
    assert not {"eagle3", "medusa-tree", "layerskip", "sparse-kv", "draft-tree"} & set(names)


def test_cli_bench_on_llamacpp(tiny_pair, tmp_path, monkeypatch, capsys):
    """`specdecode bench --backend llamacpp` runs to its report (it once ended in a traceback there, asking the
    llama.cpp model for the torch path's precision)."""
    import sys

    from specdecode.bench import main as bench_main
    from specdecode.bench.datasets import Task
    from specdecode.cli import main

    _, target_path, draft_path = tiny_pair
    monkeypatch.setattr(bench_main, "sample_tasks", lambda categories, per_category, seed=0, part="held-out": [
        Task("qa", "qa/1", ("the the the",)), Task("code", "code/1", ("the cat the",))])
    monkeypatch.setattr(sys, "argv", ["specdecode", "bench", "--backend", "llamacpp", "--target", str(target_path),
                                      "--drafter", str(draft_path), "--methods", "ar,pld,draft", "--repeats", "1",
                                      "--max-new-tokens", "8", "--threads", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    assert not exit_info.value.code and "Traceback" not in err, err
    text = (tmp_path / "report.md").read_text()
    assert "| pld |" in text and "| draft |" in text and "2/2" in text
    precision = LlamaCppLM(target_path, n_ctx=128).precision
    assert "F32" in precision and f"llamacpp, {precision} (the GGUF file's own)" in text  # llama.cpp's description


def test_a_context_too_small_for_the_branches_is_a_user_error(tiny_pair):
    """llama.cpp aborts the whole process (an assertion) on a context with fewer positions than sequences."""
    _, path, _ = tiny_pair
    with pytest.raises(UserError, match="at least 65"):
        LlamaCppLM(path, n_ctx=64)
    assert LlamaCppLM(path, n_ctx=65).max_context == 65

class _Pair:
    """What the llama.cpp peers read from `Models`: the GGUF paths and the end-of-sequence ids."""

    def __init__(self, target_path, draft_path):
        self.target = LlamaCppLM(target_path, n_ctx=256)
        self.draft = LlamaCppLM(draft_path, n_ctx=256)

    def require_draft(self):
        return self.draft


@pytest.mark.parametrize("peer", ["llama-cpp-python-pld", *(
    pytest.param(name, marks=pytest.mark.peers) for name in ("llama-server", "llama-server-draft",
                                                             "llama-server-ngram-simple"))])
def test_llamacpp_peers_decode_what_our_engine_decodes(tiny_pair, peer):
    """llama.cpp's own speculative modes, as the benchmark drives them, give our plain greedy tokens
    (token ids in, token ids out, the prefill timed apart). The llama-server peers need the binary
    (scripts/build-llama-server.sh) and are skipped without it."""
    from specdecode.bench import llamacpp_peers
    from specdecode.bench.runners import PEERS

    if peer.startswith("llama-server"):
        try:
            llamacpp_peers.server_binary()
        except UserError:
            pytest.skip("llama-server is not built (scripts/build-llama-server.sh)")
    _, target_path, draft_path = tiny_pair
    pair = _Pair(target_path, draft_path)
    runner = PEERS[peer].build(pair)
    # (not ignore_eos: llama.cpp then bans end-of-generation tokens, where our engine decodes past them)
    config = GenerationConfig(max_new_tokens=24)
    for prompt in random_prompts(3, seed=11):
        expected = SpeculativeEngine(pair.target).generate(prompt, config).token_ids
        output = runner.run(prompt, config)
        assert output.token_ids == expected
        assert 0 < output.prefill_seconds < output.seconds


def test_the_server_on_llamacpp_serves_requests_one_at_a_time(tiny_pair):
    """`specdecode serve --backend llamacpp`: the same API, every request alone (no batching), greedy
    answers as the engine's, concurrent requests queued."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from specdecode.api import load_models
    from specdecode.serve.app import Server, ServerThread, create_app

    _, target_path, draft_path = tiny_pair
    models = load_models(str(target_path), str(draft_path), backend="llamacpp", progress=False)
    server = Server(models, "tiny-gguf", default_method="pld")
    assert server.worker.batch is None
    running = ServerThread(create_app(server))
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)
        prompts = ["the cat", "the the the", "hello"]
        want = [models.engine(m).generate(models.encode(p, chat=True), GenerationConfig(max_new_tokens=12)).text
                for p, m in zip(prompts, ["pld", "ar", "draft"])]
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda pm: client.chat.completions.create(
                model="tiny-gguf", messages=[{"role": "user", "content": pm[0]}], max_tokens=12, temperature=0,
                extra_body={"method": pm[1]}).choices[0].message.content, zip(prompts, ["pld", "ar", "draft"])))
        assert got == want
    finally:
        running.stop()


def test_a_drafter_of_another_vocabulary_on_llamacpp(tiny_pair, tmp_path, monkeypatch):
    """A drafter whose tokenizer differs is kept with it, as on torch: `auto` (the default) leaves it out and `draft`
    translates its drafts through text, both giving plain greedy decoding's tokens. The backend refused any such
    drafter at load, so the default method failed for every target of another family than the default drafter's."""
    import conftest
    from specdecode.api import load_models
    from specdecode.drafters.other_tokenizer import OtherTokenizerDrafter
    from specdecode.engine import GenerationConfig

    model, target_path, _ = tiny_pair
    other = list(conftest.TOKENS)
    other[100], other[101] = other[101], other[100]  # the same tokens at other ids: another vocabulary
    monkeypatch.setattr(conftest, "TOKENS", other)
    write_tiny_gguf(noisy_copy(model, 0.1, 3), tmp_path / "other.gguf")
    monkeypatch.undo()
    models = load_models(str(target_path), str(tmp_path / "other.gguf"), backend="llamacpp", progress=False)
    assert models.draft is not None and models.draft_tokenizer is not None
    prompt, config = random_prompts(1, seed=2)[0], GenerationConfig(max_new_tokens=24)
    plain = models.engine("ar").generate(prompt, config).token_ids
    assert models.engine("auto").generate(prompt, config).token_ids == plain
    translating = models.engine("draft")
    assert isinstance(translating.drafter, OtherTokenizerDrafter)
    assert translating.generate(prompt, config).token_ids == plain
    with pytest.raises(UserError, match="needs a draft model with the target's tokenizer"):
        models.engine("composite")


def test_a_tree_after_a_whole_prompt_longer_than_one_decode(tmp_path):
    """test_trees_after_a_prompt_longer_than_one_decode as it meant: the prompt fed whole with the first step's tree
    (a prefill chunk of 4096, as a fast machine's curve gives), so that LlamaCppLM.forward peels the shared prefix
    (the tests' fixed curve makes chunks of 256: the first step carried 190 tokens, and the peel never ran)."""
    from specdecode.drafters.lookahead import LookaheadDrafter
    from specdecode.drafters.prompt_lookup import PromptLookupTreeDrafter
    from specdecode.models.llamacpp import MAX_BATCH, LlamaCppLM

    model = tiny_qwen2(seed=7, vocab=VOCAB, max_positions=1024)
    write_tiny_gguf(model, tmp_path / "long.gguf")
    target = LlamaCppLM(tmp_path / "long.gguf", n_ctx=1024)
    phrase = random_prompts(1, seed=3, low=40, high=41, vocab=VOCAB)[0]
    prompt = (phrase * 20)[:MAX_BATCH + 190]
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    reference = SpeculativeEngine(target).generate(prompt, config).token_ids
    for drafter in (PromptLookupTreeDrafter(CostCurve.linear(0.5), max_ngram=3, num_tokens=5),
                    LookaheadDrafter(max_context=1024)):
        engine = SpeculativeEngine(target, drafter=drafter)
        engine.prefill_chunk = 4096
        peeled = []
        forward = target.forward

        def watched(token_ids, peeled=peeled, forward=forward, **kwargs):
            if kwargs.get("tree_mask") is not None and token_ids.numel() > MAX_BATCH:
                peeled.append(token_ids.numel())
            return forward(token_ids, **kwargs)

        target.forward = watched
        try:
            result = engine.generate(prompt, config)
        finally:
            del target.forward
        assert peeled, drafter.name  # the first step's tree rode with the whole prompt
        assert result.token_ids == reference, drafter.name
