"""A head the user trained (`specdecode train KIND --out DIR`) drafts through `--head DIR` / `head=`: for every
head method, on a tiny target that ships none (so nothing but the folder given can draft); a head whose record
does not fit the target, or a folder of another kind, is refused in one line."""

from __future__ import annotations

import json

import pytest

from conftest import TOKENS, random_eagle3_head, random_eagle_head, random_medusa_heads, tiny_chat_qwen2
from conftest import run_cli as run
from specdecode.api import load_models
from specdecode.engine import GenerationConfig
from specdecode.errors import UserError
from specdecode.methods import METHODS, resolve, variant_names

HEAD_VARIANTS = [name for name in variant_names() if resolve(name)[0].head is not None]
PROMPT = "the cat sat on the mat and"


@pytest.fixture(scope="module")
def target_folder(three_layers):
    """A tiny chat model three layers deep (EAGLE-3 reads three), with no head shipped for it."""
    return three_layers


@pytest.fixture(scope="module")
def models(target_folder):
    return load_models(str(target_folder), None, dtype="float32", progress=False, device="cpu")


@pytest.fixture(scope="module")
def own_heads(models, target_folder, tmp_path_factory):
    """Random heads for the tiny target, saved as `specdecode train KIND --out DIR` saves them."""
    folder = tmp_path_factory.mktemp("own-heads")
    target, record = models.target.model, {"target": str(target_folder)}
    random_eagle_head(target).save(folder / "eagle", record)
    random_eagle3_head(target).save(folder / "eagle3", record)
    random_medusa_heads(target, scale=0.5).save(folder / "medusa", record)
    return folder


@pytest.fixture(scope="module")
def other_heads(tmp_path_factory):
    """Heads trained for another target: as wide, with a larger vocabulary."""
    folder = tmp_path_factory.mktemp("other-heads")
    other = tiny_chat_qwen2(vocab_size=len(TOKENS) + 200, layers=3)
    record = {"target": "another-model"}
    random_eagle_head(other).save(folder / "eagle", record)
    random_eagle3_head(other).save(folder / "eagle3", record)
    random_medusa_heads(other).save(folder / "medusa", record)
    return folder


def test_every_head_method_is_listed():
    assert {resolve(name)[0].head for name in HEAD_VARIANTS} == {"eagle", "eagle3", "medusa"}
    assert {resolve(name)[0].name for name in HEAD_VARIANTS} == {
        "eagle", "eagle3", "eagle3-online", "medusa", "medusa-typical"}


@pytest.mark.parametrize("variant", HEAD_VARIANTS)
def test_every_head_method_drafts_with_a_head_given_as_a_folder(variant, models, own_heads):
    """Without `head=` the tiny target has no head to draft with; with it, greedy output is plain decoding's
    and the head drafted."""
    kind = resolve(variant)[0].head
    with pytest.raises(UserError, match="--head DIR"):
        models.engine(variant)
    ids = models.encode(PROMPT)
    config = GenerationConfig(max_new_tokens=12)
    plain = models.engine("ar").generate(ids, config)
    result = models.engine(variant, head=own_heads / kind).generate(ids, config)
    assert result.token_ids == plain.token_ids
    assert sum(step.drafted for step in result.steps) > 0


def test_a_head_goes_only_to_the_methods_of_its_kind(models, own_heads):
    """A server or benchmark passes --head to every method: those of another kind keep theirs."""
    from specdecode.methods import choose

    assert choose("medusa", head=own_heads / "eagle3", only_if_taken=True).options.head is None
    assert choose("eagle3-online-tree", head=own_heads / "eagle3", only_if_taken=True).options.head == str(
        own_heads / "eagle3")
    with pytest.raises(UserError, match="holds medusa heads; eagle3 drafts with eagle3 heads"):
        choose("eagle3", head=own_heads / "medusa")
    with pytest.raises(UserError, match="--head applies to"):
        choose("suffix", head=own_heads / "eagle3")


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_a_head_trained_for_another_target_is_refused_in_one_line(monkeypatch, capsys, target_folder, other_heads,
                                                                    kind):
    code, _, err = run(monkeypatch, capsys, "generate", PROMPT, "--target", str(target_folder), "--method", kind,
                       "--head", str(other_heads / kind), "--dtype", "float32")
    assert code == 2 and f"the {kind} head in" in err and "trained for another-model" in err
    assert f"vocabulary {len(TOKENS) + 10}" in " ".join(err.split())
    assert err.count("error:") == 1 and "Traceback" not in err


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_head_whose_record_names_another_vocabulary_is_refused(models, tmp_path, kind):
    """Medusa's and EAGLE's weights hold only their draft vocabulary's ids: a head trained over a narrower vocabulary
    of the same width fits by its ids alone; its record's `target_vocab_size` (written by `specdecode train`) says
    whose it is."""
    target = models.target.model
    head = random_eagle_head(target) if kind == "eagle" else random_medusa_heads(target)
    head.save(tmp_path / kind, {"target": "a-narrower-model", "target_vocab_size": target.config.vocab_size - 10})
    with pytest.raises(UserError, match="trained for a-narrower-model"):
        models.engine(kind, head=str(tmp_path / kind))


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_a_damaged_head_is_one_line(models, own_heads, tmp_path, kind):
    """Weights cut short (a kill or a full disk while saving, before saves were atomic) or a record that is no JSON:
    a one-line error naming the file, never a traceback."""
    import shutil

    folder = shutil.copytree(own_heads / kind, tmp_path / kind)
    weights = sorted(folder.glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[:2000])
    with pytest.raises(UserError, match="is damaged") as error:
        models.engine(kind, head=str(folder))
    assert weights.name in str(error.value) or folder.name in str(error.value)
    shutil.copy(own_heads / kind / weights.name, weights)
    record = next(folder.glob("*.json"))
    record.write_text(record.read_text()[:50])
    with pytest.raises(UserError, match="is damaged"):
        models.engine(kind, head=str(folder))


