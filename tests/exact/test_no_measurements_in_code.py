"""Comments and docstrings in `specdecode/` say what the code does and why, never how fast it ran on which
machine: figures go stale with the machine they were taken on, so they live in the docs (docs/results/),
each with its date, machine and command, and a comment may point there.

The check reads every comment (`tokenize`) and every docstring (`ast`: modules, classes, functions) of the
package and fails with file:line for each that carries a measurement:

- a time: a number followed by ms, µs, ns, s, seconds, minutes or hours;
- a rate: tok/s, tokens/s, GB/s, "tokens a second";
- a speed ratio: "3x", "1.25x", "20 times faster", "five times slower";
- a cost counted in forwards: "8 tokens cost 6 forwards", "18 one-token ones";
- a machine: a CPU or GPU model (EPYC, Xeon, Zen 4, H100...), "the AVX2 machine", "two cores";
- a percentage: "94%", "agrees on 12.5 %" (a share measured on some model or machine);
- a pointer to the README, whose measured tables moved to docs/results/.

Help strings of the command line are neither comments nor docstrings and are not read here.

A second check reads the code for prices carried as constants: a number other than 0 as the default of a
parameter or field named for a cost (`draft_cost: float = 0.4`), or a cost curve built from a number
(`CostCurve.linear(0.03)`) in the package. What a forward costs depends on the machine, so the package
measures it (`models.costs`), times it live (a head's rounds), or takes it from the caller; 0 ("not
measured", "free") is no measurement. Budgets and limits in seconds are settings, not prices, and pass.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "specdecode"

NUMBER = r"\d+(?:[.,]\d+)?"
WORD_NUMBER = r"(?:two|three|four|five|six|seven|eight|nine|ten|twenty|a hundred)"
MEASUREMENTS = {
    "a time": re.compile(rf"\b{NUMBER}\s*(?:ms|µs|ns)\b|\b{NUMBER}\s+(?:s|secs?)\b(?![-/])"
                         rf"|\b{NUMBER}\s*(?:seconds?|minutes?|hours?)\b"),
    "a rate": re.compile(rf"\b{NUMBER}\s*(?:tok|tokens|GB|MB|it)/s\b|\b{NUMBER} tokens? (?:a|per) second\b", re.I),
    "a speed ratio": re.compile(
        rf"\b(?!0x){NUMBER}x(?![\w-])|\b(?:{NUMBER}|{WORD_NUMBER}) times (?:faster|slower|cheaper|dearer|as fast)\b",
        re.I),
    "a cost counted in forwards": re.compile(
        rf"\bcosts? (?:about |at least |nearly )?{NUMBER} (?:forwards|one-token|single-token)\b"
        rf"|\b{NUMBER} (?:one-token|single-token) (?:ones|forwards)\b", re.I),
    "a machine": re.compile(
        r"\b(?:EPYC|Xeon|Ryzen|Zen ?\d|Threadripper|H100|H200|A100|RTX ?\d+)\b"
        r"|\bAVX[\w-]*[ -]machine\b|\b(?:one|two|four|1|2|4)[ -]cores?\b", re.I),
    "a percentage": re.compile(rf"\b{NUMBER}\s?%"),
    "a pointer to the README": re.compile(r"\bREADME\b"),
}


def comments_and_docstrings(source: str):
    """(line, text) of every comment, and of every docstring with its lines joined (so that a figure broken
    over two lines is seen) and the line each part of it starts on: (line of each offset, text)."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield [token.start[0]], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                lines, text = [], ""
                for offset, line in enumerate(first.value.value.splitlines()):
                    part = line.strip() + " "
                    lines += [first.lineno + offset] * len(part)
                    text += part
                yield lines or [first.lineno], text


def measurements(source: str) -> list[tuple[int, str, str]]:
    """(line, kind, the text found) for each measurement in a module's comments and docstrings."""
    found = set()
    for lines, text in comments_and_docstrings(source):
        for kind, pattern in MEASUREMENTS.items():
            for match in pattern.finditer(text):
                found.add((lines[min(match.start(), len(lines) - 1)], kind, match.group(0)))
    return sorted(found)


def priced_constants(source: str) -> list[tuple[int, str]]:
    """(line, the code) of each price carried as a constant in a module (see the module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        pairs = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            positional = arguments.posonlyargs + arguments.args
            pairs += zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults)
            pairs += [(a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults) if d is not None]
            pairs = [(a.arg, d) for a, d in pairs]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            pairs = [(node.target.id, node.value)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "linear"
              and node.args):
            pairs = [("cost curve", node.args[0])]
        for name, value in pairs:
            if ("cost" in name.lower() and isinstance(value, ast.Constant) and type(value.value) in (int, float)
                    and value.value != 0):
                found.append((value.lineno, ast.get_source_segment(source, node).splitlines()[0]
                              if isinstance(node, ast.Call) else f"{name}={value.value!r}"))
    return sorted(found)


def test_the_price_check_finds_prices_and_passes_settings():
    flagged = """def f(draft_cost: float = 0.4, *, round_cost=2): ...
class C:
    step_cost: float = 0.05
curve = CostCurve.linear(0.03)
"""
    assert [line for line, _ in priced_constants(flagged)] == [1, 1, 3, 4]
    clean = """def f(draft_cost: float | None = None, seconds=3600, cost=0.0, budget=8): ...
class C:
    seconds: float = 0.0
curve = CostCurve.linear(slope)
"""
    assert priced_constants(clean) == []


def test_no_prices_carried_as_constants():
    found = [f"specdecode/{path.relative_to(ROOT)}:{line}: {text}"
             for path in sorted(ROOT.rglob("*.py")) for line, text in priced_constants(path.read_text())]
    assert not found, ("prices carried as constants (measure them, time them live or take them from the caller):\n"
                       + "\n".join(found))


def test_the_check_finds_measurements_and_passes_reasons():
    flagged = '''"""A forward took 45 ms on two cores."""
x = 1  # 20 times faster than torch.multinomial (README, *Figures*)
def f():
    """8 tokens cost 6 forwards on the AVX2 machine; 140 tokens/s; 1.25x; agrees on 94% of tokens."""
'''
    kinds = {kind for _, kind, _ in measurements(flagged)}
    assert kinds == set(MEASUREMENTS)
    clean = '''"""Drafts cost a few percent of a target forward: the head reads one layer's weights."""
x = 1  # the widest measured forward (64 tokens); AVX-512 VNNI's one instruction per 64 products
y = 0x1F  # 3 d_target -> d; 2 rows; 16 tokens; timeout: seconds from arrival; HTTP 500s; -1s; <0x..>
def f():
    """Tokens per second over plain decoding's tokens per second, measured in the same run."""
'''
    assert measurements(clean) == []


def test_no_measurements_in_comments_or_docstrings():
    found = [f"specdecode/{path.relative_to(ROOT)}:{line}: {kind}: {text!r}"
             for path in sorted(ROOT.rglob("*.py"))
             for line, kind, text in measurements(path.read_text())]
    assert not found, ("measurements in comments or docstrings (move the figure to docs/results/ with its "
                       "date, machine and command; keep the reason):\n" + "\n".join(found))
