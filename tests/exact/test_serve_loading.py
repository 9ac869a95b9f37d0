"""The server loads its models on a thread that ends before the worker decodes (`cli.serve.on_a_passing_thread`),
not on the main thread, whose OpenMP threads made the worker's forwards dearer (docs/results/serving.md): what the
build returns or raises comes back to the caller."""

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
