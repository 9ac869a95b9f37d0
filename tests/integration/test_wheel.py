"""The package as a user installs it: the wheel built from this checkout, installed into a fresh virtual
environment that cannot see the repository, runs `specdecode methods` and a generation on a tiny model.

No network: the wheel is built with the setuptools already installed (`--no-build-isolation`), and the
fresh environment reaches the dependencies installed here through a folder of links to them (everything of
this environment's site-packages but specdecode itself), with the wheel installed `--no-deps`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import run_cli

REPOSITORY = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.wheel


def _source_files() -> list[str]:
    """What a build from a checkout of this working tree sees: the package, pyproject.toml and the README
    (the files git tracks or would, not those it ignores; without git, the package as it lies, caches left
    out)."""
    tracked = subprocess.run(["git", "-C", str(REPOSITORY), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard", "specdecode", "pyproject.toml", "README.md"],
                             capture_output=True, text=True)
    if tracked.returncode == 0 and tracked.stdout:
        return [name for name in tracked.stdout.split("\0") if name and (REPOSITORY / name).is_file()]
    package = [path.relative_to(REPOSITORY).as_posix() for path in (REPOSITORY / "specdecode").rglob("*")
               if path.is_file() and "__pycache__" not in path.parts]
    return [*package, "pyproject.toml", "README.md"]


def _dependencies_without_specdecode(folder: Path) -> Path:
    """A folder of links to every entry of this environment's site-packages except specdecode's own (its
    package, dist-info, editable finder) and the .pth files (processed only in a site folder anyway)."""
    site = Path(sysconfig.get_paths()["purelib"])
    folder.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("specdecode", "__editable__", "__pycache__")) or name.endswith(".pth"):
            continue
        (folder / entry.name).symlink_to(entry)
    return folder


def _run(command: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def test_the_wheel_installs_and_runs_outside_the_repository(tmp_path, tiny_folder, monkeypatch, capsys) -> None:
    # 1. the wheel, built from a copy of the sources (a build writes build/ and *.egg-info beside them)
    source = tmp_path / "source"
    files = _source_files()
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPOSITORY / name, source / name)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env |= {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HF_HUB_OFFLINE": "1",
            "SPECDECODE_CACHE": str(tmp_path / "cache")}
    elsewhere = tmp_path / "elsewhere"  # the working folder of every command: not the repository
    elsewhere.mkdir()
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir",
          str(tmp_path / "dist"), str(source)], elsewhere, env)
    (wheel,) = (tmp_path / "dist").glob("specdecode-*.whl")

    # 2. a fresh virtual environment, the dependencies through a .pth, the wheel installed alone
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], elsewhere, env)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     elsewhere, env).stdout.strip())
    (site / "dependencies.pth").write_text(f"{_dependencies_without_specdecode(tmp_path / 'dependencies')}\n")
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], elsewhere, env)

    # 3. it imports from the environment, with every file of the package: the heads, the kernels' sources,
    # the demo page among them
    located = _run([str(python), "-c", "import specdecode; print(specdecode.__file__)"], elsewhere, env).stdout
    installed = Path(located.strip()).parent
    assert installed == site / "specdecode"
    shipped = sorted(name.removeprefix("specdecode/") for name in files if name.startswith("specdecode/"))
    present = sorted(path.relative_to(installed).as_posix() for path in installed.rglob("*")
                     if path.is_file() and "__pycache__" not in path.parts)
    assert present == shipped
    for data in ("heads/qwen2.5-coder-1.5b-instruct/eagle3/eagle3.json", "models/kernels/int4.cpp",
                 "models/kernels/attention.cpp", "serve/static/index.html"):
        assert (installed / data).read_bytes() == (REPOSITORY / "specdecode" / data).read_bytes(), data

    # 4. the command line from there: the methods, and a generation the same as this checkout's
    specdecode = str(venv / "bin" / "specdecode")
    assert "pld" in _run([specdecode, "methods"], elsewhere, env).stdout
    arguments = ["generate", "the the the cat the", "--target", str(tiny_folder), "--method", "pld",
                 "--dtype", "float32", "--max-new-tokens", "8", "--json"]
    generated = json.loads(_run([specdecode, *arguments], elsewhere, env).stdout)
    code, here, _ = run_cli(monkeypatch, capsys, *arguments)
    assert code == 0 and generated["new_tokens"] > 0
    assert generated["token_ids"] == json.loads(here)["token_ids"]
