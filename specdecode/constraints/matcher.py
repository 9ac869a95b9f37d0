"""One sequence's position in a constraint's language (`Matcher`), and the masks speculation needs from it.

Lossless under a constraint means: the target distribution at every position is the target's logits with
the tokens the grammar forbids after the accepted prefix set to -inf, which is what plain constrained
decoding samples. So verification masks every row of a step's logits by the grammar state after that
row's prefix (the context, then the draft's path to the node), advancing the matcher along the draft and
rolling it back (`Matcher.draft_masks`), and a draft is cut at its first forbidden token before the target
sees it (`Matcher.legal_draft`).
"""

from __future__ import annotations

import re

import llguidance
import numpy as np
import torch

from specdecode.devices import to_device
from specdecode.constraints.grammar import Constraint, engine_tokenizer, one_line, refusals
from specdecode.errors import ConstraintError
from specdecode.types import Draft

BITS = 32  # tokens per word of a bitmask
FORBIDDEN = "doesn't satisfy the grammar"  # llguidance's error for a token its mask forbids


class Matcher:
    """Where one sequence stands in its constraint: the tokens allowed next (`allowed`), those the grammar
    forces (`forced`), whether it is complete. `consume` advances it along the accepted tokens."""

    def __init__(self, constraint: Constraint, tokenizer, vocab_size: int, eos_ids: frozenset[int] = frozenset()):
        self.constraint = constraint
        self.vocab_size = vocab_size
        self.words = (vocab_size + BITS - 1) // BITS
        vocabulary = engine_tokenizer(tokenizer, vocab_size, eos_ids)
        with refusals(constraint.kind):
            self._engine = llguidance.LLMatcher(vocabulary, constraint.compiled, log_level=0)
        if self._engine.is_error():
            raise ConstraintError(f"the {constraint.describe()} does not compile: {one_line(self._engine.get_error())}")
        self.eos_ids = frozenset(vocabulary.eos_tokens)  # the target's and the tokenizer's
        # every buffer llguidance writes through a pointer lives on the host, whatever the default device is
        eos = torch.zeros(vocab_size, dtype=torch.bool, device="cpu")
        eos[list(self.eos_ids)] = True
        bitmask = torch.empty(1, self.words, dtype=torch.int32, device="cpu")
        self._engine.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
        something = self._engine.is_accepting() or bool((unpack(bitmask, vocab_size)[0] & ~eos).any())
        if self._engine.is_error() or not something:
            reason = f" ({self._engine.stop_reason()})" if self._engine.is_error() else ""
            raise ConstraintError(f"the {constraint.describe()} admits no output: its language is empty{reason}")
        forced = self.forced()  # (a tokenizer that cannot spell what the grammar forces: forced tokens it refuses)
        if self._engine.validate_tokens(forced) < len(forced):
            raise ConstraintError(f"the {constraint.describe()} begins with text this model's tokenizer cannot "
                                  "write: its language is empty for this model")

    @property
    def complete(self) -> bool:
        """The output is in the language and nothing but the end may follow."""
        return self._engine.is_stopped()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the current state into `bitmask[row]` ([rows, words] int32, host)."""
        if bitmask.device.type != "cpu":
            raise ValueError(f"llguidance writes masks on the host, not on {bitmask.device}")
        target = bitmask[row]
        self._engine.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        self._raise_on_error()

    def allowed(self) -> torch.Tensor:
        """[vocab] bool, on the host: the tokens allowed next."""
        bitmask = torch.empty(1, self.words, dtype=torch.int32, device="cpu")
        self.fill(bitmask, 0)
        return unpack(bitmask, self.vocab_size)[0]

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, canonically tokenized (empty where it leaves a choice)."""
        return [] if self.complete else list(self._engine.compute_ff_tokens())

    def consume(self, tokens: list[int]) -> int:
        """Advance along accepted tokens (each one allowed: verification masked the rest), up to where the
        output is complete; returns how many it took."""
        for taken, token in enumerate(tokens):
            if self.complete:
                return taken
            if not self._engine.consume_token(token):
                error = self._engine.get_error()
                if FORBIDDEN in error:  # verification let a token the mask forbids through: ours to fix
                    raise RuntimeError(f"a token the grammar forbids was accepted: {error}")
                # the engine stopped on the constraint itself (a limit: a schema whose forced run has no end)
                raise ConstraintError(f"the {self.constraint.describe()} cannot be followed: "
                                f"{error.strip().splitlines()[0] if error.strip() else 'the grammar engine stopped'}")
        return len(tokens)

    def legal_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order from the current state, the grammar allows."""
        return self._engine.validate_tokens(tokens)

    def legal_draft(self, draft: Draft, sampled: bool) -> Draft:
        """The draft without what the grammar forbids, before the target sees it. A forbidden token goes with
        everything after it (its subtree in a tree), except under speculative sampling of a draft that comes
        with its distributions (`sampled`): there the first forbidden token stays, to be rejected by the
        verifier, whose residual distribution after it is what keeps the output lossless."""
        if len(draft) == 0:
            return draft
        tokens = draft.tokens.tolist()  # drafts live on the host
        if draft.parents is None:
            legal = self.legal_prefix(tokens)
            return draft if legal == len(tokens) else draft.prefix(min(len(tokens), legal + int(sampled)))
        keep = [ok or (sampled and parent_ok) for ok, parent_ok in self._node_legality(tokens, draft.parents)]
        if all(keep):
            return draft
        return select(draft, [i for i, k in enumerate(keep) if k])

    def _node_legality(self, tokens: list[int], parents: torch.Tensor) -> list[tuple[bool, bool]]:
        """For each node of a tree: (its path is legal, its parent's path is legal)."""
        legal: list[bool] = []
        out = []
        for node, parent in enumerate(parents.tolist()):
            parent_ok = parent < 0 or legal[parent]
            ok = parent_ok and self._path_legal(path_tokens(tokens, parents.tolist(), node))
            legal.append(ok)
            out.append((ok, parent_ok))
        return out

    def _path_legal(self, path: list[int]) -> bool:
        return self.legal_prefix(path) == len(path)

    def draft_masks(self, draft: Draft) -> torch.Tensor:
        """[len(draft) + 1, words] int32 bitmask, on the host: row 0 the tokens allowed after the context, row
        i + 1 those allowed after node i's path (a chain's first i + 1 tokens). A row after a forbidden token
        allows everything: it is never read, as no verifier accepts a token of zero probability."""
        tokens = draft.tokens.tolist()
        bitmask = torch.full((len(tokens) + 1, self.words), -1, dtype=torch.int32, device="cpu")
        self.fill(bitmask, 0)
        parents = list(range(-1, len(tokens) - 1)) if draft.parents is None else draft.parents.tolist()
        walked: list[int] = []  # the nodes the matcher stands after, root first
        for node in range(len(tokens)):
            path = path_nodes(parents, node)
            common = 0
            while common < min(len(walked), len(path) - 1) and walked[common] == path[common]:
                common += 1
            self.rollback(len(walked) - common)
            del walked[common:]
            rest = [tokens[n] for n in path[common:]]
            if self.legal_prefix(rest) < len(rest):
                continue  # a forbidden token on the path: the row stays all-allowed
            self._engine.consume_tokens(rest)
            walked.extend(path[common:])
            self.fill(bitmask, node + 1)  # (once complete: the end alone)
        self.rollback(len(walked))
        return bitmask

    def rollback(self, count: int) -> None:
        """Undo the last `count` tokens consumed."""
        if count:
            self._engine.rollback(count)

    def _raise_on_error(self) -> None:
        if self._engine.is_error():
            # (without the parser's state, statistics and the grammar itself that the engine's message carries)
            error = re.sub(r"<(state|grammar)>.*?</\1>|Parser: \{.*", "", self._engine.get_error(), flags=re.S)
            raise ConstraintError(f"the {self.constraint.describe()} failed: {one_line(error)[:300]}")


def path_nodes(parents: list[int], node: int) -> list[int]:
    """The nodes from the root down to `node` (a chain's: 0..node)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def path_tokens(tokens: list[int], parents: list[int], node: int) -> list[int]:
    return [tokens[n] for n in path_nodes(parents, node)]


def select(draft: Draft, nodes: list[int]) -> Draft:
    """A tree draft reduced to `nodes` (closed under parents, in order), parents renumbered."""
    assert draft.parents is not None
    index = {old: new for new, old in enumerate(nodes)}
    old_parents = draft.parents.tolist()
    parents = torch.tensor([index[old_parents[n]] if old_parents[n] >= 0 else -1 for n in nodes], dtype=torch.long,
                           device="cpu")  # a tree's structure is host data (`tree.structure`)
    picked = torch.tensor(nodes, dtype=torch.long, device="cpu")
    return Draft(
        tokens=draft.tokens[picked.to(draft.tokens.device)],
        probs=None if draft.probs is None else draft.probs[picked.to(draft.probs.device)],
        parents=parents,
        scores=None if draft.scores is None else draft.scores[picked.to(draft.scores.device)],
        auxiliary=draft.auxiliary,
        drawn_independently=draft.drawn_independently,
    )


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask, on the host -> [rows, vocab_size] bool, on the host (bit j of word w:
    token 32 w + j; numpy's unpacking, a byte at a time, little-endian)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")  # [rows, 32 words]
    return torch.from_numpy(bits[:, :vocab_size]).view(torch.bool)


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] with the tokens the bitmask ([rows, words] int32, host) forbids at -inf: unpacked on
    the host, sent to the logits' device (no host read), one elementwise select there."""
    allowed = to_device(unpack(bitmask, logits.shape[-1]), logits.device)  # [rows, vocab], copied without waiting
    return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
