"""ruff (lint) finds nothing in `specdecode/`, `tests/`, `benchmarks/` and `scripts/`, and mypy (types)
nothing in `specdecode/`, with the settings in pyproject.toml: a finding is fixed where it is, not silenced.
Each runs as its own process, as a developer would run it; the test skips where the tool is not installed
(`pip install -e '.[dev]'` brings both)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# ruff reads the *.py files under each; the scripts without a suffix (scripts/gpu-check, scripts/method-table)
# are not among them, as pyproject.toml does not add them (`extend-include`)
LINTED = ("specdecode", "tests", "benchmarks", "scripts")


def _run(tool: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[dev]')")
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_ruff_finds_nothing():
    done = _run("ruff", "check", "--no-cache", *LINTED, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing():
    # the files and settings are pyproject.toml's; its cache (.mypy_cache) makes a second run take seconds
    done = _run("mypy", timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
