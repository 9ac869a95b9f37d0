"""The registry of decoding methods: a name, what it needs, and how to build its drafter.

The CLI, the Python API and the benchmark all enumerate this one table. A method that can draft a token
tree as well as a chain takes `DrafterOptions(tree=True)`; by name, the tree form is `NAME-tree` (and
`draft-tree-fixed` is the draft model's tree in a fixed shape, for comparison).

A method is resolved once, where a request for it comes in (a command, the server's start-up, the Python
API's entry points), by `choose`: into a `MethodChoice` (the method, its validated options, the sources it
drafts from), which is passed down as it is; the loaded models build its drafter and engine from it
(`api.Models.engine_for`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.drafters.options import DEFAULT_CHOICES, DrafterOptions  # DrafterOptions re-exported here
from specdecode.errors import UserError

if TYPE_CHECKING:
    from specdecode.drafters.base import Drafter
    from specdecode.models.base import CausalLM

# (target, draft, options) -> its drafter
Builder = Callable[["CausalLM", "CausalLM | None", DrafterOptions], "Drafter | None"]


def _named(path: str) -> Callable:
    """The function at "module:name", imported on first use: the registry is read (the command line's
    choices, `specdecode methods`) without importing a drafter, torch or transformers."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    needs_draft_model: bool
    builder: str | None  # "module:function", a `Builder`; None: plain decoding, no drafter
    lossless: bool = True
    tree: bool = False  # offers a token-tree form
    choices: bool = False  # its tree can take a fixed shape
    takes: tuple[str, ...] = ()  # the outside sources it drafts from: "datastore", "reference", "head"
    # drafts without running a model of its own or the target (a trained head that reads the target's features
    # runs for a batch's sequences in one call), so the server decodes its requests in a batch (`engine.batch`;
    # its drafters say so too: `Drafter.batchable`). In the batch `auto` drafts without its draft-model fallback
    # and without a head of EAGLE's kind (a KV cache of its own)
    batchable: bool = False
    # the kind of head trained for the target it drafts with ("eagle", "eagle3", "medusa": `specdecode train
    # KIND`, a folder given as `head`); the repository ships one of each for the default target only
    head: str | None = None
    # runs the target's own layers or reads its hidden states: the torch backend only
    torch_only: bool = False
    # its tree form grows the tree in the draft model's cache, which a llama.cpp draft model cannot hold
    # (`CausalLM.grows_trees`): its chain runs on llama.cpp, its tree on torch only
    tree_torch_only: bool = False
    # drafts from the text of earlier requests its drafter served: a server keeps one drafter per owner
    # (tenant), so that no request's drafts, rejected text or token origins carry another's text
    remembers: bool = False
    # how drafts are verified ("module:function"): exact (greedy match, speculative sampling) unless the
    # method is lossy
    verified_by: str = "specdecode.verify.tree:verify"
    # its chain form drafts with a model whose tokenizer differs from the target's (through text,
    # `drafters.other_tokenizer`)
    other_tokenizer: bool = False
    # drafts with the draft model where one with the target's tokenizer is loaded, and without one otherwise;
    # a method that also takes a head (auto) only where no head drafts (`MethodChoice.loads_draft_model`)
    uses_draft_model: bool = False
    # runs the target's layers over the target's own KV cache (self-speculation): the dynamic path's cache
    # (`api.Models.target_for`), not the static path's
    shares_target_cache: bool = False

    @property
    def loads_draft_model(self) -> bool:
        """Whether a command running it loads the draft model: it needs one, or uses one where loaded."""
        return self.needs_draft_model or self.uses_draft_model

    @property
    def trained(self) -> bool:
        """Drafts with a head trained for the target."""
        return self.head is not None

    @property
    def verifier(self) -> Callable:
        """Its verification function (`verified_by`, imported)."""
        return _named(self.verified_by)

    def drafter(self, target: CausalLM, draft: CausalLM | None,
                options: DrafterOptions | None = None) -> Drafter | None:
        """Its drafter for these models, `options` as `choose` validated them (None: plain decoding)."""
        options = options or DrafterOptions()
        if options.draft_tokenizer is not None and (options.tree or not self.other_tokenizer):
            raise UserError(
                f"method {name_of(self, options)!r} needs a draft model with the target's tokenizer; this one's "
                f"differs. Drafting across tokenizers: {', '.join(other_tokenizer_methods())} (chains only)")
        if self.builder is None:
            return None
        return _named(self.builder)(target, draft, options)


_DRAFTERS = "specdecode.drafters."  # the package of the builders below

METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("auto", "the default: one composite of what the loaded models allow, asked cheapest first and each "
               "only while it pays on the request: prompt lookup, the suffix cache, retrieval where a datastore "
               "is given, one trained head of the target (the one given, else Medusa, else EAGLE-3; torch), the "
               "draft model as the fallback where one is loaded; merged into one tree sized on the cost curve",
               False, _DRAFTERS + "auto:build_auto",
               takes=("datastore", "reference", "head"), remembers=True, uses_draft_model=True, batchable=True),
        Method("ar", "plain autoregressive decoding (the baseline)", False, None, batchable=True),
        Method("draft", "an independent draft model drafts a chain (adaptive length) or an EAGLE-2-style tree; "
               "the chain also from a model with another tokenizer, translated through text",
               True, _DRAFTERS + "draft_model_tree:build_draft_model", tree=True, choices=True, other_tokenizer=True,
               tree_torch_only=True),
        Method("pld", "prompt lookup: copy what followed the last n-gram earlier (tree: every match)",
               False, _DRAFTERS + "prompt_lookup:build_prompt_lookup", tree=True, takes=("reference",), batchable=True),
        Method("rest", "retrieval (REST): the most frequent continuations of the context's longest suffix in "
               "a corpus datastore, by default the Python standard library (tree: all of them, as a trie)",
               False, _DRAFTERS + "retrieval:build_retrieval", tree=True, takes=("datastore",), batchable=True),
        Method("jacobi", "Jacobi decoding: the target's own predictions from its last forward are the next "
               "guesses, iterated to a fixed point by verification", False, _DRAFTERS + "jacobi:build_jacobi",
               batchable=True),
        Method("lookahead", "lookahead decoding: a Jacobi window rides in every forward and harvests n-grams; "
               "pool n-grams starting with the last token are verified as a tree", False,
               _DRAFTERS + "lookahead:build_lookahead"),
        Method("layerskip", "self-speculation: the target drafts with a searched subset of its own layers over "
               "its own KV cache (Draft & Verify, SWIFT)", False, _DRAFTERS + "self_speculative:build_layerskip",
               torch_only=True, shares_target_cache=True),
        Method("earlyexit", "self-speculation by early exit: the target's first k layers (k searched), then its "
               "final norm and LM head", False, _DRAFTERS + "self_speculative:build_earlyexit", torch_only=True,
               shares_target_cache=True),
        Method("sparse-kv", "self-speculation with a compressed cache: the target drafts over StreamingLLM's "
               "cache (4 sink entries and the last 512) and verifies over its whole cache; for long inputs",
               False, _DRAFTERS + "sparse_kv:build_sparse_kv", torch_only=True, shares_target_cache=True),
        Method("sparse-kv-pld", "sparse-kv under prompt lookup: copies from the input where lookup finds one, the "
               "compressed-cache self-draft where it does not; for long inputs", False,
               _DRAFTERS + "sparse_kv:build_sparse_kv_lookup", takes=("reference",), torch_only=True,
               shares_target_cache=True),
        Method("suffix", "suffix decoding: what followed the context's suffix in this request and in earlier "
               "ones the drafter served (tree: all of it, as a trie)", False, _DRAFTERS + "suffix:build_suffix",
               tree=True, remembers=True, batchable=True),
        Method("eagle", "EAGLE: a trained one-layer head on the target's own features drafts a chain scored by "
               "its confidence (tree: EAGLE-2's dynamic tree; the default target's head ships with the package, "
               "`specdecode train eagle` trains one)", False, _DRAFTERS + "eagle:build_eagle", tree=True, head="eagle",
               takes=("head",), torch_only=True),
        Method("eagle3", "EAGLE-3: a trained head on three of the target's layers (low, middle, high), trained on "
               "its own drafts for several steps (training-time test) and on the target's own answers; a chain "
               "(tree: EAGLE-2's dynamic tree; `specdecode train eagle3` trains one, `specdecode export eagle` "
               "writes it for vLLM and SGLang)", False, _DRAFTERS + "eagle3:build_eagle3", tree=True, head="eagle3",
               takes=("head",), torch_only=True),
        Method("eagle3-online", "EAGLE-3 whose head keeps learning while it serves (online speculative decoding): "
               "after each sequence a few optimiser steps on the tokens the target wrote and its features "
               "(the verifications' own), replayed with the sequences before; kept per owner, never saved",
               False, _DRAFTERS + "online:build_eagle3_online", tree=True, head="eagle3", takes=("head",),
               torch_only=True, remembers=True),
        Method("medusa", "Medusa: trained heads on the target's last hidden state guess the next tokens at once; "
               "a chain of their top tokens (tree: the best paths through their top-k; the default target's "
               "heads ship with the package, `specdecode train medusa` trains them)", False,
               _DRAFTERS + "medusa:build_medusa", tree=True, head="medusa", takes=("head",), torch_only=True,
               batchable=True),
        Method("medusa-typical", "Medusa's tree under typical acceptance: LOSSY, a drafted token the target "
               "finds plausible enough is kept (exact under greedy decoding)", False,
               _DRAFTERS + "medusa:build_medusa_tree", lossless=False, head="medusa", takes=("head",), torch_only=True,
               verified_by="specdecode.verify.typical:verify_typical", batchable=True),
        Method("composite", "prompt lookup and retrieval, plus the draft model only where they promise less "
               "than one accepted token, merged into one tree (a chain unless --tree)",
               True, _DRAFTERS + "composite:build_composite", tree=True, takes=("datastore", "reference")),
    ]
}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise UserError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}") from None


