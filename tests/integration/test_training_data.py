"""The trained drafters' data: the cut ShareGPT file, chat templating with assistant masks, the exclusion
of benchmark prompts, and the target's features written and read back."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_chat_qwen2, tiny_tokenizer, TOKENS
from specdecode.training import corpus, features


def test_complete_objects_stop_at_the_cut():
    items = [{"id": i, "conversations": [{"from": "human", "value": "a]b}"}]} for i in range(3)]
    text = json.dumps(items, indent=2)
    cut = text[: text.index('"id": 2') + 4]  # inside the third object
    assert [o["id"] for o in corpus.complete_objects(cut)] == [0, 1]
    assert [o["id"] for o in corpus.complete_objects(text)] == [0, 1, 2]


def test_sharegpt_conversations_keep_alternating_complete_ones(tmp_path):
    items = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "gpt", "value": "starts with the assistant"}, {"from": "human", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q"},
                           {"from": "gpt", "value": "a"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(items)[:-1])  # cut: the closing bracket is missing
    got = list(corpus.sharegpt_conversations(path))
    assert got == [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                   [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]


def test_assistant_mask_covers_exactly_the_answers():
    tokenizer = tiny_tokenizer()
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on"},
                {"role": "user", "content": "and?"}, {"role": "assistant", "content": "the mat"}]
    ids, assistant = corpus.tokenize(tokenizer, messages, max_length=1000)
    marked = tokenizer.decode([t for t, a in zip(ids, assistant) if a])
    assert marked == "sat on<|im_end|>\nthe mat<|im_end|>\n"
    short, short_mask = corpus.tokenize(tokenizer, messages, max_length=12)
    assert short == ids[:12] and short_mask == assistant[:12]


def test_benchmark_prompts_are_kept_out():
    openings = corpus.evaluation_openings()
    assert len(openings) > 1000  # every installed category's prompts
    from specdecode.bench.datasets import math

    leaked = [{"role": "user", "content": "Please help. " + math()[0].turns[0]}, {"role": "assistant", "content": "ok"}]
    clean = [{"role": "user", "content": "Write me a haiku about autumn leaves falling."},
             {"role": "assistant", "content": "ok"}]
    assert corpus.mentions_any(leaked, openings) and not corpus.mentions_any(clean, openings)


def test_build_mixes_sources_within_budget(tmp_path):
    stdlib = tmp_path / "lib"
    (stdlib / "pkg").mkdir(parents=True)
    for i in range(6):
        (stdlib / "pkg" / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 5)
    chats = [{"conversations": [{"from": "human", "value": f"question {i} " * 3},
                                {"from": "gpt", "value": f"the answer is {i}, " * 6}]} for i in range(30)]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps(chats))
    sequences = corpus.build(tiny_tokenizer(), total_tokens=2000, code_share=0.3, max_length=200,
                             sharegpt=sharegpt, stdlib=stdlib)
    by_source = {s: sum(len(q.token_ids) for q in sequences if q.source == s) for s in ("stdlib", "sharegpt")}
    assert by_source["stdlib"] > 0 and by_source["sharegpt"] > by_source["stdlib"]
    assert sum(by_source.values()) < 2000 + 2 * 200  # each source stops within a sequence of its budget
    assert all(len(q.token_ids) == len(q.assistant) <= 200 for q in sequences)


def test_features_are_the_targets_last_hidden_states(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_chat_qwen2(vocab_size=len(TOKENS))
    sequences = [corpus.Sequence("sharegpt", *corpus.tokenize(
        tokenizer, [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "the " * (i + 1)}], 64))
        for i in range(5)]
    features.SHARD_TOKENS, saved = 40, features.SHARD_TOKENS  # several shards
    try:
        features.extract(model, sequences, tmp_path, {"target": "tiny"}, progress=False)
    finally:
        features.SHARD_TOKENS = saved
    manifest, shards = features.load(tmp_path)
    assert manifest["sequences"] == 5 and len(shards) > 1 and manifest["target"] == "tiny"
    loaded = [seq for shard in shards for seq in shard.sequences()]
    for sequence, (tokens, hidden, assistant) in zip(sequences, loaded):
        assert tokens.tolist() == sequence.token_ids and assistant.tolist() == sequence.assistant
        with torch.inference_mode():  # the LM head over the stored features gives the target's logits
            logits = model(torch.tensor([sequence.token_ids])).logits[0]
        assert torch.allclose(model.lm_head(hidden.float()), logits, atol=0.05)
    with pytest.raises(Exception, match="no features"):
        features.load(tmp_path / "nothing")


def test_a_folder_of_the_older_layout_is_read_as_it_is_never_added_to(tmp_path):
    sequence = corpus.Sequence("test", [1, 2, 3, 4, 5], [False, False, True, True, True], id="a")
    writer = features.Writer(tmp_path, {"target_key": "t"}, hidden_size=4)
    writer.add("a", sequence, torch.zeros(5, 4, dtype=torch.bfloat16))
    writer.flush()
    assert not features.older_layout(tmp_path) and features.missing(tmp_path, [sequence]) == []
    manifest = json.loads((tmp_path / features.MANIFEST).read_text())
    del manifest["shards"][0]["ids"]  # as folders built before ids were kept
    (tmp_path / features.MANIFEST).write_text(json.dumps(manifest))
    assert features.older_layout(tmp_path) and not features.older_layout(tmp_path / "absent")
    with pytest.raises(features.UserError, match="older layout"):
        features.Writer(tmp_path, {"target_key": "t"}, hidden_size=4)
