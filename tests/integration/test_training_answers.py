"""The target's own answers as training data: batched answers as plain decoding's, resuming after a stop,
benchmark prompts kept out, a folder bound to its target and settings, the answers as training sequences,
and `specdecode train data` on the tiny model folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from specdecode.api import load_models
from specdecode.drafters.eagle3_head import default_layers
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.models import int4
from specdecode.training import answer_store, answers, corpus, features, prompts
from specdecode.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = answers.Settings(max_new_tokens=10, sampled_share=0.5, code_share=0.35, seed=1)


@pytest.fixture(scope="module")
def models(tiny_folder):
    return load_models(str(tiny_folder), None, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """(a ShareGPT file, a standard library folder), small: as tests/integration/test_training_data.py fakes them."""
    folder = tmp_path_factory.mktemp("sources")
    stdlib = folder / "lib"
    (stdlib / "pkg").mkdir(parents=True)
    for i in range(3):  # 50 lines: one slice to continue, one to explain (too long for the tiny model: cut)
        (stdlib / "pkg" / f"mod{i}.py").write_text("".join(f"def f{i}_{k}(x):\n    return x + {k}\n"
                                                            for k in range(25)))
    chats = [{"conversations": [{"from": "human", "value": f"the cat {i} sat"},
                                {"from": "gpt", "value": f"the answer is {i}"}]} for i in range(30)]
    chats.append(chats[3])  # a repeated question: asked once
    sharegpt = folder / "sharegpt.json"
    sharegpt.write_text(json.dumps(chats))
    return sharegpt, stdlib


def run_answers(models, sources, out, **kwargs):
    sharegpt, stdlib = sources
    options = dict(target="tiny", settings=SETTINGS, batch=4, sharegpt=sharegpt, stdlib=stdlib,
                   openings=frozenset(), progress=False) | kwargs
    return answers.generate(models, out, **options)


def test_prompts_are_seeded_mixed_and_unique(sources):
    sharegpt, stdlib = sources
    listed = list(answers.prompts(SETTINGS, sharegpt=sharegpt, stdlib=stdlib, openings=frozenset()))
    ids = [p.id for p in listed]
    assert len(ids) == len(set(ids)) == 30 + 3 * 3  # 30 distinct questions; per module: write, continue, explain
    assert "sharegpt:30" not in ids  # the repeat of conversation 3
    assert {"stdlib:pkg.mod0:write", "stdlib:pkg.mod0:continue@1", "stdlib:pkg.mod0:explain@41"} <= set(ids)
    again = [p.id for p in answers.prompts(SETTINGS, sharegpt=sharegpt, stdlib=stdlib, openings=frozenset())]
    other = [p.id for p in answers.prompts(answers.Settings(seed=2), sharegpt=sharegpt, stdlib=stdlib,
                                           openings=frozenset())]
    assert again == ids and other != ids and sorted(other) == sorted(ids)
    seeds = [answers.sampling_of(i, SETTINGS) for i in ids]
    assert 0 < sum(s is None for s in seeds) < len(ids)  # some greedy, some sampled
    assert seeds == [answers.sampling_of(i, SETTINGS) for i in ids]


def test_benchmark_prompts_are_kept_out(tmp_path):
    from specdecode.bench.datasets import math

    leaked = "Please help. " + math()[0].turns[0]
    chats = [{"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]}
             for text in ("Write me a haiku about autumn leaves falling.", leaked)]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps(chats))
    (tmp_path / "lib").mkdir()
    listed = list(answers.prompts(SETTINGS, sharegpt=sharegpt, stdlib=tmp_path / "lib"))  # the real openings
    assert [p.id for p in listed] == ["sharegpt:0"]


def test_batched_answers_are_plain_decodings(models, sources, tmp_path):
    summary = run_answers(models, sources, tmp_path, tokens=150)
    manifest, stored = answer_store.load(tmp_path)
    assert summary.stopped_by == "tokens" and summary.total_tokens == manifest["answer_tokens"] >= 150
    assert {a.mode for a in stored} == {"greedy", "sampled"} and {a.source for a in stored} == {"sharegpt", "stdlib"}
    assert manifest["target"] == "tiny" and manifest["target_key"] == models.target.cost_key
    assert manifest["settings"]["max_new_tokens"] == 10 and manifest["answers"] == len(stored)
    limit = answers.prompt_limit(SETTINGS, models.target.max_context)
    by_id = {p.id: p for p in answers.prompts(SETTINGS, sharegpt=sources[0], stdlib=sources[1], openings=frozenset())}
    engine = SpeculativeEngine(models.target, models.tokenizer)  # plain decoding, one sequence at a time
    for answer in stored:
        assert answer.prompt_ids == answers.encode(models, by_id[answer.id], limit)
        assert len(answer.prompt_ids) <= limit and answer.seed == answers.sampling_of(answer.id, SETTINGS)
        sampling = SamplingParams(temperature=0.0 if answer.seed is None else SETTINGS.temperature)
        alone = engine.generate(answer.prompt_ids, GenerationConfig(max_new_tokens=10, sampling=sampling,
                                                                    seed=answer.seed))
        assert answer.answer_ids == alone.token_ids, answer.id  # sampled ones too: the stored seed replays them
        assert answer.finish_reason == alone.finish_reason
    assert any(prompts.CUT_MARK.strip() in models.tokenizer.decode(a.prompt_ids) for a in stored
               if a.source == "stdlib")  # a code slice too long for the tiny model lost its middle


def test_resume_after_a_stop_keeps_every_line_and_asks_nothing_twice(models, sources, tmp_path):
    run_answers(models, sources, tmp_path, tokens=40)
    first = (tmp_path / answer_store.ANSWERS).read_bytes()
    with (tmp_path / answer_store.ANSWERS).open("ab") as file:
        file.write(b'{"id": "sharegpt:1')  # a line cut by a kill
    ticks = iter(range(10**6))  # a clock that advances a second per reading: the time runs out mid-batch
    summary = run_answers(models, sources, tmp_path, tokens=10**6, seconds=6, clock=lambda: float(next(ticks)))
    assert summary.stopped_by == "seconds" and summary.dropped > 0
    summary = run_answers(models, sources, tmp_path, tokens=140)
    text = (tmp_path / answer_store.ANSWERS).read_bytes()
    assert text.startswith(first) and summary.total_tokens >= 140
    manifest, stored = answer_store.load(tmp_path)
    assert len({a.id for a in stored}) == len(stored) == manifest["answers"] and len(manifest["runs"]) == 3
    straight = tmp_path / "straight"  # the same answers as one uninterrupted run gives
    run_answers(models, sources, straight, tokens=140)
    uninterrupted = {a.id: a for a in answer_store.load(straight)[1]}
    common = [a for a in stored if a.id in uninterrupted]
    assert len(common) >= len(stored) // 2 and all(a == uninterrupted[a.id] for a in common)
    assert run_answers(models, sources, tmp_path, tokens=100).answers == 0  # already there


def test_a_folder_keeps_its_target_and_settings(models, sources, tmp_path):
    run_answers(models, sources, tmp_path, tokens=20)
    with pytest.raises(UserError, match="max_new_tokens=10, not 12"):
        run_answers(models, sources, tmp_path, tokens=40, settings=answers.Settings(max_new_tokens=12, seed=1))
    manifest = json.loads((tmp_path / answer_store.MANIFEST).read_text())
    backend, folder, *rest = manifest["target_key"].split("|")
    for other in (f"/home/someone/else/{Path(folder).name}", "another model"):  # a folder of the same name is another
        manifest["target_key"] = "|".join([backend, other, *rest])
        (tmp_path / answer_store.MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(UserError, match="holds answers of 'tiny'"):
            run_answers(models, sources, tmp_path, tokens=40)


def test_a_registered_target_is_itself_in_any_cache():
    """A registered model's folder lies in each user's own cache (a folder of answers kept in the repository meets
    many): cut to its name; any other folder stays whole (two checkpoints saved as `checkpoint-500` are two)."""
    name, rest = "qwen2.5-coder-1.5b-instruct", "qwen2|int4|823559680"
    mine = answer_store.target_identity(f"hf|/root/.cache/specdecode/models/{name}|{rest}")
    assert mine == answer_store.target_identity(f"hf|/home/ana/.cache/specdecode/models/{name}|{rest}")
    assert mine != answer_store.target_identity(f"hf|/root/.cache/specdecode/models/{name}|qwen2|float32|1")
    first, second = (answer_store.target_identity(f"hf|/runs/{run}/checkpoint-500|{rest}") for run in ("a", "b"))
    assert first != second


def test_answers_become_training_sequences(models, sources, tmp_path):
    run_answers(models, sources, tmp_path / "answers", tokens=40)
    stored = answer_store.load(tmp_path / "answers")[1]
    sequences = answer_store.sequences(tmp_path / "answers")
    assert len(sequences) == len(stored)
    for answer, sequence in zip(stored, sequences):
        assert sequence.token_ids == answer.prompt_ids + answer.answer_ids
        assert sequence.assistant == [False] * len(answer.prompt_ids) + [True] * len(answer.answer_ids)
        assert sequence.source == f"{answer.source}-answers"
    features.extract(models.target.model, sequences, tmp_path / "features", {"target": "tiny"}, progress=False)
    manifest, shards = features.load(tmp_path / "features")
    assert manifest["assistant_tokens"] == sum(len(a.answer_ids) for a in stored)
    assert isinstance(sequences[0], corpus.Sequence)


def test_packed_answers_are_read_with_the_new_ones_and_asked_for_never_again(models, sources, tmp_path):
    run_answers(models, sources, tmp_path, tokens=40)
    before = answer_store.load(tmp_path)[1]
    count, tokens, chunk = answer_store.pack(tmp_path)
    assert chunk == tmp_path / "answers-000.jsonl.xz" and count == len(before)
    assert tokens == sum(len(a.answer_ids) for a in before) and (tmp_path / answer_store.ANSWERS).read_bytes() == b""
    assert answer_store.load(tmp_path)[1] == before and answer_store.pack(tmp_path) == (0, 0, None)
    summary = run_answers(models, sources, tmp_path, tokens=80)  # resumes past the packed ones
    assert summary.total_tokens >= 80 and summary.total_tokens - summary.tokens == tokens
    after = answer_store.load(tmp_path)[1]
    assert after[: len(before)] == before and len({a.id for a in after}) == len(after) > len(before)
    # a kill between writing a chunk and emptying answers.jsonl leaves the answers in both: read once
    (tmp_path / answer_store.ANSWERS).write_text("".join(a.to_json() + "\n" for a in after[len(before):]))
    assert answer_store.pack(tmp_path)[2] == tmp_path / "answers-001.jsonl.xz"
    (tmp_path / answer_store.ANSWERS).write_text(after[-1].to_json() + "\n")
    assert answer_store.load(tmp_path)[1] == after and answer_store.pack(tmp_path) == (0, 0, None)
    assert run_answers(models, sources, tmp_path, tokens=80).answers == 0


def test_one_process_writes_a_folder_at_a_time(models, sources, tmp_path):
    run_answers(models, sources, tmp_path, tokens=20)
    store = answer_store.Store(tmp_path, answer_store.describe_target(models, "tiny"), SETTINGS)
    try:
        with pytest.raises(UserError, match="another process is writing answers"):
            answer_store.pack(tmp_path)
        with pytest.raises(UserError, match="another process is writing answers"):
            run_answers(models, sources, tmp_path, tokens=40)
    finally:
        store.close()
    assert answer_store.pack(tmp_path)[0] > 0


def test_the_command(monkeypatch, capsys, tiny_folder, sources, tmp_path):
    monkeypatch.setattr(corpus, "sharegpt_file", lambda: sources[0])  # the standard library: conftest's
    out = tmp_path / "answers"
    common = ["train", "data", "--out", str(out), "--target", str(tiny_folder), "--dtype", "float32",
              "--batch", "3", "--max-new-tokens", "8"]
    code, _, err = run_cli(monkeypatch, capsys, *common, "--tokens", "50")
    assert code == 0, err
    manifest, stored = answer_store.load(out)
    assert manifest["answer_tokens"] >= 50 and manifest["target"] == str(tiny_folder) and manifest["dtype"] == "float32"
    assert "tokens/s" in err and {a.source for a in stored} <= {"sharegpt", "stdlib"}
    code, _, err = run_cli(monkeypatch, capsys, *common, "--tokens", "80")
    assert code == 0, err
    assert answer_store.load(out)[1][: len(stored)] == stored and answer_store.load(out)[0]["answer_tokens"] >= 80
    for wrong, message in [(["--sampled-share", "2"], "sampled_share must be between 0 and 1"),
                           (["--batch", "0"], "--batch must be at least 1"),
                           (["--seed", "5"], "holds answers made with seed=0, not 5")]:
        code, _, err = run_cli(monkeypatch, capsys, *common, "--tokens", "80", *wrong)
        assert code == 2 and message in " ".join(err.split()) and "Traceback" not in err, err
    code, _, err = run_cli(monkeypatch, capsys, *common, "--tokens", "80", "--target", str(tmp_path / "none"))
    assert code == 2 and "Traceback" not in err
    code, _, err = run_cli(monkeypatch, capsys, "train", "pack", str(out))
    assert code == 0 and "answers-000.jsonl.xz" in " ".join(err.split()), err
    code, _, err = run_cli(monkeypatch, capsys, "train", "pack", str(tmp_path))  # not an answers folder
    assert code == 2 and "holds no answers" in " ".join(err.split()) and "Traceback" not in err


BITS = [8, pytest.param(4, marks=pytest.mark.skipif(not int4.available(), reason="no int4 kernel"))]


@pytest.mark.parametrize("bits", BITS)
def test_features_kept_while_answering_are_the_targets_own(three_layers, sources, tmp_path, monkeypatch, bits):
    models = load_models(str(three_layers), None, dtype=f"int{bits}", progress=False)
    monkeypatch.setattr(features, "SHARD_TOKENS", 150)  # several shards
    run_answers(models, sources, tmp_path, tokens=60, keep_features=True)
    run_answers(models, sources, tmp_path, tokens=160, keep_features=True)  # the folder is added to
    stored = {a.id: a for a in answer_store.load(tmp_path)[1]}
    manifest, shards = features.load(answer_store.features_folder(tmp_path))
    layers = default_layers(3)
    assert manifest["aux_layers"] == list(layers) and manifest["target_key"] == models.target.cost_key
    assert len(shards) > 2 and sorted(i for s in shards for i in s.ids) == sorted(stored)
    assert manifest["assistant_tokens"] == sum(len(a.answer_ids) - 1 for a in stored.values())
    for shard in shards:
        for ident, (tokens, hidden, assistant, aux) in zip(shard.ids, shard.sequences_with_aux()):
            answer = stored[ident]
            fed = answer.prompt_ids + answer.answer_ids[:-1]  # the last token is never fed
            assert tokens.tolist() == fed
            assert assistant.tolist() == [False] * len(answer.prompt_ids) + [True] * (len(answer.answer_ids) - 1)
            models.target.reset()  # the sequence alone, teacher-forced: the quantized path is batch-invariant
            alone = models.target.forward(torch.tensor(fed), output_hidden=(*layers, 3)).hidden.to(torch.bfloat16)
            assert torch.equal(aux, alone[:, : 3 * 64]) and torch.equal(hidden, alone[:, 3 * 64 :]), ident


def test_training_reads_the_kept_features_and_extracts_the_rest(three_layers, sources, tmp_path):
    from specdecode.cli.train import _target_features

    models = load_models(str(three_layers), None, dtype="int8", progress=False)
    run_answers(models, sources, tmp_path / "answers", tokens=50)  # none kept
    run_answers(models, sources, tmp_path / "answers", tokens=120, keep_features=True)
    kept = {i for s in features.load(answer_store.features_folder(tmp_path / "answers"))[1] for i in s.ids}
    every = {a.id for a in answer_store.load(tmp_path / "answers")[1]}
    assert kept and kept < every
    _, describe, shards = _target_features(str(three_layers), tmp_path / "data", 0, 0, dtype="int8", eagle3=True,
                                           answers_folder=tmp_path / "answers")
    extracted = {i for s in features.load(tmp_path / "data")[1] for i in s.ids}
    assert extracted == every - kept
    assert sorted(i for s in shards for i in s.ids) == sorted(every)  # each answer once
    assert describe["data"]["sequences"] == len(every) and all(s.aux is not None for s in shards)


def test_no_extract_learns_from_the_kept_features_alone(three_layers, sources, tmp_path):
    from specdecode.cli.train import _target_features

    models = load_models(str(three_layers), None, dtype="int8", progress=False)
    run_answers(models, sources, tmp_path / "answers", tokens=50)  # none kept
    with pytest.raises(UserError, match="--no-extract"):
        _target_features(str(three_layers), None, 0, 0, dtype="int8", eagle3=True,
                         answers_folder=tmp_path / "answers", extract=False)
    run_answers(models, sources, tmp_path / "answers", tokens=120, keep_features=True)
    kept = {i for s in features.load(answer_store.features_folder(tmp_path / "answers"))[1] for i in s.ids}
    _, describe, shards = _target_features(str(three_layers), None, 0, 0, dtype="int8", eagle3=True,
                                           answers_folder=tmp_path / "answers", extract=False)
    assert sorted(i for s in shards for i in s.ids) == sorted(kept)  # the answers made without them are left out
    assert describe["data"]["sequences"] == len(kept) and all(s.aux is not None for s in shards)
    assert not (tmp_path / "data").exists()


def test_a_head_carried_on_records_its_lineage(three_layers, sources, tmp_path, monkeypatch, capsys):
    models = load_models(str(three_layers), None, dtype="int8", progress=False)
    run_answers(models, sources, tmp_path / "answers", tokens=120, keep_features=True)
    common = ["train", "eagle3", "--target", str(three_layers), "--dtype", "int8",
              "--answers", str(tmp_path / "answers"),
              "--no-extract", "--tokens", "0", "--epochs", "1", "--intermediate-size", "16", "--vocab-size", "16"]
    code, _, err = run_cli(monkeypatch, capsys, *common, "--out", str(tmp_path / "first"))
    assert code == 0, err
    code, _, err = run_cli(monkeypatch, capsys, *common, "--out", str(tmp_path / "second"),
                           "--init", str(tmp_path / "first"))
    assert code == 0, err
    first = json.loads((tmp_path / "first" / "eagle3.json").read_text())
    second = json.loads((tmp_path / "second" / "eagle3.json").read_text())
    assert "init" not in first
    assert second["init"] == {"folder": str(tmp_path / "first"), "data": first["data"], "init": None}


def test_train_eagle3_says_which_features_it_lacks(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "train", "eagle3", "--out", str(tmp_path / "head"))
    assert code == 2 and "--data" in err
    code, _, err = run_cli(monkeypatch, capsys, "train", "eagle3", "--out", str(tmp_path / "head"), "--no-extract")
    assert code == 2 and "--answers" in err and "--tokens 0" in err


@pytest.mark.parametrize("command", [["eagle", "--data", "DATA"], ["eagle3", "--data", "DATA"],
                                     ["medusa", "--data", "DATA"], ["data"]], ids=lambda c: c[0])
@pytest.mark.parametrize("device", ["nope", "cuda:7"])
def test_train_refuses_a_device_it_cannot_use_in_one_line(monkeypatch, capsys, tmp_path, command, device):
    """`train ... --device`: a device this machine lacks fails at once (before any model loads or any folder
    is written) with a one-line error (the console may wrap it) and exit code 2."""
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that GPU")
    args = [str(tmp_path / "data") if a == "DATA" else a for a in command]
    code, _, err = run_cli(monkeypatch, capsys, "train", *args, "--out", str(tmp_path / "out"), "--device", device)
    message = " ".join(err.split())
    assert code == 2 and message.startswith("error:") and "Traceback" not in err, err
    assert ("unknown device 'nope'" if device == "nope" else "--device cuda:7") in message
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()


def test_train_data_takes_no_device_on_a_ray_cluster(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "train", "data", "--out", str(tmp_path / "out"), "--ray", "local",
                           "--device", "cpu")
    assert code == 2 and err.startswith("error:") and "Ray" in err and "Traceback" not in err, err


def test_an_extraction_cut_short_carries_on(three_layers, sources, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    models = load_models(str(three_layers), None, dtype="float32", progress=False)
    run_answers(models, sources, tmp_path / "answers", tokens=100)
    sequences = answer_store.sequences(tmp_path / "answers")
    monkeypatch.setattr(features, "SHARD_TOKENS", 100)
    model, real, calls = models.target.model, features.hidden_states, []

    def failing(*args, **kwargs):  # the run is killed at its sixth sequence
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(features, "hidden_states", failing)
    with pytest.raises(KeyboardInterrupt):
        features.extract(model, sequences, tmp_path / "cut", {"target": "tiny"}, progress=False)
    assert len(features.missing(tmp_path / "cut", sequences)) == len(sequences) - 5  # the five finished are kept
    monkeypatch.setattr(features, "hidden_states", real)
    features.extract(model, sequences, tmp_path / "cut", {"target": "tiny"}, progress=False)
    features.extract(model, sequences, tmp_path / "whole", {"target": "tiny"}, progress=False)
    (cut_manifest, cut), (whole_manifest, whole) = features.load(tmp_path / "cut"), features.load(tmp_path / "whole")
    assert cut_manifest["sequences"] == whole_manifest["sequences"] == len(sequences)
    by_id = lambda shards: {i: seq for s in shards for i, seq in zip(s.ids, s.sequences())}  # noqa: E731
    a, b = by_id(cut), by_id(whole)
    assert a.keys() == b.keys() and all(all(torch.equal(x, y) for x, y in zip(a[i], b[i])) for i in a)
    on_disk = load_file(str(tmp_path / "whole" / whole_manifest["shards"][0]["file"]))  # mapped = read
    assert torch.equal(on_disk["hidden"], whole[0].hidden) and torch.equal(on_disk["tokens"].long(), whole[0].tokens)
    with pytest.raises(UserError, match="aux_layers"):
        features.extract(model, sequences, tmp_path / "whole", {"target": "tiny"}, progress=False, layers=(0, 1, 2))


def test_a_kill_keeps_the_finished_answers_and_their_features(three_layers, sources, tmp_path, monkeypatch):
    """`kill` (SIGTERM) ends `specdecode` as Ctrl-C does (`cli.main` installs the handler), so the data job
    writes the features of every answer it stored before it exits, not only full shards."""
    import os
    import signal

    from specdecode import cli

    models = load_models(str(three_layers), None, dtype="int8", progress=False)
    monkeypatch.setattr(features, "SHARD_TOKENS", 10**6)  # no shard fills up on its own
    ticks = iter(range(10**6))

    def clock() -> float:  # the kill comes after a few answers
        tick = next(ticks)
        if tick == 40:
            os.kill(os.getpid(), signal.SIGTERM)
        return float(tick)

    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli, "app", lambda: None)
    cli.main()
    try:
        assert signal.getsignal(signal.SIGTERM) is cli._interrupt
        with pytest.raises(KeyboardInterrupt):
            run_answers(models, sources, tmp_path, tokens=10**6, keep_features=True, clock=clock)
    finally:
        signal.signal(signal.SIGTERM, previous)
    stored = answer_store.load(tmp_path)[1]
    kept = features.load(answer_store.features_folder(tmp_path))[1]
    assert len(stored) >= 2 and sorted(i for s in kept for i in s.ids) == sorted(a.id for a in stored)


def test_damaged_manifests_and_shards_are_one_line(models, sources, tmp_path):
    """A manifest that is no JSON, a shard of features cut short: one line naming the file and what to do."""
    run_answers(models, sources, tmp_path / "answers", tokens=20)
    manifest = tmp_path / "answers" / answer_store.MANIFEST
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(UserError, match=r"answers.json \(an answers manifest\) is damaged.*specdecode train data"):
        answer_store.load(tmp_path / "answers")
    sequences = [corpus.Sequence("stdlib", [1, 2, 3, 4], [False, False, True, True])]
    features.extract(models.target.model, sequences, tmp_path / "features", {"target": "tiny"}, progress=False)
    shard = next((tmp_path / "features").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(UserError, match="a shard of features.*is damaged"):
        features.load(tmp_path / "features")
