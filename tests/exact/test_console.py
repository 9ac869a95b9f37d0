"""The package's one stderr console (`paths.console`, which the commands print through) never folds a message at its
width: where stderr is no terminal (a log, a pipe) rich takes 80 columns, and a path folded there cannot be copied
back whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONG = "/tmp/" + "a-rather-long-folder-name/" * 6 + "records.jsonl"

PRINT = f"""
from specdecode.cli.options import console
from specdecode.paths import console as package_console
assert console is package_console
console.print("wrote [bold]{LONG}[/bold]: 3 records")
"""


def test_a_message_names_a_path_whole_where_stderr_is_no_terminal():
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    done = subprocess.run([sys.executable, "-c", PRINT], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(LONG) > 80
    assert done.stderr.splitlines() == [f"wrote {LONG}: 3 records"]
