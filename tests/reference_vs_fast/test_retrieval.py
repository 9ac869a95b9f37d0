"""Retrieval drafting (REST): the suffix array against sorting, lookups with answers known by hand, the
trie and its pruning, datastore files, building from text, greedy equivalence and the command line."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import VOCAB, greedy_references, greedy_runs, random_prompts, tiny_chat_qwen2, tiny_tokenizer
from specdecode.drafters.retrieval import (
    SEPARATOR,
    Datastore,
    RetrievalDrafter,
    RetrievalTreeDrafter,
    build_datastore,
    build_retrieval,
    heaviest_path,
    join_documents,
    suffix_array,
)
from specdecode.drafters.base import Outcome
from specdecode.drafters.retrieval.build import default_datastore_path
from specdecode.tree.trie import build_trie
from specdecode.engine import SpeculativeEngine
from specdecode.errors import UserError
from specdecode.methods import DrafterOptions
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.tree import structure
from specdecode.types import Draft, SamplingParams, StepStats, Verdict

CURVE = CostCurve.linear(0.05)  # a fixed cost curve: tests do not time anything
GREEDY = SamplingParams()


# --- The suffix array ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    documents=st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=5),
    scale=st.sampled_from([1, 100, 70_000, 1 << 22]),  # 1, 2 and 3 bytes per rank
)
def test_suffix_array_matches_sorted(documents, scale):
    tokens = join_documents([[t * scale for t in d] for d in documents])
    slow = sorted(range(tokens.size), key=lambda i: tokens[i:].tolist())
    assert suffix_array(tokens).tolist() == slow


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(-1, 2**31 - 1), max_size=20))
def test_suffix_array_of_any_int32_ids(tokens):
    tokens = np.array(tokens, dtype=np.int32)
    assert suffix_array(tokens).tolist() == sorted(range(tokens.size), key=lambda i: tokens[i:].tolist())


# --- Lookup, with answers known by hand ------------------------------------------------------------

#  "a b c" is followed by d e (twice, once cut by the end of its document), d f, and g; "x a b c" once.
CORPUS = [
    [1, 2, 3, 4, 5, 9],  # a b c d e .
    [7, 1, 2, 3, 4, 6],  # x a b c d f
    [1, 2, 3, 4, 5],  # a b c d e
    [8, 1, 2, 3, 10, 11],  # y a b c g h
    [5, 5, 5, 5],
]


@pytest.fixture(scope="module")
def store() -> Datastore:
    return Datastore.from_documents(CORPUS, vocab_size=12, corpus="hand-made")


def test_find_counts_occurrences(store):
    for pattern in ([1, 2, 3], [2, 3, 4], [5], [5, 5], [3, 4, 5, 9], [0], [9, 7], [4, 6, 7]):
        first, last = store.find(pattern)
        tokens = store.tokens.tolist()
        expected = sum(tokens[i : i + len(pattern)] == pattern for i in range(len(tokens)))
        assert last - first == expected, pattern
        for row in range(first, last):  # the rows found really begin with the pattern
            start = int(store.suffixes[row])
            assert tokens[start : start + len(pattern)] == pattern


def test_no_match_spans_two_documents(store):
    first, last = store.find([9, 7])  # the end of the first document and the start of the second
    assert first == last
    assert store.longest_match([5, 9, 7]) is None
    assert store.longest_match([9, 7, 1]).length == 2  # "7 1" only


def test_longest_match(store):
    match = store.longest_match([0, 7, 1, 2, 3])  # "x a b c" occurs once
    assert (match.length, match.count) == (4, 1)
    match = store.longest_match([0, 0, 1, 2, 3])  # "0 a b c" never: "a b c", 4 times
    assert (match.length, match.count) == (3, 4)
    assert store.longest_match([0, 1, 2, 3], max_length=2).length == 2  # "b c"
    assert store.longest_match([4, 0]) is None  # nothing ends with 0
    assert store.longest_match([3]) is None  # shorter than min_length
    assert store.longest_match([5, 5, 5, 5, 5]).length == 4


def test_continuations_counted_and_cut_at_document_ends(store):
    rows = store.continuations(store.longest_match([0, 1, 2, 3]), num_tokens=3)
    assert Counter(tuple(r) for r in rows.tolist()) == Counter({
        (4, 5, 9): 1, (4, 6, SEPARATOR): 1, (4, 5, SEPARATOR): 1, (10, 11, SEPARATOR): 1})
    assert rows.tolist() == sorted(rows.tolist())  # in suffix-array order
    tokens, counts = heaviest_path(rows)
    assert tokens.tolist() == [4, 5, 9] and counts.tolist() == [3, 2, 1]


def test_occurrences_sampled_evenly():
    """With more occurrences than considered, the sample keeps each continuation's share."""
    documents = [[1, 2, 3]] * 300 + [[1, 2, 4]] * 100
    store = Datastore.from_documents(documents, vocab_size=5)
    rows = store.continuations(store.longest_match([1, 2]), num_tokens=1, max_occurrences=40)
    assert rows.shape == (40, 1)
    assert Counter(rows[:, 0].tolist()) == {3: 30, 4: 10}


