"""The documentation: the site builds strictly, it names every command and method, and the methods table of the
README and of docs/methods/index.md is the registry's.

- `mkdocs build --strict` of mkdocs.yml into a temporary folder: a broken link or anchor, or a page left out of
  the navigation, fails it (and a copy of the docs with one broken link is shown to fail);
- every command of `specdecode` (the typer app walked, groups and their subcommands) is named in docs/ as
  `specdecode COMMAND`, and every option of `specdecode serve` appears on the serving page;
- every registered method, tree forms included (`methods.variant_names()`), is named in docs/ as `NAME`;
- the table between the markers in README.md and docs/methods/index.md is what `scripts/method-table` renders, and,
  read back, lists every method of `methods.METHODS` once with its forms and its lossless flag.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shutil
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path

import typer

from specdecode.cli import app
from specdecode.methods import METHODS, variant_names

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
TABLE_FILES = ("README.md", "docs/methods/index.md")


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about MkDocs 2.0, not a warning of ours
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, env=env, timeout=300)


def docs_text() -> str:
    return "\n".join(path.read_text() for path in sorted(DOCS.rglob("*.md")))


def commands(group, prefix: str = "") -> list[str]:
    """Every command and group below `group`, as typed after `specdecode`: "generate", "models", "models list"..."""
    found = []
    for name, command in sorted(group.commands.items()):
        found.append(f"{prefix}{name}")
        if hasattr(command, "commands"):  # a group (typer ships its own click: no isinstance)
            found += commands(command, f"{prefix}{name} ")
    return found


def method_table():
    """scripts/method-table as a module (its file has no .py suffix)."""
    loader = SourceFileLoader("method_table", str(REPO / "scripts" / "method-table"))
    spec = importlib.util.spec_from_loader("method_table", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def table_rows(text: str) -> dict[str, list[str]]:
    """The method table's rows between the markers, by method name: their cells."""
    module = method_table()
    block = text[text.index(module.BEGIN): text.index(module.END)]
    rows = {}
    for line in block.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `"):
            name = cells[0].strip("`")
            assert name not in rows, f"{name} listed twice"
            rows[name] = cells
    return rows


def test_the_site_builds_strictly(tmp_path):
    done = _mkdocs(REPO / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "results" / "code-choices" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\n[a page that is not there](no-such-page.md)\n")
    done = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "no-such-page.md" in done.stdout + done.stderr


def test_every_command_is_documented():
    names = commands(typer.main.get_command(app))
    assert {"generate", "serve", "bench", "models list", "train eagle3", "export eagle"} <= set(names)
    text = docs_text()
    missing = [name for name in names if not re.search(rf"specdecode {re.escape(name)}(?![\w-])", text)]
    assert not missing, f"commands not named in docs/ as `specdecode COMMAND`: {missing}"


def test_every_serve_option_is_on_the_serving_page():
    serve = typer.main.get_command(app).commands["serve"]
    options = [option for param in serve.params for option in param.opts if option.startswith("--")]
    assert "--api-key" in options and "--allowed-origin" in options
    text = (DOCS / "serving.md").read_text()
    missing = [option for option in options if option != "--help" and not re.search(
        rf"{re.escape(option)}(?![\w-])", text)]
    assert not missing, f"options of `specdecode serve` missing from docs/serving.md: {missing}"


def run_tables(text: str) -> list[tuple[int, list[str]]]:
    """Each two-column table of a page's runs (`| | |` over key-value rows): its line and its keys."""
    lines, found = text.splitlines(), []
    for at, line in enumerate(lines):
        if line.strip() == "| | |":
            keys = []
            for row in itertools.takewhile(lambda row: row.startswith("|"), lines[at + 2:]):
                keys.append(row.split("|")[1].strip())
            found.append((at + 1, keys))
    return found


def test_every_dated_run_says_its_commit_and_command():
    """A run's table that gives its date gives the commit and the command it ran (a figure without them cannot be
    rerun); where the commit was not recorded at the time, the row says so."""
    missing = [f"{page.relative_to(REPO)}:{at}" for page in sorted(DOCS.rglob("*.md"))
               for at, keys in run_tables(page.read_text()) if "date" in keys
               and not {"commit", "command"} <= set(keys)]
    assert not missing, f"run tables without a commit or command row: {missing}"
    assert run_tables("x\n| | |\n|---|---|\n| date | d |\n| commit | c |\n\n| a | b |") == [(2, ["date", "commit"])]


def test_every_method_is_documented():
    text = docs_text()
    missing = [name for name in variant_names() if f"`{name}`" not in text]
    assert not missing, f"methods not named in docs/ (as `NAME`): {missing}"


def test_the_method_tables_are_the_registrys():
    module = method_table()
    rendered = module.render()
    for name in TABLE_FILES:
        text = (REPO / name).read_text()
        assert module.current(text) == module.for_file(rendered, name), (
            f"{name}: the method table is stale; run scripts/method-table --write")
        rows = table_rows(text)
        assert list(rows) == list(METHODS), f"{name}: the table's methods differ from the registry's"
        for method_name, cells in rows.items():
            method = METHODS[method_name]
            assert cells[3] == ("yes" if method.lossless else "**no**"), f"{name}: {method_name}'s lossless flag"
            forms = [form.strip("` ") for form in cells[1].split(",")]
            assert forms == [v for v in variant_names() if v == method_name or v.startswith(method_name + "-tree")]
            assert cells[4] == ("torch" if method.torch_only else "torch, llama.cpp (its chain)"
                                if method.tree_torch_only else "torch, llama.cpp")


def test_the_speedups_come_from_the_kept_runs_records(tmp_path, monkeypatch):
    """The speedup column is computed from the kept run's records: the same records render the same figures, and
    records in which plain decoding took twice as long render other ones (which the check above would then find
    stale in the README)."""
    import json

    module = method_table()
    kept = REPO / module.RUN
    figures, settings = module.measured()
    assert figures and settings["date"] and settings["machine"] and settings["command"]
    (tmp_path / "settings.json").write_text((kept / "settings.json").read_text())
    lines = []
    for line in (kept / "records.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["method"] == "ar":
            record["seconds"] *= 2
        lines.append(json.dumps(record))
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(module, "REPO", tmp_path.parent)
    monkeypatch.setattr(module, "RUN", tmp_path.name)
    slower, _ = module.measured()
    assert set(slower) == set(figures)
    assert all(value > 1.5 * dict(figures[name])[variant] for name in slower if name != "ar"
               for variant, value in slower[name])


def test_table_rows_reads_a_wrong_flag():
    module = method_table()
    text = module.render().replace("| `medusa-typical` | `medusa-typical` | trained head | **no** |",
                                   "| `medusa-typical` | `medusa-typical` | trained head | yes |")
    assert table_rows(text)["medusa-typical"][3] == "yes"  # what the table check above would refuse