def takers(source: str) -> str:
    """The methods that draft from an outside source (`Method.takes`), for messages: "pld and composite"."""
    return " and ".join(name for name, m in METHODS.items() if source in m.takes)


def tree_methods() -> list[str]:
    return [name for name, m in METHODS.items() if m.tree]


def other_tokenizer_methods() -> list[str]:
    """The methods whose draft model may have another tokenizer than the target's."""
    return [name for name, m in METHODS.items() if m.other_tokenizer]


def variant_names() -> list[str]:
    """Every method by name, tree forms included: what the benchmark can run."""
    names = []
    for name, m in METHODS.items():
        names += [name] + ([f"{name}-tree"] if m.tree else []) + ([f"{name}-tree-fixed"] if m.choices else [])
    return names


def resolve(spec: str) -> tuple[Method, DrafterOptions]:
    """A method by name, tree forms included: `draft`, `draft-tree`, `draft-tree-fixed`, `pld-tree`..."""
    for suffix, options in (("-tree-fixed", DrafterOptions(tree=True, choices=DEFAULT_CHOICES)),
                            ("-tree", DrafterOptions(tree=True))):
        if spec.endswith(suffix) and spec[: -len(suffix)] in METHODS:
            method = METHODS[spec[: -len(suffix)]]
            if (options.choices and method.choices) or (not options.choices and method.tree):
                return method, options
    if spec in METHODS:
        return METHODS[spec], DrafterOptions()
    raise UserError(f"unknown method {spec!r}; choose one of: {', '.join(variant_names())}")


def parse_choices(text: str) -> tuple[tuple[int, ...], ...]:
    """A choices list as the CLI takes it: JSON such as [[0], [1], [0, 0]], or `default`."""
    import json

    if text == "default":
        return DEFAULT_CHOICES
    from specdecode.tree.structure import from_choices

    try:
        parsed = json.loads(text)
        if not isinstance(parsed, list) or not all(
                isinstance(c, list) and all(type(r) is int for r in c) for c in parsed):  # (not 1.5, not true)
            raise ValueError("each rank is a whole number")
        choices = tuple(tuple(choice) for choice in parsed)
    except ValueError as error:
        raise UserError(
            f"tree choices must be a JSON list of lists of ranks, e.g. [[0], [1], [0, 0]]: {error}") from None
    from_choices(choices)  # every prefix present, ranks >= 0
    return choices


def name_of(method: Method, options: DrafterOptions) -> str:
    """The display name of a method in a form: `draft`, `draft-tree`, `draft-tree-fixed`."""
    if not options.tree:
        return method.name
    return f"{method.name}-tree" + ("-fixed" if options.choices is not None else "")