def test_generate_drafts_with_the_head_given(monkeypatch, capsys, target_folder, own_heads):
    args = ["generate", PROMPT, "--target", str(target_folder), "--dtype", "float32", "--json",
            "--max-new-tokens", "10"]
    code, out, _ = run(monkeypatch, capsys, *args, "--method", "ar")
    assert code == 0
    plain = json.loads(out)
    code, out, _ = run(monkeypatch, capsys, *args, "--method", "eagle3", "--head", str(own_heads / "eagle3"))
    assert code == 0
    result = json.loads(out)
    assert result["method"] == "eagle3" and result["token_ids"] == plain["token_ids"]
    code, _, err = run(monkeypatch, capsys, *args, "--method", "eagle3", "--head", str(own_heads / "medusa"))
    assert code == 2 and "holds medusa heads" in err
    code, _, err = run(monkeypatch, capsys, *args, "--method", "eagle3", "--head", str(own_heads))
    assert code == 2 and "holds no trained head" in err


def test_training_into_another_kinds_head_folder_is_refused(monkeypatch, capsys, target_folder, own_heads, tmp_path):
    """A folder holds one head: training another kind into it left both unusable ("holds more than one")."""
    import shutil

    mixed = tmp_path / "mixed"
    shutil.copytree(own_heads / "eagle3", mixed)
    before = sorted(p.name for p in mixed.iterdir())
    code, _, err = run(monkeypatch, capsys, "train", "medusa", "--target", str(target_folder), "--out", str(mixed),
                       "--data", str(tmp_path / "data"), "--seconds", "1")
    assert code == 2 and "holds another kind of head (eagle3.json)" in err
    assert sorted(p.name for p in mixed.iterdir()) == before
    (mixed / "medusa.json").write_text("{}")
    code, _, err = run(monkeypatch, capsys, "generate", PROMPT, "--target", str(target_folder), "--method", "eagle3",
                       "--head", str(mixed))
    assert code == 2 and "more than one trained head (eagle3.json, medusa.json): move all but one" in err


def test_serve_drafts_with_the_head_given(monkeypatch, capsys, target_folder, own_heads):
    import uvicorn

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, log_level, **options: served.update(app=app))
    code, _, err = run(monkeypatch, capsys, "serve", "--target", str(target_folder), "--no-drafter", "--dtype",
                       "float32", "--method", "eagle3", "--methods", "eagle3,eagle3-tree,ar",
                       "--head", str(own_heads / "eagle3"))
    assert code == 0, err
    server = served["app"].state.server
    try:
        offer = server.offer
        assert offer.default.options.head == str(own_heads / "eagle3")
        assert offer.get("eagle3-tree").options.head == str(own_heads / "eagle3")
        ids = server.models.encode(PROMPT)
        config = GenerationConfig(max_new_tokens=10)
        plain = server.models.engine("ar").generate(ids, config)
        served_result = server.models.engine_for(offer.default).generate(ids, config)
        assert served_result.token_ids == plain.token_ids
        assert sum(step.drafted for step in served_result.steps) > 0
    finally:
        server.worker.stop()


def test_bench_refuses_a_head_no_method_of_the_run_drafts_with(own_heads):
    from specdecode.bench.main import check_head

    check_head(str(own_heads / "eagle3"), ["ar", "eagle3-online-tree"])
    with pytest.raises(UserError, match="no method of this run drafts with one"):
        check_head(str(own_heads / "eagle3"), ["ar", "medusa", "hf-plain"])


def test_models_list_shows_the_shipped_heads_and_where_yours_come_from(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "250")
    code, out, _ = run(monkeypatch, capsys, "models", "list")
    assert code == 0 and "--head DIR" in out
    for kind in ("eagle", "eagle3", "medusa"):
        assert f"heads/qwen2.5-coder-1.5b-instruct/{kind}" in out
    assert all(name in out for name, method in METHODS.items() if method.head)