# --- The trie and the tree draft -------------------------------------------------------------------


def slow_trie(rows: np.ndarray) -> dict[tuple[int, ...], int]:
    """Every prefix of every continuation, with how many continuations begin with it."""
    counts: Counter = Counter()
    for row in rows.tolist():
        row = row[: row.index(SEPARATOR)] if SEPARATOR in row else row
        for depth in range(1, len(row) + 1):
            counts[tuple(row[:depth])] += 1
    return dict(counts)


def paths(tokens, parents) -> list[tuple[int, ...]]:
    """The token path from the context to each node."""
    out: list[tuple[int, ...]] = []
    for token, parent in zip(tokens.tolist(), parents.tolist()):
        out.append((out[parent] if parent != -1 else ()) + (token,))
    return out


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=4), min_size=1, max_size=30),
       ends=st.lists(st.integers(0, 4), min_size=30, max_size=30))
def test_trie_matches_slow_reference(rows, ends):
    rows = np.array(sorted(r[:e] + [SEPARATOR] * (4 - e) for r, e in zip(rows, ends)), dtype=np.int32)
    trie = build_trie(rows, by_depth=True)
    structure.check(torch.from_numpy(trie.parents))
    assert dict(zip(paths(trie.tokens, trie.parents), trie.weights.tolist())) == slow_trie(rows)
    assert trie.total == rows.shape[0]
    assert len(set(paths(trie.tokens, trie.parents))) == trie.tokens.size  # each prefix once


def test_tree_draft_scores_and_budget(store):
    context = [0, 1, 2, 3]
    expected = {(4,): 3, (10,): 1, (4, 5): 2, (4, 6): 1, (10, 11): 1, (4, 5, 9): 1}  # of 4 occurrences
    for budget in [1, 2, 3, 5, 100]:
        drafter = RetrievalTreeDrafter(store, CURVE, num_tokens=3, budget=budget)
        draft = drafter.propose(context, 8, GREEDY, None)
        structure.check(draft.parents)
        assert len(draft) == min(budget, len(expected))
        found = dict(zip(paths(draft.tokens, draft.parents), draft.scores.tolist()))
        assert set(found) <= set(expected)
        assert found == {path: pytest.approx(expected[path] / 4) for path in found}
        kept = sorted(expected.values(), reverse=True)[: len(found)]  # the best nodes were kept
        assert sorted((round(s * 4) for s in found.values()), reverse=True) == kept
    chain = RetrievalDrafter(store, num_tokens=3).propose(context, 8, GREEDY, None)
    assert chain.tokens.tolist() == [4, 5, 9] and chain.scores.tolist() == pytest.approx([0.75, 0.5, 0.25])
    assert not chain.is_tree
    assert len(RetrievalDrafter(store).propose(context, 2, GREEDY, None)) == 2  # the engine's room


def test_automatic_budget_follows_the_cost_curve(store):
    cheap = RetrievalTreeDrafter(store, CostCurve.linear(0.01), num_tokens=3).propose([1, 2, 3], 8, GREEDY, None)
    dear = RetrievalTreeDrafter(store, CostCurve.linear(1.0), num_tokens=3).propose([1, 2, 3], 8, GREEDY, None)
    assert len(cheap) == 6 and len(dear) == 0  # every node pays on a flat curve, none where width costs depth


def test_nothing_matches_gives_an_empty_draft(store):
    for drafter in [RetrievalDrafter(store), RetrievalTreeDrafter(store, CURVE)]:
        assert len(drafter.propose([11, 0], 8, GREEDY, None)) == 0
        assert len(drafter.propose([5, 9], 8, GREEDY, None)) == 0  # matched, but the document ends there
        verdict = Verdict(num_drafted=0, num_accepted=0, tokens=(3,))
        drafter.observe(Outcome(Draft.empty(), verdict, StepStats(0, 0, 1, 0.0, 0.0, 1)))


