"""The Python API: load a target (and a draft model), pick a method, generate.

    import specdecode
    result = specdecode.generate("def fib(n):", method="draft", max_new_tokens=64)
    print(result.text, result.tokens_per_second, result.mean_accepted_tokens)

Models may be given as registered names, .gguf paths, local folders or hub ids, or as already loaded
transformers models (then pass `tokenizer=` too).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode import devices
from specdecode.constraints import Constraint
from specdecode.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from specdecode.engine.prompts import token_ids
from specdecode.errors import UserError
from specdecode.drafters.base import Drafter
from specdecode.methods import MethodChoice, choose
from specdecode.models.base import CausalLM
from specdecode.models.loading import (
    check_logits_cover,
    check_same_vocabulary,
    draft_dtype as resolve_draft_dtype,
    gguf_path,
    load_causal_lm,
    load_gguf_lm,
    resolve_dtype,
    same_vocabulary,
)
from specdecode.models.static import StaticCausalLM, torch_lm
from specdecode.models.registry import DEFAULT_DRAFTER, DEFAULT_TARGET, get_model, registered_models
from specdecode.types import SamplingParams

log = logging.getLogger("specdecode")


@dataclass
class Models:
    """A target model, its tokenizer, and optionally a draft model: with the same vocabulary, or with
    its own tokenizer (`draft_tokenizer`), for the methods that translate its drafts through text."""

    target: CausalLM  # HFCausalLM on the torch backend, LlamaCppLM on llama.cpp
    tokenizer: PreTrainedTokenizerBase
    draft: CausalLM | None = None
    # the GGUF file the target came from (a registered model or a .gguf path), for llama.cpp as a peer of
    # torch runs; None: loaded from a folder or the hub
    target_gguf: Path | None = None
    # the draft model's tokenizer when it differs from the target's; None: the draft model has the target's
    draft_tokenizer: PreTrainedTokenizerBase | None = None

    def require_draft(self) -> CausalLM:
        if self.draft is None:
            raise UserError("this method needs a draft model: give one (--drafter, or drafter= in Python)")
        return self.draft

    def engine(
        self,
        method: str,
        *,
        tree: bool = False,
        budget: int | None = None,
        choices: tuple[tuple[int, ...], ...] | None = None,
        datastore: str | None = None,
        reference: str | None = None,
        head: str | Path | None = None,
    ) -> SpeculativeEngine:
        """An engine for a method by name (`draft`, `draft-tree`, `pld-tree`...); `tree=True` switches a
        method to its tree form, `budget` fixes the tree nodes verified per step (default: chosen from
        the target's measured cost curve), `choices` gives the tree a fixed shape, `datastore` is a
        retrieval datastore's path (default: the Python standard library's), `reference` a document's
        text to draft from and `head` a trained head's folder (`specdecode train KIND --out`; default: the one
        shipped for the target), for the methods that take them (`Method.takes`, a head the methods of its
        kind; the others ignore them). The method is resolved here (`methods.choose`); `engine_for` takes one
        resolved already."""
        return self.engine_for(choose(method, tree=tree, budget=budget, choices=choices, datastore=datastore,
                                      reference=reference, head=head, only_if_taken=True))

    def engine_for(self, choice: MethodChoice) -> SpeculativeEngine:
        """An engine for a resolved method (`methods.choose`)."""
        return SpeculativeEngine(self.target_for(choice), self.tokenizer, self.drafter_for(choice), method=choice.name,
                                 tree_budget=choice.tree_budget, verifier=choice.method.verifier)

    def drafter_for(self, choice: MethodChoice) -> Drafter | None:
        """A new drafter for one sequence (None for plain decoding), as `engine_for` would make it: the
        choice's options with what depends on these models (the reference's token ids, the tokenizers)."""
        method = choice.method
        reference_ids = (tuple(self.tokenizer.encode(choice.reference, add_special_tokens=False))
                         if choice.reference else None)
        options = replace(choice.options, reference_ids=reference_ids, tokenizer=self.tokenizer,
                          draft_tokenizer=self.draft_tokenizer if method.needs_draft_model else None)
        draft = self.require_draft() if method.needs_draft_model else None
        if method.uses_draft_model and self.draft_tokenizer is None:  # merged by token ids: the target's tokenizer
            draft = self.draft
        return method.drafter(self.target_for(choice), draft, options)

    def target_for(self, choice: MethodChoice) -> CausalLM:
        """The target as the method runs it: a method that runs the target's layers over the target's own cache
        (`Method.shares_target_cache`) gets a static target's dynamic twin (`StaticCausalLM.twin`)."""
        if choice.method.shares_target_cache and isinstance(self.target, StaticCausalLM):
            return self.target.twin
        return self.target

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt; with chat=True, as the single user turn of the chat template."""
        if not prompt:  # (blanks are a prompt: an indentation to carry on, as the server takes them)
            raise UserError("the prompt is empty")
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def encode_chat(self, messages: list[dict], tools: list[Any] | None = None, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, add_special_tokens: bool = False) -> list[int]:
        """Token ids of a conversation in the chat template, ready for the assistant's next turn; `tools`: OpenAI's
        function definitions, which the template renders its own way. vLLM's /tokenize fields: the assistant's turn
        not opened, the last message continued instead, the tokenizer's own special tokens around the template's."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError("this tokenizer has no chat template; drop --chat")
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 tokenize=not add_special_tokens)
        if add_special_tokens:  # (the rendered text)
            ids = self.tokenizer(ids, add_special_tokens=True)["input_ids"]
        if isinstance(ids, Mapping):  # a BatchEncoding (newer transformers)
            ids = ids["input_ids"]
        return list(cast("list[int]", ids))  # one conversation, tokenized: its ids


