"""scripts/gpu-carry in a checkout of its own (a throwaway git repository with files where the real checkout keeps its
heads, training data and reports): `aside` leaves only what the GPU check reads to travel and `back` restores the tree
as it was, byte for byte."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-carry"
BIG = {"specdecode/heads/some-model/medusa/medusa.safetensors": 3 << 20,
       "training-data/some-model/answers-00001.jsonl.xz": 1 << 20,
       "benchmarks/reports/a-run/records.jsonl": 1 << 20}
SMALL = {"specdecode/engine/loop.py": 4096, "scripts/gpu-check": 2048, "docs/backends.md": 1024}


def tree(root: Path) -> dict[str, str]:
    """Every file under `root` but git's own and the aside folder: path -> digest."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and not {".git", ".gpu-away"} & set(p.relative_to(root).parts)}


def carry(root: Path, verb: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(root / "scripts" / "gpu-carry"), verb], cwd=root, capture_output=True, text=True)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    for path, size in {**BIG, **SMALL}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(hashlib.sha256(path.encode()).digest() * (size // 32))
    (tmp_path / "scripts" / "gpu-carry").write_bytes(SCRIPT.read_bytes())
    (tmp_path / "scripts" / "gpu-carry").chmod(0o755)
    for command in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "t"]):
        subprocess.run(["git", *command], cwd=tmp_path, check=True)
    return tmp_path


def test_aside_leaves_what_the_check_reads_and_back_restores_the_tree(checkout):
    before = tree(checkout)
    moved = carry(checkout, "aside")
    assert moved.returncode == 0, moved.stderr
    assert "travels: 0 MiB of the working tree" in moved.stdout  # the small files alone
    left = tree(checkout)
    assert not set(BIG) & set(left) and set(SMALL) <= set(left)
    # what is aside does not travel: git ignores it, and sees the tracked files moved as deleted
    status = subprocess.run(["git", "status", "--porcelain"], cwd=checkout, capture_output=True, text=True).stdout
    assert ".gpu-away" not in status and "medusa.safetensors" in status
    assert carry(checkout, "back").returncode == 0
    assert tree(checkout) == before and not (checkout / ".gpu-away").exists()
    assert "nothing aside" in carry(checkout, "back").stdout  # twice: nothing to do


def test_a_tree_over_the_limit_is_named_with_its_largest_files(checkout):
    (checkout / "specdecode" / "weights.bin").write_bytes(b"\0" * (65 << 20))
    said = carry(checkout, "size")
    assert said.returncode == 1 and "specdecode/weights.bin" in said.stderr
