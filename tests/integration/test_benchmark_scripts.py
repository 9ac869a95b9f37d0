"""The benchmark scripts still import: most of them run only by hand, for hours, on the real models, so an API they
use that moved or was renamed would otherwise show only when someone next needs the figure (one imported
`DrafterOptions` from a module it had left)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_benchmark_script_imports_and_has_a_main(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # (their imports of one another)
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"benchmarks/{name}.py has no main()"