@dataclass(frozen=True)
class MethodChoice:
    """A method resolved once (`choose`) and passed down as it is: the method, its options (chain or tree,
    the tree's budget or fixed shape, the datastore it retrieves from, the trained head it drafts with), and
    the text of the document it copies from. What depends on the loaded models (the reference's token ids, the
    tokenizers) they add when they build its drafter (`api.Models.drafter_for`)."""

    method: Method
    options: DrafterOptions = DrafterOptions()
    reference: str | None = None  # a document's text to copy from (pld, composite)

    @property
    def name(self) -> str:
        """Its display name: `draft`, `draft-tree`, `draft-tree-fixed`."""
        return name_of(self.method, self.options)

    def runs_on(self, backend: str) -> bool:
        """Whether it runs on `backend` (llama.cpp: not a method that reads the target's layers or hidden states,
        nor a tree grown in the draft model's cache)."""
        torch_only = self.method.torch_only or (self.method.tree_torch_only and self.options.tree)
        return backend != "llamacpp" or not torch_only

    def check_backend(self, backend: str) -> None:
        """A UserError, before any model loads, where it cannot run on `backend` (`runs_on`)."""
        if self.runs_on(backend):
            return
        why = ("grows its tree in the draft model's own cache, which a llama.cpp model cannot hold: use its chain"
               if not self.method.torch_only else "runs the target's own layers or reads its hidden states")
        raise UserError(f"{self.name} {why}; run it on the torch backend (--backend torch)")

    def loads_draft_model(self, target, backend: str = "torch") -> bool:
        """Whether a command running it on `target` (a name or path, or a loaded model) loads the draft model:
        its method needs one, or uses one where loaded (`Method.loads_draft_model`) and, taking a head, has no
        trained head to draft with instead (given, or shipped for the target: `drafters.auto.drafts_with_head`)."""
        if self.method.needs_draft_model:
            return True
        if not self.method.uses_draft_model:
            return False
        if "head" not in self.method.takes:
            return True
        from specdecode.drafters.auto import drafts_with_head

        return not drafts_with_head(target, self.options.head, backend)

    @property
    def tree_budget(self) -> int | str | None:
        """Tree nodes verified per step: a number, "whole" (a fixed shape), "auto" (from the cost curve), or
        None for a chain."""
        if not self.options.tree:
            return None
        return self.options.budget or ("whole" if self.options.choices else "auto")


def choose(
    spec: str,
    *,
    tree: bool = False,
    budget: int | None = None,
    choices: tuple[tuple[int, ...], ...] | None = None,
    datastore: str | Path | None = None,
    reference: str | None = None,
    head: str | Path | None = None,
    only_if_taken: bool = False,
) -> MethodChoice:
    """Resolve a method by name (`resolve`; `tree` switches it to its tree form, `budget` and `choices`
    as `DrafterOptions`) with the sources it drafts from, and check them all: a UserError of one line
    otherwise. A datastore, reference or trained head (a folder written by `specdecode train KIND --out`) the
    method does not draft from is refused, or with `only_if_taken` dropped (a server's or a benchmark's
    sources, shared by every method it runs: a head goes to the methods of its kind)."""
    if not isinstance(spec, str):
        raise UserError(f"a method is named by a string (`specdecode methods`), got {spec!r}")
    if not isinstance(tree, bool):
        raise UserError(f"tree is True or False, got {tree!r}")
    method, named = resolve(spec)
    if budget is not None and not method.tree:
        sized = " (it sizes its tree on the cost curve)" if method.name == "auto" else ""
        raise UserError(f"method {method.name!r} takes no budget{sized}; a budget sizes the trees of "
                        f"{', '.join(tree_methods())}")
    options = DrafterOptions(tree=tree or named.tree, budget=budget,
                             choices=choices if choices is not None else named.choices)
    if options.tree and not method.tree:
        raise UserError(f"method {method.name!r} has no tree form; drop --tree (tree methods: "
                        f"{', '.join(tree_methods())})")
    if options.choices is not None and not method.choices:
        raise UserError(f"method {method.name!r} takes no fixed tree shape")

    def taken(source: str, value):
        if value is None or source in method.takes:
            return value
        if only_if_taken:
            return None
        raise UserError(f"--{source} applies to {takers(source)}, not {method.name}")

    datastore, reference, head = taken("datastore", datastore), taken("reference", reference), taken("head", head)
    if reference is not None and (not isinstance(reference, str) or not reference):
        raise UserError("the reference document is empty" if isinstance(reference, str) else
                        f"a reference is the document's text (a str), not {type(reference).__name__}")
    if datastore is not None and not Path(datastore).expanduser().is_file():
        raise UserError(f"no datastore at {datastore} (build one with `specdecode datastore build`)")
    if head is not None:
        from specdecode.drafters.heads import kind_of  # (torch: imported only when a head is given)

        if method.head is None:  # a method that drafts with a head of any kind (auto)
            kind_of(head)  # a folder holding one
        elif kind_of(head) != method.head:
            if not only_if_taken:
                raise UserError(f"{head} holds {kind_of(head)} heads; {method.name} drafts with {method.head} heads "
                                f"(`specdecode train {method.head} --out DIR`)")
            head = None
    return MethodChoice(method, replace(options, datastore=str(datastore) if datastore is not None else None,
                                        head=str(Path(head).expanduser()) if head is not None else None),
                        reference)
