"""Suffix decoding: draft from what followed the context's suffix in earlier requests and in this one.

In the spirit of SuffixDecoding (Oliaro et al. 2024) and llama.cpp's n-gram cache: agents, tools and
templated traffic repeat themselves across requests (the same JSON skeleton, the same tool call, a
re-run of yesterday's prompt), which prompt lookup cannot see since it only reads the current context.
One `SuffixIndex` per drafter keeps the token sequences of every request the drafter has handled (the
current one included, indexed as it grows) under a memory cap, and a lookup returns, for the longest
suffix of the context found in it, what followed each occurrence. The drafter merges those
continuations into a trie weighted by how often, how long and where they matched.

Glossary (on top of `specdecode.types`):

- *sequence*: one request's tokens in the index (its prompt and its output, as the target saw them).
- *open* sequence: the current request's, extended each step; *closed*: an earlier request's.
- *match*: an earlier position whose preceding tokens equal the context's last ones; *matched*: how many
  (at most `max_match`); its *continuation*: the tokens that followed it there.
- *own* match: one in the open sequence (prompt lookup, in effect); *shared* match: one in a closed sequence.

By concept: `index` stores the sequences and finds matches (`SuffixIndex`); `drafter` turns them into
drafts (`SuffixDrafter`, `build_suffix`; the weighted trie and its best path are `tree.trie`'s).
"""

from specdecode.drafters.suffix.drafter import SuffixDrafter, build_suffix
from specdecode.drafters.suffix.index import Match, SuffixIndex

__all__ = ["Match", "SuffixDrafter", "SuffixIndex", "build_suffix"]
