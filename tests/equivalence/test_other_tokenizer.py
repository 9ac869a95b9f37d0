"""A draft model with another tokenizer than the target's (`drafters.other_tokenizer`): the boundary
between the context and the translated draft, greedy equivalence over many prompts, sampled output
against the target's exact distribution, and the API, command line and server taking such a drafter.

The tokenizers are trained here on a few paragraphs with the `tokenizers` library: a byte-level BPE for
the target (as Qwen's), a WordPiece and a Metaspace BPE (as SentencePiece models') for the drafters. A
random tiny draft model seldom agrees with a random tiny target, so the greedy tests also draft with an
oracle: a fake model that writes, in its own tokens, the target's greedy text (with a seeded share of
wrong tokens), so drafts are accepted as well as rejected.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from conftest import greedy_references, greedy_runs, tiny_qwen2, tiny_tokenizer
from conftest import run_cli as run
from fakes import FakeLM
from goodness_of_fit import assert_follows, chi_square, continuations, engine_outcomes, model_logits
from specdecode.api import load_models
from specdecode.drafters.other_tokenizer import (
    OtherTokenizerDrafter,
    Retokenizer,
    added_text,
    context_window,
    translate,
    whole_characters,
)
from specdecode.engine import GenerationConfig, SpeculativeEngine
from specdecode.errors import UserError
from specdecode.models.costs import CostCurve
from specdecode.models.hf import HFCausalLM
from specdecode.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PARAGRAPHS = [
    "The cat sat on the mat, and the dog sat by the door. The cat looked at the dog; the dog looked away.",
    "Speculative decoding drafts a few tokens cheaply and verifies them with one forward of the target model.",
    "A café on the corner serves crème brûlée to naïve tourists who pay twelve euros for a small plate.",
    "One, two, three: the numbers 12, 345 and 6789 are written in words and in digits alike, as they were.",
    "When the rain stopped, the children ran outside to play in the puddles until their mother called them in.",
    "Every function returns a value; a function that returns nothing returns None, which is a value too.",
]
WORDS = " ".join(PARAGRAPHS).split()


def byte_level_bpe(vocab_size: int, texts=PARAGRAPHS) -> PreTrainedTokenizerFast:
    """A byte-level BPE (Qwen's and GPT-2's kind), its byte alphabet the bytes of `texts` only."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=[]))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def word_piece(vocab_size: int, texts=PARAGRAPHS) -> PreTrainedTokenizerFast:
    """A cased WordPiece (BERT's kind): words and punctuation apart, `##` inside words, spaces implied."""
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def metaspace_bpe(vocab_size: int, texts=PARAGRAPHS) -> PreTrainedTokenizerFast:
    """A BPE over characters with spaces as `▁` (SentencePiece's kind, Llama's and Mistral's), with a
    beginning-of-sequence token."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")


DRAFT_TOKENIZERS = {"wordpiece": lambda: word_piece(220), "metaspace": lambda: metaspace_bpe(260)}


@functools.cache
def target_tokenizer() -> PreTrainedTokenizerFast:
    return byte_level_bpe(300)


@functools.cache
def target_model():
    return tiny_qwen2(seed=3, layers=2, hidden=64, vocab=len(target_tokenizer()))


def text_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 2 to 12 consecutive words of the paragraphs, in target tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        start, length = (int(torch.randint(0, len(WORDS) - 12, (), generator=g)),
                         int(torch.randint(2, 13, (), generator=g)))
        prompts.append(target_tokenizer().encode(" ".join(WORDS[start : start + length])))
    return prompts


def stable_hash(sequence: tuple[int, ...], seed: int) -> int:
    key = seed
    for token in sequence:
        key = (key * 1_000_003 + token + 1) % (1 << 61)
    return key


class Oracle:
    """Logits of a draft model that knows the target's greedy continuations (`texts`, whole texts of
    prompt and continuation): after a prefix of one of them in draft tokens, its next draft token (`end`
    after the whole), but a wrong one after one prefix in `wrong_every`; after anything else a token
    fixed by a hash."""

    def __init__(self, tokenizer, texts: list[str], wrong_every: int = 6, seed: int = 0, end: int | None = None):
        self.vocab, self.wrong_every, self.seed = len(tokenizer), wrong_every, seed
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        ending = [end] if end is not None else []  # a token after each text
        self.references = [tuple(bos + tokenizer.encode(text, add_special_tokens=False) + ending) for text in texts]

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019  (instances live as long as the tests)
    def __call__(self, sequence: tuple[int, ...]) -> torch.Tensor:
        key = stable_hash(sequence, self.seed)
        following = [r[len(sequence)] for r in self.references
                     if len(r) > len(sequence) and r[: len(sequence)] == sequence]
        token = following[0] if following else key % self.vocab
        if following and key % self.wrong_every == 0:
            token = (token + 1 + key // self.wrong_every % (self.vocab - 1)) % self.vocab
        logits = torch.zeros(self.vocab)
        logits[token] = 10.0
        return logits


# --- The boundary: merges, whole characters, the draft's spacing --------------------------------------


def test_a_context_token_that_would_merge_with_the_text_proposes_nothing():
    tokenizer = tiny_tokenizer()  # byte-level, with the merges Ġ t -> Ġt, h e -> he, Ġt he -> Ġthe
    context = tokenizer.encode("a t", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(context) == ["a", "Ġt"]
    assert translate(tokenizer, context, "he cat", final=True) == []  # " t" + "he" is one token " the"
    context = tokenizer.encode("a the", add_special_tokens=False)
    tokens = translate(tokenizer, context, " cat the", final=True)
    assert tokenizer.decode(tokens) == " cat the"
    assert tokenizer.convert_ids_to_tokens(translate(tokenizer, context, " cat the")) == ["Ġ", "c", "a", "t"]


def test_the_last_token_is_dropped_unless_the_text_ends():
    tokenizer = tiny_tokenizer()
    context = tokenizer.encode("x", add_special_tokens=False)
    # "the" might go on as "there": only with final=True is its token certain
    assert tokenizer.convert_ids_to_tokens(translate(tokenizer, context, " a the")) == ["Ġ", "a"]
    assert tokenizer.convert_ids_to_tokens(translate(tokenizer, context, " a the", final=True)) == ["Ġ", "a", "Ġthe"]


def test_incomplete_characters_are_cut():
    tokenizer = tiny_tokenizer()
    assert whole_characters("ab\ufffdcd") == "ab" and whole_characters("café") == "café"
    cafe = tokenizer.encode("café", add_special_tokens=False)  # é is two byte tokens
    # draft tokens that end inside a character: their text ends with a replacement character, cut
    assert added_text(tokenizer, cafe[:2], cafe[2:-1]) == "f\ufffd"
    assert translate(tokenizer, cafe[:2], "f\ufffd", final=True) == [cafe[2]]
    assert added_text(tokenizer, cafe[:2], cafe[2:]) == "fé"
    # a context ending inside a character: the target must finish it, nothing is proposed
    assert context_window(tokenizer, cafe[:-1]) is None
    # a window that would start inside a character grows back to its first byte
    context = tokenizer.encode("xé", add_special_tokens=False) + tokenizer.encode("abc", add_special_tokens=False)
    assert context_window(tokenizer, context) == context[-5:]
    assert tokenizer.decode(context_window(tokenizer, context)) == "éabc"


@pytest.mark.parametrize("kind", list(DRAFT_TOKENIZERS))
def test_added_text_keeps_the_spacing(kind):
    tokenizer = DRAFT_TOKENIZERS[kind]()
    before = tokenizer.encode("the cat sat", add_special_tokens=False)
    whole = tokenizer.encode("the cat sat on the mat", add_special_tokens=False)
    assert whole[: len(before)] == before
    assert added_text(tokenizer, before, whole[len(before):]) == " on the mat"


# --- Greedy: identical to plain decoding ------------------------------------------------------------

GREEDY_PROMPTS, GREEDY_TOKENS = 60, 24


@functools.cache
def greedy_cases() -> tuple[list[list[int]], list[list[int]]]:
    prompts = text_prompts(GREEDY_PROMPTS)
    return prompts, greedy_references(target_model(), prompts, GREEDY_TOKENS)


def oracle_drafter(kind: str, **options) -> OtherTokenizerDrafter:
    prompts, references = greedy_cases()
    target, draft = target_tokenizer(), DRAFT_TOKENIZERS[kind]()
    texts = [target.decode(p + r, skip_special_tokens=True) for p, r in zip(prompts, references)]
    return OtherTokenizerDrafter(FakeLM(Oracle(draft, texts)), target, draft, draft_cost=0.05,
                                 curve=CostCurve.linear(0.05), **options)


@pytest.mark.parametrize("kind", list(DRAFT_TOKENIZERS))
def test_greedy_output_is_plain_decoding_with_an_agreeing_drafter(kind):
    prompts, references = greedy_cases()
    engine = SpeculativeEngine(HFCausalLM(target_model()), target_tokenizer(), oracle_drafter(kind))
    drafted = accepted = 0
    for _, _, result in greedy_runs(engine, prompts, references, [GREEDY_TOKENS]):
        drafted += sum(s.drafted for s in result.steps)
        accepted += sum(s.accepted for s in result.steps)
    print(f"{kind}: {accepted} of {drafted} drafted tokens accepted over {len(prompts)} prompts")
    assert drafted > 0 and 0.2 < accepted / drafted < 1.0  # accepts and rejects both


def test_greedy_output_is_plain_decoding_with_a_random_drafter():
    prompts, references = greedy_cases()
    draft_tokenizer = DRAFT_TOKENIZERS["metaspace"]()
    pair = load_models(target_model(), tiny_qwen2(seed=4, layers=1, hidden=32, vocab=len(draft_tokenizer)),
                       tokenizer=target_tokenizer(), draft_tokenizer=draft_tokenizer, dtype="float32",
                       draft_dtype="float32", progress=False)
    assert pair.draft_tokenizer is draft_tokenizer
    engine = pair.engine("draft")
    assert isinstance(engine.drafter, OtherTokenizerDrafter)
    drafted = 0
    for _, _, result in greedy_runs(engine, prompts, references, [GREEDY_TOKENS]):
        drafted += sum(s.drafted for s in result.steps)
    assert drafted > 0


def test_the_draft_cache_is_kept_across_steps():
    """The draft model is fed what changed since the last step, not the whole context again."""
    prompts, references = greedy_cases()
    drafter = oracle_drafter("wordpiece", adaptive=False)
    fed = []
    forward = drafter.model.forward
    drafter.model.forward = lambda tokens, **kwargs: fed.append(tokens.numel()) or forward(tokens, **kwargs)
    engine = SpeculativeEngine(HFCausalLM(target_model()), target_tokenizer(), drafter)
    result = engine.generate(prompts[0], GenerationConfig(max_new_tokens=GREEDY_TOKENS))
    assert result.token_ids == references[0]
    whole = len(drafter.draft_ids(prompts[0] + result.token_ids))  # what feeding the whole context would be
    assert len(fed) > 10 and max(fed[1:]) < whole // 2  # after the prompt's prefill, only what changed


def test_a_draft_that_ends_its_text_proposes_the_target_end():
    """The draft model's end of sequence: its text is whole, so its last token is kept, then the target's end."""
    draft = DRAFT_TOKENIZERS["wordpiece"]()
    target = byte_level_bpe(300)
    target.add_special_tokens({"eos_token": "<|end|>"})
    lm = FakeLM(Oracle(draft, ["the cat sat on"], wrong_every=1 << 62, end=draft.unk_token_id))
    lm.eos_token_ids = frozenset({draft.unk_token_id})
    drafter = OtherTokenizerDrafter(lm, target, draft, adaptive=False, num_tokens=6, confidence_threshold=0)
    proposal = drafter.propose(target.encode("the cat"), 8, SamplingParams(), None).tokens.tolist()
    assert target.decode(proposal[:-1]) == " sat on" and proposal[-1] == target.eos_token_id
    # two draft tokens, no end: " on" might go on (" once"), so its token is not proposed
    drafter = OtherTokenizerDrafter(lm, target, draft, adaptive=False, num_tokens=2, confidence_threshold=0)
    proposal = drafter.propose(target.encode("the cat"), 8, SamplingParams(), None).tokens.tolist()
    assert target.decode(proposal) == " sat"


# --- The context retokenized by its end: the same draft ids, a bounded step -------------------------

CODE = "def f(x):\n    return x  +  1\n\n\tprint(f(2))  # done"  # doubled spaces, tabs, new lines
LONG_TEXT = "\n".join([*PARAGRAPHS, CODE, "crème brûlée, naïve"]) * 2


def growing(ids: list[int], seed: int = 0):
    """The prefixes of `ids` a decoding would see: from three tokens on, one to four more at a time."""
    g = torch.Generator().manual_seed(seed)
    n = 3
    while n < len(ids):
        yield ids[:n]
        n += int(torch.randint(1, 5, (), generator=g))


@pytest.mark.parametrize("kind", [*DRAFT_TOKENIZERS, "byte-level"])
def test_the_retokenized_context_is_the_context_encoded_whole(kind):
    """`Retokenizer`, step by step, gives the ids `draft_ids` gets by decoding and encoding the whole context
    (spaces doubled, tabs, new lines, characters of two bytes split across target tokens included)."""
    target = target_tokenizer()
    draft = DRAFT_TOKENIZERS[kind]() if kind in DRAFT_TOKENIZERS else byte_level_bpe(280)
    drafter = OtherTokenizerDrafter(FakeLM(Oracle(draft, [])), target, draft, adaptive=False)
    retokenizer = Retokenizer(target, draft)
    bos = [draft.bos_token_id] if draft.bos_token_id is not None else []
    steps = 0
    for context in growing(target.encode(LONG_TEXT)):
        assert bos + retokenizer(context) == drafter.draft_ids(context), target.decode(context)[-40:]
        steps += 1
    assert steps > 100 and retokenizer.anchor > len(LONG_TEXT) // 2  # the anchors moved along the text
    assert bos + retokenizer(target.encode("another context")) == drafter.draft_ids(target.encode("another context"))


class Counting:
    """A tokenizer that counts the characters it encodes and the tokens it decodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.characters, self.tokens = tokenizer, 0, 0

    def encode(self, text: str, **options):
        self.characters += len(text)
        return self.tokenizer.encode(text, **options)

    def decode(self, ids, **options):
        self.tokens += len(ids)
        return self.tokenizer.decode(ids, **options)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_steps_tokenizer_work_does_not_grow_with_the_context():
    """The drafter decodes and encodes per step what changed and a bounded window around it, not the whole
    context: linear in the length overall, not quadratic."""
    target, draft = Counting(target_tokenizer()), Counting(DRAFT_TOKENIZERS["metaspace"]())
    text = LONG_TEXT * 3
    drafter = OtherTokenizerDrafter(FakeLM(Oracle(draft.tokenizer, [text]), max_context=4096), target, draft,
                                    adaptive=False, num_tokens=4, confidence_threshold=0)
    ids = target.tokenizer.encode(text)
    drafter.begin(ids[:3])
    work = []  # per step: (context tokens, target tokens decoded, draft characters encoded)
    for context in growing(ids):
        before = target.tokens, draft.characters
        drafter.propose(context, 8, SamplingParams(), None)
        work.append((len(context), target.tokens - before[0], draft.characters - before[1]))
    late = [w for w in work if w[0] > len(ids) // 2]
    assert len(late) > 50 and late[0][0] > 300
    assert max(decoded for _, decoded, _ in late) <= 150 and max(encoded for _, _, encoded in late) <= 400


# --- Sampling: the output follows the target's distribution -----------------------------------------
#
# A target of 8 tokens over a three-letter alphabet (so every continuation's probability is enumerated
# by goodness_of_fit.continuations) and a draft model of another tokenizer over the same letters; the
# first two tokens of 1,200 runs of four tokens (the first step drafts up to three), chi-square at 1e-4
# with power at least 0.9 against a 10% total-variation error (goodness_of_fit.assert_follows).

LETTERS = ["ab ba abba", "a b ab ba", "baab abab", "bb aa ab", "aba bab a b"] * 4
SAMPLING_RUNS = 1200


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_k=3), SamplingParams(0.7, top_p=0.5)],
                         ids=["top3", "t0.7-top0.5"])
