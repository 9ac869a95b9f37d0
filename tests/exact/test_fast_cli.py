"""The command line starts without torch, transformers or numpy: `specdecode --help`, each command's `--help`
and `specdecode methods` import none of them (each command that runs a model imports them inside its
function; numpy alone is a third of a bare start). Checked by what a fresh interpreter has imported, not by a
timing, which a busy machine would make flaky."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs the command line in a fresh interpreter, then names the heavy modules it imported.
RUN = """
import sys
from specdecode.cli import main
sys.argv = ["specdecode", *sys.argv[1:]]
try:
    main()
except SystemExit as exit:
    assert not exit.code, exit.code
print("imported:", *[name for name in ("torch", "transformers", "numpy") if name in sys.modules])
"""


def _run(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("module", ["specdecode", "specdecode.cli", "specdecode.methods"])
def test_importing_leaves_torch_and_transformers_out(module):
    heavy = ("torch", "transformers", "numpy")
    out = _run(f"import sys, {module}; print('imported:', *[m for m in {heavy!r} if m in sys.modules])")
    assert out.strip() == "imported:", out


@pytest.mark.parametrize("args", [
    ["--help"], ["methods"], ["generate", "--help"], ["demo", "--help"], ["bench", "--help"], ["serve", "--help"],
    ["datastore", "build", "--help"], ["train", "eagle3", "--help"], ["export", "eagle", "--help"],
    ["models", "--help"],
], ids=" ".join)
def test_help_and_methods_leave_torch_and_transformers_out(args):
    out = _run(RUN, *args)
    assert out.splitlines()[-1] == "imported:", out


def test_the_package_names_still_resolve_on_first_use():
    out = _run("import specdecode; print(specdecode.load_models.__module__, specdecode.SamplingParams.__name__, "
               "'load_models' in dir(specdecode))")
    assert out.split() == ["specdecode.api", "SamplingParams", "True"]
