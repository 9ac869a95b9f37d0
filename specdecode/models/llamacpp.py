"""The llama.cpp backend: GGUF files at native CPU speed through llama-cpp-python's low-level API.

One llama.cpp context holds one sequence (sequence id 0) in a unified KV cache. A forward is one
`llama_decode` of a batch with explicit positions, asking for logits only where the engine needs them.
A token tree is expressed with sequence ids instead of a mask: every leaf of the tree gets its own
sequence, a node belongs to the sequences of the leaves below it, and the cached context is copied
(shared, not duplicated) into every branch sequence, so each branch sees the context and its own
ancestors only. After verification the accepted path is copied into sequence 0 and the branch sequences
are dropped, which frees the rejected nodes. Lookahead decoding's window (`AuxiliaryTokens`) takes the
same form, one sequence per window column, as in llama.cpp's own lookahead example; a mask that has no
such form is refused.

Optional: `pip install specdecode[llamacpp]` (compiles llama.cpp, a few minutes).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from specdecode.errors import UserError
from specdecode.models.base import CausalLM, ForwardOutput

MAX_BATCH = 512  # tokens per llama_decode call (longer prefills are split)


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise UserError(
            "the llama.cpp backend needs llama-cpp-python: pip install 'specdecode[llamacpp]'"
        ) from None
    return llama_cpp


_QUIET: list = []  # the logging callback, kept alive for as long as llama.cpp may call it


def _silence(lib) -> None:
    """llama.cpp logs every load to stderr; keep the terminal clean."""
    if not _QUIET:
        _QUIET.append(lib.llama_log_callback(lambda level, text, user_data: None))
        lib.llama_log_set(_QUIET[0], ctypes.c_void_p())


def tree_sequences(mask: torch.Tensor) -> list[list[int]] | None:
    """Sequence ids that reproduce an attention mask among new tokens: one sequence (1, 2, ...) per
    leaf, each token in the sequences of the leaves whose row includes it. None: no tree (all causal).

    mask: [n, n] bool, row i = the new tokens token i attends to (itself included). Raises ValueError
    for a mask that is not a tree over a causal prefix.
    """
    n = mask.shape[0]
    if bool(torch.equal(mask, torch.ones(n, n, dtype=torch.bool).tril())):
        return None
    attended_by_other = (mask & ~torch.eye(n, dtype=torch.bool)).any(dim=0)  # [n]
    leaves = (~attended_by_other).nonzero().flatten().tolist()
    seqs: list[list[int]] = [[] for _ in range(n)]
    for number, leaf in enumerate(leaves, start=1):
        for i in mask[leaf].nonzero().flatten().tolist():
            seqs[i].append(number)
    shared = torch.tensor([[bool(set(seqs[i]) & set(seqs[j])) for j in range(n)] for i in range(n)])
    if not torch.equal(shared & torch.ones(n, n, dtype=torch.bool).tril(), mask):
        raise ValueError("the llama.cpp backend takes tree masks (each token attends to its ancestors)")
    return seqs


def shared_prefix(mask: torch.Tensor) -> int:
    """How many leading tokens form a causal chain that every later token attends to. mask: [n, n] bool."""
    n = mask.shape[0]
    seen_by_all_after = mask.tril().sum(dim=0) == torch.arange(n, 0, -1)  # [n]: column j true in rows j..n-1
    return n if bool(seen_by_all_after.all()) else int((~seen_by_all_after).nonzero()[0])


DEFAULT_CONTEXT = 32768  # positions a context opens by default (the long-context category's 16k prompts fit)


class LlamaCppLM(CausalLM):
    """A GGUF model in a llama.cpp context, holding one sequence."""

    grows_trees = False

    def __init__(self, path: str | Path, n_ctx: int | None = None, threads: int | None = None,
                 max_branches: int = 64):
        lib = _llama_cpp()
        self._lib = lib
        _silence(lib)
        lib.llama_backend_init()
        self.path = Path(path)
        model_params = lib.llama_model_default_params()
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), model_params)
        if not self._model:
            raise UserError(f"llama.cpp could not load {self.path}")
        threads = threads or torch.get_num_threads()
        trained = lib.llama_model_n_ctx_train(self._model)
        # by default the model's trained length, up to DEFAULT_CONTEXT: llama.cpp allocates the cache up front
        # (28 KB a position for the default target in float16: 0.9 GB at 32k); a step reads only what is filled.
        # At least 4096 (a tiny model's context of a few dozen positions cannot hold the tree branches' sequences)
        n_ctx = n_ctx or max(4096, min(trained, DEFAULT_CONTEXT))
        if n_ctx <= max_branches:  # llama.cpp would abort the process (an assertion on its output buffer)
            raise UserError(f"a llama.cpp context of {n_ctx} positions cannot hold {max_branches} tree branches "
                            f"and the main sequence: use n_ctx of at least {max_branches + 1}")
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = MAX_BATCH
        params.n_seq_max = max_branches + 1
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # a token may belong to several sequences (tree branches)
        # no flash attention: over a cache compacted around a tree's rejected nodes it sums in another order than over
        # the same context fed afresh (logits 1e-3 apart, a near-tie flipped: a tree method's greedy output parted
        # from plain decoding's), without it 1e-6; its speed on a CPU was the same within noise (docs/backends.md)
        params.flash_attn_type = 0
        params.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise UserError(f"llama.cpp could not create a context for {self.path} (n_ctx={n_ctx})")
        self._memory = lib.llama_get_memory(self._ctx)
        vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = lib.llama_vocab_n_tokens(vocab)
        self.max_context = min(n_ctx, trained)
        self.eos_token_ids = frozenset(t for t in range(self.vocab_size) if lib.llama_vocab_is_eog(vocab, t))
        self.max_branches = max_branches
        self._batch = lib.llama_batch_init(MAX_BATCH, 0, max_branches + 1)
        self._length = 0
        self._tree: tuple[int, list[list[int]], int] | None = None  # (batch's cache index, sequences, branches)

    def __del__(self):
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        try:
            if getattr(self, "_batch", None) is not None:
                lib.llama_batch_free(self._batch)
            if getattr(self, "_ctx", None):
                lib.llama_free(self._ctx)
            if getattr(self, "_model", None):
                lib.llama_model_free(self._model)
        except TypeError:  # at interpreter exit the library's functions may already be gone: the process frees all
            pass

    @property
    def cache_length(self) -> int:
        return self._length

    @property
    def weight_bytes_per_token(self) -> int:
        return int(self._lib.llama_model_size(self._model))

    @property
    def cost_key(self) -> str:
        return f"llamacpp|{self.path.resolve()}|{self.path.stat().st_size}"

    @property
    def precision(self) -> str:
        """The GGUF's quantization as llama.cpp describes the model, e.g. "qwen2 1.5B Q4_K - Medium"."""
        buffer = ctypes.create_string_buffer(128)
        self._lib.llama_model_desc(self._model, buffer, len(buffer))
        return buffer.value.decode(errors="replace")

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[list[int]], outputs: int) -> np.ndarray:
        """One llama_decode; the logits of the last `outputs` tokens. -> [outputs, vocab] float32"""
        batch, n = self._batch, len(tokens)
        batch.n_tokens = n
        for i, (token, position, seq) in enumerate(zip(tokens, positions, seqs)):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = len(seq)
            for k, s in enumerate(seq):
                batch.seq_id[i][k] = s
            batch.logits[i] = i >= n - outputs
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} ({n} tokens at cache length {self._length})")
        if outputs == 0:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        pointer = self._lib.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(pointer, shape=(outputs, self.vocab_size)).copy()

    def forward(self, token_ids, *, positions=None, tree_mask=None, num_logits=None, output_hidden=False,
                rows=None) -> ForwardOutput:
        if rows is not None:
            raise UserError("the llama.cpp backend serves one sequence at a time (no `rows`)")
        if output_hidden:
            raise UserError("the llama.cpp backend does not return hidden states (methods that need them run on torch)")
        tokens = token_ids.tolist()
        n = len(tokens)
        num_logits = n if num_logits is None else num_logits
        positions = list(range(self._length, self._length + n)) if positions is None else positions.tolist()
        if self._tree is not None:
            raise RuntimeError("compact the cache to the accepted path before the next forward")
        if max(positions, default=-1) >= self.max_context:  # llama.cpp would abort the process
            raise UserError(f"position {max(positions)} is beyond this context's {self.max_context} tokens")
        seqs = None
        if tree_mask is not None and n > MAX_BATCH and tree_mask.shape[1] == n:
            # a long pending context (a prompt, on the first step) before a tree: decode the part of it
            # that every tree token sees as a chain first, then the rest with the tree
            peel = min(shared_prefix(tree_mask), n - num_logits)
            if peel:
                self.forward(token_ids[:peel], positions=torch.tensor(positions[:peel]), num_logits=0)
                return self.forward(token_ids[peel:], positions=torch.tensor(positions[peel:]),
                                    tree_mask=tree_mask[peel:, peel:], num_logits=num_logits)
        if tree_mask is not None:
            if tree_mask.shape[1] != n:
                raise UserError("the llama.cpp backend verifies token trees but cannot grow one in its own cache")
            try:
                seqs = tree_sequences(tree_mask)
            except ValueError:
                raise UserError("the llama.cpp backend expresses attention masks with sequence ids, one per "
                                "leaf; this method's mask has no such form: run it on the torch backend") from None
        if seqs is None:  # a chain: everything in sequence 0, long inputs in several decodes
            rows = []
            for begin in range(0, n, MAX_BATCH):
                end = min(begin + MAX_BATCH, n)
                wanted = max(0, end - max(begin, n - num_logits))
                rows.append(self._decode(tokens[begin:end], positions[begin:end], [[0]] * (end - begin), wanted))
            logits = np.concatenate(rows)
        else:
            branches = max(max(s) for s in seqs if s)
            if branches > self.max_branches or n > MAX_BATCH:
                raise UserError(f"a tree of {branches} leaves and {n} tokens exceeds this context's "
                                f"{self.max_branches} branches or {MAX_BATCH} tokens")
            for branch in range(1, branches + 1):  # each branch sees the cached context
                self._lib.llama_memory_seq_cp(self._memory, 0, branch, -1, -1)
            in_all = set(range(1, branches + 1))
            seqs = [[0, *s] if set(s) == in_all else s for s in seqs]  # the shared prefix stays in sequence 0
            logits = self._decode(tokens, positions, seqs, num_logits)
            self._tree = (self._length, seqs, branches)
        self._length += n
        return ForwardOutput(logits=torch.from_numpy(logits))

    def compact(self, start: int, keep) -> None:
        keep = list(keep)
        if self._tree is not None:
            batch_start, seqs, branches = self._tree
            self._tree = None
            if keep:
                deepest = start + keep[-1] - batch_start  # its batch index
                branch = next(s for s in seqs[deepest] if s != 0)
                # the accepted nodes sit at positions start .. start + len(keep) - 1
                self._lib.llama_memory_seq_cp(self._memory, branch, 0, start, start + len(keep))
            for s in range(1, branches + 1):
                self._lib.llama_memory_seq_rm(self._memory, s, -1, -1)
        self.crop(start + len(keep))

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot crop a cache of {self._length} tokens to {length}")
        if length < self._length:
            self._lib.llama_memory_seq_rm(self._memory, -1, length, -1)
            self._length = length

    def reset(self) -> None:
        self._lib.llama_memory_clear(self._memory, True)
        self._tree = None
        self._length = 0
