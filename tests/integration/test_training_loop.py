"""The shared training loop (`training.loop.optimise`) in bounded runs: a schedule cut into pieces by
kills, carried on from its checkpoint, ends with exactly the weights of one uninterrupted run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode.errors import UserError
from specdecode.training.loop import Schedule, TrainingRecord, held_out, optimise, split

SCHEDULE = Schedule(seconds=1e9, epochs=3, learning_rate=1e-2, warmup_steps=2, batch_windows=1, seed=3)


def _windows() -> list:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 3, (10,), generator=generator), torch.randn(10, 4, generator=generator),
             torch.ones(10, dtype=torch.bool)) for _ in range(11)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _loss(model):
    def loss(window):
        tokens, features, _ = window
        noisy = features + 0.1 * torch.rand_like(features)  # the global generator, as EAGLE's feature noise
        value = F.cross_entropy(model(noisy).float(), tokens)
        return value, {"ce": value.detach()}, len(tokens)
    return loss


def test_a_run_killed_twice_and_carried_on_ends_like_one_run(tmp_path):
    windows = _windows()
    whole, whole_record = _model(), TrainingRecord(settings={})
    optimise(whole, _loss(whole), windows, SCHEDULE, whole_record, "whole", progress=False)

    checkpoint, calls = tmp_path / "checkpoint.pt", 0
    for kill_at in (5, 19, None):  # the loss call of each run that it is killed at (None: it finishes)
        model, record = _model(), TrainingRecord(settings={})  # a new process: fresh weights and record
        loss, calls = _loss(model), 0

        def dying(window, loss=loss, kill_at=kill_at):
            nonlocal calls
            calls += 1
            if calls == kill_at:
                raise KeyboardInterrupt
            return loss(window)

        try:
            optimise(model, dying, windows, SCHEDULE, record, "piece", progress=False, checkpoint=checkpoint,
                     checkpoint_seconds=0.0)  # saves after every step
        except KeyboardInterrupt:
            assert kill_at is not None and checkpoint.exists()
            continue
        assert kill_at is None
    assert not checkpoint.exists()  # the schedule completed
    assert record.steps == whole_record.steps == 33
    assert record.tokens_seen == whole_record.tokens_seen
    assert len(whole_record.losses) == 1  # logged every 20 steps; the piece that logged it was not the last
    assert [entry["ce"] for entry in record.losses] == [entry["ce"] for entry in whole_record.losses]
    for name, tensor in whole.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_ctrl_c_saves_at_the_steps_end_and_the_run_carries_on(tmp_path):
    """Ctrl-C in the middle of a step lets the step end, saves it (every five minutes is all the loop does
    otherwise) and stops; the next run ends with one uninterrupted run's weights. A second Ctrl-C stops at once."""
    import gc
    import os
    import signal

    windows = _windows()
    whole = _model()
    optimise(whole, _loss(whole), windows, SCHEDULE, TrainingRecord(settings={}), "whole", progress=False)
    checkpoint = tmp_path / "checkpoint.pt"
    gc.collect()  # (a Ctrl-C that lands in a finaliser the collector runs is reported there and lost: none runs)
    gc.disable()
    try:
        for presses in (1, 2):
            model, calls = _model(), 0

            def pressed(window, model=model, presses=presses):
                nonlocal calls
                calls += 1
                if calls == 7:
                    for _ in range(presses):
                        os.kill(os.getpid(), signal.SIGINT)
                return _loss(model)(window)

            with pytest.raises(KeyboardInterrupt):
                optimise(model, pressed, windows, SCHEDULE, TrainingRecord(settings={}), "piece", progress=False,
                         checkpoint=checkpoint)  # saves every five minutes: only at the Ctrl-C here
            if presses == 1:
                assert torch.load(checkpoint, weights_only=False)["step"] == 7  # the step it was pressed in, ended
                checkpoint_after_one = checkpoint.read_bytes()
                checkpoint.unlink()
            else:
                assert not checkpoint.exists()  # stopped at once: nothing saved
    finally:
        gc.enable()
    checkpoint.write_bytes(checkpoint_after_one)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler put back
    model, record = _model(), TrainingRecord(settings={})
    optimise(model, _loss(model), windows, SCHEDULE, record, "rest", progress=False, checkpoint=checkpoint)
    assert record.steps == 33 and not checkpoint.exists()
    for name, tensor in whole.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_checkpoint_of_other_settings_is_refused(tmp_path):
    windows, checkpoint = _windows(), tmp_path / "checkpoint.pt"
    model, calls = _model(), 0

    def dying(window):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise KeyboardInterrupt
        return _loss(model)(window)

    with pytest.raises(KeyboardInterrupt):
        optimise(model, dying, windows, SCHEDULE, TrainingRecord(settings={}), "piece", progress=False,
                 checkpoint=checkpoint, checkpoint_seconds=0.0)
    assert checkpoint.exists()
    other = Schedule(**{**vars(SCHEDULE), "learning_rate": 1e-3})
    with pytest.raises(UserError, match="other settings"):
        optimise(_model(), _loss(model), windows, other, TrainingRecord(settings={}), "other", progress=False,
                 checkpoint=checkpoint)
    with pytest.raises(UserError, match="other settings"):  # other data
        optimise(_model(), _loss(model), windows[:-1], SCHEDULE, TrainingRecord(settings={}), "other", progress=False,
                 checkpoint=checkpoint)
    # another time budget is the same schedule: it carries on from step 3
    longer, record = Schedule(**{**vars(SCHEDULE), "seconds": 2e9}), TrainingRecord(settings={})
    optimise(model, _loss(model), windows, longer, record, "longer", progress=False, checkpoint=checkpoint)
    assert record.steps == 33 and not checkpoint.exists()