def test_sampled_output_follows_the_target_distribution(params):
    target_tokenizer_small = byte_level_bpe(8, LETTERS)
    draft_tokenizer_small = metaspace_bpe(9, LETTERS)
    assert target_tokenizer_small.get_vocab() != draft_tokenizer_small.get_vocab()
    target = tiny_qwen2(seed=21, layers=2, hidden=32, vocab=len(target_tokenizer_small))
    with torch.no_grad():  # flatten the distributions so every pair has mass
        target.lm_head.weight.mul_(0.15)
    draft = tiny_qwen2(seed=22, layers=1, hidden=32, vocab=len(draft_tokenizer_small))
    pair = load_models(target, draft, tokenizer=target_tokenizer_small, draft_tokenizer=draft_tokenizer_small,
                       dtype="float32", draft_dtype="float32", progress=False)
    engine = pair.engine("draft")
    engine.drafter.adaptive, engine.drafter.num_tokens, engine.drafter.confidence_threshold = False, 4, 0.0
    prompt = target_tokenizer_small.encode("ab ba ab")
    outcomes = engine_outcomes(engine, prompt, 2, params, SAMPLING_RUNS, max_new_tokens=4)
    print(f"{params}: of {outcomes.runs} runs, {outcomes.deep_drafts} drafted two deep, "
          f"{outcomes.corrections} had a correction, {outcomes.deep_bonus} a bonus after two accepted")
    assert outcomes.deep_drafts > SAMPLING_RUNS // 2 and outcomes.corrections > SAMPLING_RUNS // 10
    assert outcomes.deep_bonus > 0  # drafts accepted, and wholly
    expected = continuations(model_logits(target), prompt, 2, params)
    cells = assert_follows(outcomes.counts, expected, f"other tokenizer, {params}", tv=0.1)
    print(f"chi-square p-value {chi_square(outcomes.counts, expected)[0]:.3f} over {cells} cells")