def test_calibration_scales_scores(store):
    drafter = RetrievalDrafter(store, num_tokens=3)
    before = drafter.propose([1, 2, 3], 8, GREEDY, None).scores
    for _ in range(10):  # predicted 1.5 accepted tokens a step, none accepted
        drafter.propose([1, 2, 3], 8, GREEDY, None)
        verdict = Verdict(num_drafted=3, num_accepted=0, tokens=(7,))
        drafter.observe(Outcome(Draft.empty(), verdict, StepStats(3, 0, 1, 0.0, 0.0, 4)))
    after = drafter.propose([1, 2, 3], 8, GREEDY, None).scores
    assert (after < before).all() and after[0] == pytest.approx(0.75 * 0.25)  # down to the floor
    drafter.begin([1])
    assert drafter.propose([1, 2, 3], 8, GREEDY, None).scores.tolist() == before.tolist()


# --- Files -----------------------------------------------------------------------------------------


def test_save_load_round_trip_and_vocabulary_check(store, tmp_path):
    path = store.save(tmp_path / "store.npz")
    loaded = Datastore.load(path, vocab_size=12)
    assert loaded.info == store.info and loaded.info.files == 5 and loaded.info.tokens == 27
    assert np.array_equal(loaded.tokens, store.tokens) and np.array_equal(loaded.suffixes, store.suffixes)
    assert loaded.longest_match([7, 1, 2, 3]) == store.longest_match([7, 1, 2, 3])
    with pytest.raises(UserError, match="vocabulary of 12 tokens.*target's has 13"):
        Datastore.load(path, vocab_size=13)
    with pytest.raises(UserError, match="no datastore"):
        Datastore.load(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(UserError, match="not a retrieval datastore"):
        Datastore.load(tmp_path / "junk.npz")


@pytest.mark.parametrize("damage", ["empty file", "lengths differ", "id past the vocabulary", "negative id",
                                    "floats", "no tokens", "suffix outside"])
def test_a_damaged_datastore_is_refused_in_one_line(store, tmp_path, damage):
    """Each was a traceback (EOFError, the constructor's ValueError), or was drafted from and failed in the target's
    embedding (ids out of range)."""
    path = tmp_path / "store.npz"
    tokens, suffixes = store.tokens.copy(), store.suffixes.copy()
    if damage == "lengths differ":
        suffixes = suffixes[:-1]
    elif damage == "id past the vocabulary":
        tokens[0] = 12
    elif damage == "negative id":
        tokens[0] = -5
    elif damage == "floats":
        tokens = tokens.astype(np.float32)
    elif damage == "no tokens":
        tokens, suffixes = tokens[:0], suffixes[:0]
    elif damage == "suffix outside":
        suffixes[0] = len(tokens)
    info = np.frombuffer(json.dumps(dataclasses.asdict(store.info)).encode(), dtype=np.uint8)
    with path.open("wb") as sink:
        np.savez(sink, tokens=tokens, suffixes=suffixes, info=info)
    if damage == "empty file":
        path.write_bytes(b"")
    with pytest.raises(UserError, match="is not a retrieval datastore") as error:
        Datastore.load(path, vocab_size=12)
    assert "\n" not in str(error.value)


def test_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(UserError, match="token ids"):
        Datastore.from_documents([[1, 2, 12]], vocab_size=12)
    with pytest.raises(UserError, match="token ids"):
        Datastore.from_documents([[1, -1, 2]], vocab_size=12)


def write_corpus(folder):
    (folder / "pkg" / "tests").mkdir(parents=True)
    (folder / "a.py").write_text("def the_cat():\n    return the_cat\n")
    (folder / "pkg" / "b.py").write_text("the cat the cat\n" * 50)
    (folder / "pkg" / "tests" / "c.py").write_text("the dog\n")
    (folder / "pkg" / "empty.py").write_text("")
    (folder / "notes.txt").write_text("not python\n")


def test_build_from_text_files(tmp_path, monkeypatch):
    write_corpus(tmp_path)
    tokenizer = tiny_tokenizer()
    monkeypatch.setattr("specdecode.drafters.retrieval.build.PIECE_CHARS", 100)  # several pieces and batches
    store = build_datastore(tmp_path, tokenizer, skip=frozenset({"tests"}), progress=False)
    texts = [(tmp_path / "a.py").read_text(), (tmp_path / "pkg" / "b.py").read_text()]
    expected = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    assert store.info.files == 2 and store.info.vocab_size == len(tokenizer)
    assert store.info.tokens == sum(map(len, expected))
    # Pieces are cut after newlines, where this byte-level tokenizer's tokens never straddle.
    assert store.tokens.tolist() == join_documents(expected).tolist()
    assert store.suffixes.tolist() == suffix_array(store.tokens).tolist()
    every = build_datastore(tmp_path, tokenizer, pattern="**/*", progress=False)
    assert every.info.files == 4  # tests and the .txt file too; the empty file adds nothing
    with pytest.raises(UserError, match="no files match"):
        build_datastore(tmp_path, tokenizer, pattern="*.rs", progress=False)
    with pytest.raises(UserError, match="no such folder"):
        build_datastore(tmp_path / "missing", tokenizer, progress=False)
    with pytest.raises(UserError, match="passed 10 tokens"):
        build_datastore(tmp_path, tokenizer, max_tokens=10, progress=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "nothing.py").write_text("")
    with pytest.raises(UserError, match="hold no text"):
        build_datastore(tmp_path / "empty", tokenizer, progress=False)


def test_a_datastore_of_another_tokenizer_is_refused(tmp_path):
    """Two tokenizers of one length may give one id to other text: the datastore keeps a digest of its tokenizer's
    tokens and ids, and a target with another refuses it (one built before the digest was kept is taken)."""
    write_corpus(tmp_path / "corpus")
    tokenizer = tiny_tokenizer()
    target = HFCausalLM(tiny_chat_qwen2(vocab_size=len(tokenizer)))
    path = build_datastore(tmp_path / "corpus", tokenizer, progress=False).save(tmp_path / "store.npz")
    assert isinstance(build_retrieval(target, None, DrafterOptions(datastore=str(path), tokenizer=tokenizer)),
                      RetrievalDrafter)
    vocab = tokenizer.get_vocab()
    first, second = sorted(vocab)[:2]  # the same tokens, two of them with each other's ids
    other = type("Permuted", (), {"get_vocab": lambda self: {**vocab, first: vocab[second], second: vocab[first]},
                                  "__len__": lambda self: len(tokenizer)})()
    with pytest.raises(UserError, match="built with another tokenizer"):
        build_retrieval(target, None, DrafterOptions(datastore=str(path), tokenizer=other))


def test_builder_needs_a_datastore_or_a_tokenizer(store, tmp_path, target_lm, monkeypatch):
    with pytest.raises(UserError, match="needs a datastore"):
        build_retrieval(target_lm, None, DrafterOptions())
    path = store.save(tmp_path / "store.npz")
    assert isinstance(build_retrieval(target_lm, None, DrafterOptions(datastore=str(path))), RetrievalDrafter)
    tree = build_retrieval(target_lm, None, DrafterOptions(datastore=str(path), tree=True, budget=3))
    assert isinstance(tree, RetrievalTreeDrafter) and tree.budget == 3
    with pytest.raises(UserError, match="vocabulary of 12 tokens"):  # the tokenizer's length is known: exact
        build_retrieval(target_lm, None, DrafterOptions(datastore=str(path), tokenizer=tiny_tokenizer()))
    wide = Datastore.from_documents([[1, 2, 3]], vocab_size=VOCAB + 1).save(tmp_path / "wide.npz")
    with pytest.raises(UserError, match="more than the target's"):  # else: no wider than the logits
        build_retrieval(target_lm, None, DrafterOptions(datastore=str(wide)))


def test_default_datastore_is_built_once_and_cached(tmp_path, monkeypatch, target_lm):
    """The standard library stand-in: a small folder; the cache key follows the tokenizer."""
    write_corpus(tmp_path / "lib")
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("specdecode.drafters.retrieval.build.stdlib_folder", lambda: tmp_path / "lib")
    # the real cache path (conftest sends the suite's default datastore to a temporary folder)
    monkeypatch.setattr("specdecode.drafters.retrieval.build.default_datastore_path", default_datastore_path)
    tokenizer = tiny_tokenizer()
    path = default_datastore_path(tokenizer)
    assert path.parent == tmp_path / "cache" / "datastores" and not path.exists()
    drafter = build_retrieval(target_lm, None, DrafterOptions(tokenizer=tokenizer))
    assert path.is_file() and drafter.datastore.info.files == 2  # the tests folder is skipped
    modified = path.stat().st_mtime_ns
    build_retrieval(target_lm, None, DrafterOptions(tokenizer=tokenizer, tree=True))
    assert path.stat().st_mtime_ns == modified  # not rebuilt
    tokenizer.add_tokens(["<new>"])
    assert default_datastore_path(tokenizer) != path


# --- Greedy equivalence on the tiny target ---------------------------------------------------------

PROMPTS = random_prompts(6, seed=11)
LENGTHS = [1, 5, 40]


@pytest.fixture(scope="module")
def reference(tiny_target):
    """Plain greedy continuations from transformers' own generate()."""
    return greedy_references(tiny_target, PROMPTS, max(LENGTHS))


@pytest.fixture(scope="module")
def tiny_store(reference):
    """A corpus holding the tiny target's own greedy outputs for half the prompts (drafts there are
    right, whole spans at a time), plus noise: random documents and a wrong copy of one output."""
    noise = random_prompts(30, seed=12, low=20, high=60)
    wrong = [(t + 1) % VOCAB for t in reference[0]]
    documents = [PROMPTS[i] + reference[i] for i in range(0, len(PROMPTS), 2)] + noise + [PROMPTS[0] + wrong]
    return Datastore.from_documents(documents, vocab_size=VOCAB)


@pytest.mark.parametrize("kind", ["chain", "tree", "tree-budget"])
def test_greedy_retrieval_equals_plain(kind, tiny_target, tiny_store, reference):
    make = {
        "chain": lambda: RetrievalDrafter(tiny_store, num_tokens=6),
        "tree": lambda: RetrievalTreeDrafter(tiny_store, CURVE, num_tokens=6),
        "tree-budget": lambda: RetrievalTreeDrafter(tiny_store, CURVE, num_tokens=4, budget=5),
    }[kind]
    engine = SpeculativeEngine(HFCausalLM(tiny_target), drafter=make())
    accepted = 0
    for i, n, result in greedy_runs(engine, PROMPTS, reference, LENGTHS):
        accepted += sum(s.accepted for s in result.steps)
        if i % 2 == 0 and n == 40:  # its output is in the corpus: far fewer forwards than tokens
            assert result.target_forwards <= n // 3, f"prompt {i}"
    assert accepted > 0


# --- The command line ------------------------------------------------------------------------------


from conftest import run_cli as run  # noqa: E402


def test_cli_builds_a_datastore(monkeypatch, capsys, tmp_path, tiny_folder):
    write_corpus(tmp_path / "corpus")
    out_path = tmp_path / "store.npz"
    code, out, err = run(monkeypatch, capsys, "datastore", "build", str(tmp_path / "corpus"), str(out_path),
                         "--target", str(tiny_folder))
    assert code == 0, err
    store = Datastore.load(out_path, vocab_size=len(tiny_tokenizer()))
    assert store.info.files == 3  # a.py, b.py, tests/c.py
    assert f"{store.info.tokens:,} tokens from 3 files" in out and "peak memory" in out and "GiB" in out
    code, _, _ = run(monkeypatch, capsys, "datastore", "build", str(tmp_path / "corpus"), str(tmp_path / "txt.npz"),
                     "--target", str(tiny_folder), "--pattern", "*.txt")
    assert code == 0 and Datastore.load(tmp_path / "txt.npz").info.files == 1
    (tmp_path / "a-file").write_text("")
    code, out, err = run(monkeypatch, capsys, "datastore", "build", str(tmp_path / "corpus"),
                         str(tmp_path / "a-file" / "store.npz"), "--target", str(tiny_folder))
    assert code == 2 and "cannot write" in err and "Traceback" not in err + out


def test_cli_missing_folder_is_a_one_line_error(monkeypatch, capsys, tmp_path, tiny_folder):
    code, out, err = run(monkeypatch, capsys, "datastore", "build", str(tmp_path / "nowhere"),
                         str(tmp_path / "store.npz"), "--target", str(tiny_folder))
    assert code == 2 and "no such folder" in err and "Traceback" not in err + out
    assert not (tmp_path / "store.npz").exists()