def test_held_out_sequences_stay_held_out_as_the_data_grows():
    def keyed(count):  # three windows a sequence, each naming its sequence
        return [(f"answer-{i}", (f"answer-{i}", part)) for i in range(count) for part in range(3)]

    small_training, small_held = split(keyed(200), seed=0)
    large_training, large_held = split(keyed(2000), seed=1)
    assert set(small_held) <= set(large_held) and not set(small_held) & set(large_training)
    held_keys = {key for key, _ in large_held}
    assert len(large_held) == 3 * len(held_keys)  # a sequence's windows all on one side
    assert 0.02 < len(held_keys) / 2000 < 0.08 and held_keys == {f"answer-{i}" for i in range(2000)
                                                                  if held_out(f"answer-{i}")}
    assert len(split(keyed(1), seed=0)[1]) == 1  # a tiny data set still shows one window


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_features_with_no_window_to_train_on_are_a_user_error(kind, tmp_path):
    """Every sequence shorter than a window: Medusa and EAGLE saved an untrained head ("0 steps", accuracy nan)
    where EAGLE-3 said so."""
    import importlib

    from conftest import TOKENS, tiny_chat_qwen2
    from specdecode.training import corpus, features

    module = importlib.import_module(f"specdecode.training.{kind}")
    model = tiny_chat_qwen2(vocab_size=len(TOKENS), seed=2, layers=3)
    short = [corpus.Sequence("sharegpt", list(range(10 + i, 15 + i)), [False, False, True, True, True])
             for i in range(6)]
    features.extract(model, short, tmp_path, {"target": "tiny"}, progress=False)
    sizes = {"intermediate_size": 32} if kind == "eagle" else {}
    settings = module.TrainingSettings(vocab_size=64, epochs=1, **sizes)
    with pytest.raises(UserError, match="no window long enough"):
        module.train(model, features.load(tmp_path)[1], settings, progress=False)


def test_the_draft_vocabulary_keeps_the_end_of_answer_ids_within_its_size():
    """The end-of-answer ids are the highest of a Qwen2.5 vocabulary: cutting the sorted set at `size` dropped them,
    and a head could never draft the end of an answer."""
    from specdecode.training.features import Shard
    from specdecode.training.loop import frequent_tokens

    tokens = torch.tensor([5, 5, 5, 7, 7, 9, 3, 1000, 1000, 1000])  # (1000: a common token above the end ids)
    shard = Shard(tokens, torch.zeros(10, 2), torch.ones(10, dtype=torch.bool), torch.tensor([0, 10]))
    chosen = frequent_tokens([shard], 4, [998, 999]).tolist()
    assert chosen == [5, 998, 999, 1000]  # the two most frequent others, then the end ids: 4 in all
    assert frequent_tokens([shard], 10, [998]).tolist() == [3, 5, 7, 9, 998, 1000]