def _load(model: str | PreTrainedModel, tokenizer, dtype, progress: bool, device: torch.device | None,
          exact_int8: bool = True):
    """A model and its tokenizer, on `device` (None: an already loaded model stays where it is)."""
    if isinstance(model, PreTrainedModel):
        if tokenizer is None:
            raise UserError("pass tokenizer= together with an already loaded model")
        # (transformers wraps PreTrainedModel.to in a decorator typed as an unbound function)
        model = model if device is None else model.to(device)  # type: ignore[arg-type]
        return model.eval().requires_grad_(False), tokenizer
    return load_causal_lm(model, dtype=dtype, progress=progress, exact_int8=exact_int8,
                          device=device if device is not None else "auto")


def load_models(
    target: str | PreTrainedModel = DEFAULT_TARGET,
    drafter: str | PreTrainedModel | None = DEFAULT_DRAFTER,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    draft_tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | str = "auto",
    draft_dtype: torch.dtype | str = "auto",
    progress: bool = True,
    backend: str = "torch",
    device: torch.device | str | None = None,
    static: bool | None = None,
) -> Models:
    """Load a target and (optionally) a draft model. The target runs in `dtype`: "auto" (the fastest of
    bfloat16, float32, int8 and int4 on this machine, `models.precision`), or one of them. The draft model's
    `draft_dtype` "auto" is int4 where its kernel runs, else int8 (`models.loading.draft_dtype`): cheaper per
    draft token on a CPU, and lossless all the same, since the target verifies every token. A drafter whose
    tokenizer differs from the target's is kept with its tokenizer: the methods that can draft across
    tokenizers translate its drafts through text (`specdecode methods`), the others refuse it. With already
    loaded models, `tokenizer` is the target's and `draft_tokenizer` the drafter's (default: `tokenizer`).

    backend="llamacpp" runs .gguf files (or registered models) through llama.cpp as they are; dtypes
    do not apply there (the file's quantization is the model).

    `device`: where the torch backend runs ("auto": CUDA where torch sees one, else the CPU; "cpu", "cuda",
    "cuda:N", "mps"); the draft model goes to the target's device. None: "auto" for models loaded by name,
    and an already loaded model stays where it is. `static`: the torch backend's static-shape path, its
    forwards captured as CUDA graphs (`models.static`); None: on a CUDA device, for the models it fits.
    `drafter` "none" (`--drafter none`) loads none, as None does. `progress` False: no status line, progress bar or
    note of a one-time measurement (the models' cost curves, measured on first use) on the console."""
    if isinstance(drafter, str) and drafter.strip().lower() == "none":  # (not a hub id: no model is called that)
        drafter = None
    if backend == "llamacpp":
        if any(str(d) != "auto" for d in (dtype, draft_dtype)):
            raise UserError("dtypes choose the torch backend's precision; llama.cpp runs a .gguf file's own "
                            "quantization: leave --dtype and --draft-dtype out with --backend llamacpp")
        if device is not None:
            devices.refuse_off_cpu(devices.resolve(device), "the llama.cpp backend as shipped",
                                   "use --backend torch there (llama-cpp-python built with CUDA is not set up)")
        return _quiet(_load_llamacpp(target, drafter, progress), progress)
    if backend != "torch":
        raise UserError(f"unknown backend {backend!r}; choose torch or llamacpp")
    asked = None if device is None else devices.resolve(device)
    target_model, target_tokenizer = _load(target, tokenizer, dtype, progress, asked)
    on = target_model.device  # the one device: the draft model and every drafter follow the target
    draft = other_tokenizer = None
    if drafter is not None:
        draft_model, draft_tokenizer = _load(drafter, draft_tokenizer or tokenizer,
                                             resolve_draft_dtype(draft_dtype, on), progress, on, exact_int8=False)
        if same_vocabulary(target_tokenizer, draft_tokenizer):
            check_same_vocabulary(target_tokenizer, draft_tokenizer, target_model, draft_model)
        else:
            check_logits_cover(target_tokenizer, target_model, "target")
            check_logits_cover(draft_tokenizer, draft_model, "drafter")
            other_tokenizer = draft_tokenizer
        draft = torch_lm(draft_model, static, progress)
    target_lm = torch_lm(target_model, static, progress)
    if draft is not None and draft.weight_bytes_per_token >= target_lm.weight_bytes_per_token:
        # (the gate then keeps the draft model's methods plain, which looked like a drafter that never agrees)
        log.warning("the draft model reads as many weights a token as the target, or more: its drafts cost at least "
                    "what they could save, so the methods that draft with it will draft little or nothing (give a "
                    "smaller --drafter)")
    return _quiet(Models(target_lm, target_tokenizer, draft, target_gguf=gguf_of(target),
                         draft_tokenizer=other_tokenizer), progress)


