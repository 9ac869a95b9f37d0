"""Where the package writes: its cache folder and the console its progress goes to.

At the bottom of the package (it imports nothing of it), so any layer can cache a file or show progress
without importing model loading.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

console = Console(stderr=True)  # progress goes to stderr, so stdout stays clean for the command line


def cache_dir() -> Path:
    """Root of everything this package caches: `$SPECDECODE_CACHE`, else `~/.cache/specdecode`."""
    root = os.environ.get("SPECDECODE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "specdecode"