# --- Methods that cannot, the command line and the server -------------------------------------------


def tiny_granite(vocab: int, seed: int = 5):
    """A tiny random Granite model (a drafter of another family: a Qwen2 folder's tokenizer would load as
    Qwen's, whatever its tokenizer.json says)."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(seed)
    config = GraniteConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return GraniteForCausalLM(config).eval()


def tiny_pair_folders(tmp_path):
    """A target folder (a tiny Qwen2, byte-level BPE; a row more than its tokens, for the <|endoftext|> a
    Qwen2 folder's tokenizer loads with) and a drafter folder (a tiny Granite, WordPiece)."""
    target_tokenizer().save_pretrained(tmp_path / "target")
    tiny_qwen2(seed=3, layers=1, hidden=32, vocab=len(target_tokenizer()) + 1).save_pretrained(tmp_path / "target")
    draft_tokenizer = DRAFT_TOKENIZERS["wordpiece"]()
    draft_tokenizer.save_pretrained(tmp_path / "drafter")
    tiny_granite(len(draft_tokenizer)).save_pretrained(tmp_path / "drafter")
    return tmp_path / "target", tmp_path / "drafter"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_pair_folders(tmp_path_factory.mktemp("pair"))


@pytest.mark.parametrize("method, tree", [("draft", True), ("composite", False)])
def test_methods_that_need_the_same_tokenizer_say_so(folders, method, tree):
    pair = load_models(*map(str, folders), dtype="float32", draft_dtype="float32", progress=False)
    assert pair.draft_tokenizer is not None
    with pytest.raises(UserError, match="target's tokenizer.*draft \\(chains only\\)"):
        pair.engine(method, tree=tree)
    assert pair.engine("pld").drafter is not None  # methods without a draft model do not mind it


def test_the_command_line_takes_a_drafter_with_another_tokenizer(monkeypatch, capsys, folders):
    target, drafter = map(str, folders)
    common = ["--target", target, "--drafter", drafter, "--json", "--max-new-tokens", "16", "--dtype", "float32",
              "--draft-dtype", "float32"]
    _, plain, _ = run(monkeypatch, capsys, "generate", "the cat sat on", "--method", "ar", *common)
    code, spec, _ = run(monkeypatch, capsys, "generate", "the cat sat on", "--method", "draft", *common)
    assert code == 0 and json.loads(spec)["token_ids"] == json.loads(plain)["token_ids"]
    code, _, err = run(monkeypatch, capsys, "generate", "the cat", "--method", "draft", "--tree", *common)
    assert code == 2 and "tokenizer" in err and "Traceback" not in err
    code, out, _ = run(monkeypatch, capsys, "methods")  # the draft column: "any" tokenizer, or "same"
    assert code == 0 and [line.split()[0] for line in out.splitlines() if line.split()[1:2] == ["any"]] == ["draft"]


def test_the_server_serves_a_drafter_with_another_tokenizer(folders):
    import openai

    from specdecode.serve.app import Server, ServerThread, create_app

    pair = load_models(*map(str, folders), dtype="float32", draft_dtype="float32", progress=False)
    with pytest.raises(UserError, match="cannot run here.*tokenizer"):
        Server(pair, "tiny", default_method="draft", methods=["draft", "draft-tree"])
    state = Server(pair, "tiny", default_method="draft", methods=["draft", "ar"])
    running = ServerThread(create_app(state))
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)
        prompt = "the cat sat on"
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                             extra_body={"method": "draft"})
        ids = pair.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        plain = pair.engine("ar").generate(ids, GenerationConfig(max_new_tokens=16)).text
        assert response.choices[0].text == plain
        assert response.model_extra["speculative"]["method"] == "draft"
    finally:
        running.stop()


def test_a_schema_the_tokenizer_cannot_write_is_refused_in_words(folders):
    """This target's tokenizer has no `{` or `"`: the grammar engine's first forced run skipped them, and the first
    token it forced was refused as it was taken (a RuntimeError: the server's 500). Now a UserError at once."""
    from specdecode.constraints import Constraint

    models = load_models(str(folders[0]), None, dtype="float32", progress=False)
    schema = Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    with pytest.raises(UserError, match="tokenizer cannot write"):
        models.engine("ar").generate(models.encode("the cat sat"), GenerationConfig(max_new_tokens=8,
                                                                                    constraint=schema))