def _quiet(models: Models, progress: bool) -> Models:
    """`models` whose one-time measurements on first use print nothing where `progress` is off."""
    for lm in (models.target, models.draft):
        if lm is not None:
            lm.quiet = not progress
    return models


def _prompt_ids(prompt) -> list[int]:
    """A prompt that is not a text as its token ids, as the engines take them (a list or tuple, a tensor of one row,
    numpy's integers); a UserError that names both kinds of prompt for what is neither."""
    if not (isinstance(prompt, list | tuple | torch.Tensor) or hasattr(prompt, "__array__")):  # (numpy's arrays)
        raise UserError(f"the prompt is a text or a list of token ids, not {type(prompt).__name__}")
    return token_ids(prompt)


def gguf_of(spec) -> Path | None:
    """The GGUF file a target spec names, if any."""
    if not isinstance(spec, str):
        return None
    if spec in registered_models():
        return gguf_path(get_model(spec))
    return Path(spec).expanduser() if spec.endswith(".gguf") else None


def _load_llamacpp(target, drafter, progress: bool) -> Models:
    if isinstance(target, PreTrainedModel) or isinstance(drafter, PreTrainedModel):
        raise UserError("the llama.cpp backend loads .gguf files, not transformers models")
    target_lm, tokenizer = load_gguf_lm(target, progress=progress)
    draft_lm, other_tokenizer = None, None
    if drafter is not None:  # one of another vocabulary is kept with its tokenizer, as on torch (`load_models`)
        draft_lm, draft_tokenizer = load_gguf_lm(drafter, progress=progress)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab() or draft_lm.vocab_size != target_lm.vocab_size:
            other_tokenizer = draft_tokenizer
    return Models(target_lm, tokenizer, draft_lm, draft_tokenizer=other_tokenizer)


# `generate`'s models by how they were asked for (models passed in are not kept: they are the caller's), and its
# engines (a method that remembers earlier requests, suffix decoding, remembers earlier calls; a head is read once)
_loaded: dict[tuple, Models] = {}
_engines: collections.OrderedDict[tuple, SpeculativeEngine] = collections.OrderedDict()
KEPT_ENGINES = 8
_LOADING = threading.Lock()  # (threads that make the first call load the models once; it guards the two above)
# one call at a time on each kept models' cache: threads calling `generate` at once take turns (an engine of theirs
# would refuse a second sequence), and no other code holds these models, so a turn always ends
_turns: dict[tuple, threading.Lock] = {}


