"""Retrieval drafting (REST, He et al. 2024): copy what followed the context's end in a corpus.

No model: a *datastore* holds a tokenized corpus and its suffix array. Each step finds the longest
suffix of the context (2 to 16 tokens) that occurs in the corpus, gathers what followed its
occurrences, and drafts either the most frequent continuation (a chain) or all of them merged into a
trie and pruned to the nodes that pay on the target's cost curve (a tree). Where the corpus has nothing
to say, the step is plain decoding.

Glossary, on top of `specdecode.types`:

- *datastore*: one flat int32 array of corpus tokens, each document followed by `SEPARATOR` (an id no
  context ever holds, so no match spans two documents), and its suffix array.
- *match*: the longest suffix of the context found in the corpus, and the block of suffix-array rows
  of the suffixes that begin with it (its *occurrences*).
- *continuation*: the tokens after one occurrence, up to the draft depth or the end of its document.
- a trie node's *count*: the occurrences considered whose continuation passes through it; its score is
  count / occurrences considered, times the running calibration of predicted against accepted tokens.
The default datastore is the Python standard library's own source (see `default_datastore`), built on
first use for the target's tokenizer and cached as one .npz file.

By concept: `datastore` holds a tokenized corpus, its suffix array and the lookups (`Datastore`,
`open_datastore`); `build` tokenizes a corpus into one, the standard-library default included, and caches
it; `drafter` turns matches into drafts (`RetrievalDrafter`, `RetrievalTreeDrafter`, `build_retrieval`;
the trie of continuations is `tree.trie`'s). Tests patch `PIECE_CHARS`, `stdlib_folder` and `default_datastore_path`
on `build`, where they act.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdecode.drafters.retrieval.build import (
        STDLIB_SKIP, build_datastore, corpus_files, default_datastore,
    )
    from specdecode.drafters.retrieval.datastore import (
        SEPARATOR, Datastore, DatastoreInfo, SuffixRange, join_documents, open_datastore, suffix_array,
    )
    from specdecode.drafters.retrieval.defaults import DEFAULT_MAX_TOKENS, DEFAULT_PATTERN
    from specdecode.drafters.retrieval.drafter import (
        RetrievalDrafter, RetrievalTreeDrafter, build_retrieval, heaviest_path,
    )

# Each name is imported from its module on first use (PEP 562): `specdecode datastore build` shows the
# defaults without importing numpy, and datastores are built and read without importing torch.
_MODULES = {
    **dict.fromkeys(["DEFAULT_MAX_TOKENS", "DEFAULT_PATTERN"], "defaults"),
    **dict.fromkeys(["STDLIB_SKIP", "build_datastore", "corpus_files", "default_datastore"], "build"),
    **dict.fromkeys(["SEPARATOR", "Datastore", "DatastoreInfo", "SuffixRange", "join_documents", "open_datastore",
                     "suffix_array"], "datastore"),
    **dict.fromkeys(["RetrievalDrafter", "RetrievalTreeDrafter", "build_retrieval", "heaviest_path"], "drafter"),
}


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)


__all__ = [
    "DEFAULT_MAX_TOKENS", "DEFAULT_PATTERN", "SEPARATOR", "STDLIB_SKIP", "Datastore", "DatastoreInfo", "SuffixRange",
    "RetrievalDrafter", "RetrievalTreeDrafter", "build_datastore", "build_retrieval",
    "corpus_files", "default_datastore", "heaviest_path", "join_documents", "open_datastore", "suffix_array",
]
