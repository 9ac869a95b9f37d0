"""The server loads its models on a thread that ends before the worker decodes (`cli.serve.on_a_passing_thread`),
not on the main thread, whose OpenMP threads made the worker's forwards dearer (docs/results/serving.md): what the
build returns or raises comes back to the caller; and what its options' budgets come to."""

from __future__ import annotations

import threading

import pytest

from specdecode.cli.serve import on_a_passing_thread
from specdecode.errors import UserError


def test_the_build_runs_on_a_thread_that_ends_with_it():
    seen = []
    assert on_a_passing_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_what_the_build_raises_is_raised_on_the_callers_thread():
    def refuse():
        raise UserError("no such model")

    with pytest.raises(UserError, match="no such model"):
        on_a_passing_thread(refuse)


def test_the_prefix_cache_is_shared_out_among_the_keys_only_where_each_is_a_group():
    """`--prefix-cache-gib` is what all the copies hold: under the tenant scope each API key (a prefix group of its
    own) gets its share; a keyless server, or the server scope (one group), gets all of it."""
    from specdecode.cli.serve import _prefix_cache

    assert _prefix_cache(1.0, "tenant", 0) == _prefix_cache(1.0, "server", 4) == 2**30
    assert _prefix_cache(1.0, "tenant", 4) == 2**28
    assert _prefix_cache(0.0, "tenant", 2) == 0