def _kept_as(spec: Any) -> Any:
    """How a model's name is known among the kept models: a local path as its full path (with or without a trailing
    slash, it is one folder)."""
    return str(Path(spec).resolve()) if isinstance(spec, str) and Path(spec).exists() else spec


def generate(
    prompt: str | list[int] | tuple[int, ...] | torch.Tensor | Any,  # Any: numpy's integers
    *,
    method: str = "auto",  # the composite that fits the loaded models (docs/methods/index.md)
    target: str | PreTrainedModel = DEFAULT_TARGET,
    drafter: str | PreTrainedModel | None = DEFAULT_DRAFTER,
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | str = "auto",
    draft_dtype: torch.dtype | str = "auto",
    chat: bool = False,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: str | tuple[str, ...] | list[str] = (),  # a stop string, or several
    tree: bool = False,
    budget: int | None = None,
    backend: str = "torch",
    device: torch.device | str | None = None,
    head: str | Path | None = None,
    constraint: Constraint | None = None,
    datastore: str | Path | None = None,
    reference: str | None = None,
    choices: tuple[tuple[int, ...], ...] | None = None,
) -> GenerationResult:
    """Generate with one method; models loaded by name are kept for the next call, and so is each method's engine (the
    last KEPT_ENGINES used: a method that remembers earlier requests, suffix decoding, remembers earlier calls; models
    passed in are the caller's to keep, and are not). Threads calling it at once on the same models take turns.
    `device` as in `load_models`; `head`: a trained head's folder for the head methods (`specdecode train KIND --out`);
    `constraint`: the language the output must belong to (`Constraint.json_schema(schema)`, `.json_object()`,
    `.regex(pattern)`, `.grammar(lark)`), enforced losslessly under every method (docs/structured-output.md);
    `datastore`, `reference` and `choices` as `Models.engine` takes them (a retrieval datastore's path, a document's
    text to draft from, a fixed tree shape), for the methods that take them."""
    ids = None if isinstance(prompt, str) else _prompt_ids(prompt)  # before any model loads
    if chat and ids is not None:
        raise UserError("chat=True puts a text in the chat template; token ids are fed as they are (drop chat=True)")
    choice = choose(method, tree=tree, budget=budget, head=head, datastore=datastore, reference=reference,
                    choices=choices)  # before any model loads
    choice.check_backend(backend)
    needs_draft = choice.loads_draft_model(target, backend)
    kept = not any(isinstance(model, PreTrainedModel) for model in (target, drafter))
    # (a tokenizer given is keyed by its id, which its kept models hold on to: no other object can take it)
    key = (_kept_as(target), _kept_as(drafter) if needs_draft else None,
           id(tokenizer) if tokenizer is not None else None,
           *(str(resolve_dtype(d)) for d in (dtype, draft_dtype)), backend, str(device or "auto"))
    with _LOADING:
        models = _loaded.get(key) if kept else None
        if models is None:
            models = load_models(target, drafter if needs_draft else None, tokenizer=tokenizer, dtype=dtype,
                                 draft_dtype=draft_dtype, backend=backend, device=device)
            if kept:
                _loaded[key] = models
        turn = _turns.setdefault(key, threading.Lock()) if kept else threading.Lock()
    ids = models.encode(cast(str, prompt), chat=chat) if ids is None else ids
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        stop=cast("tuple[str, ...]", stop),  # (GenerationConfig takes one text, or a list, too)
        seed=seed,
        constraint=constraint,
    )
    with turn:  # (an engine is built in its models' turn: a first measurement of its cost runs on their cache)
        with _LOADING:
            engine = _engines.pop((key, choice), None) if kept else None
        if engine is None:
            engine = models.engine_for(choice)
        if kept:
            with _LOADING:  # (the latest used last: the least recently used goes first)
                _engines[(key, choice)] = engine
                while len(_engines) > KEPT_ENGINES:
                    _engines.popitem(last=False)
        return engine.generate(ids, config)
