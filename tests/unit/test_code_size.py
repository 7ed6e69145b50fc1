"""The size limits the code and the user docs keep: a module or function that outgrows them gets split, a README
that outgrows a screen or two moves its detail into docs/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fp8rl", "components", "pipelines")
MAX_FILE_LINES = 455  # "about 450"
MAX_FUNCTION_LINES = 50


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_module_is_over_about_450_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert not long, f"modules over {MAX_FILE_LINES} lines (split them): {long}"


def test_no_function_is_over_50_lines() -> None:
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks and tables."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.lstrip().startswith("|"):
            out.append(line)
    return out


def test_readme_fits_a_screen_or_two() -> None:
    text = (ROOT / "README.md").read_text()
    assert text.count("\n") <= 120
    wide = [line for line in _prose_lines(text) if len(line) > 120]
    assert not wide, f"README.md lines over 120 characters outside code and tables: {wide}"


@pytest.mark.parametrize("doc,limit", [("docs/benchmarks.md", 400)])
def test_current_figures_doc_stays_short(doc: str, limit: int) -> None:
    assert (ROOT / doc).read_text().count("\n") <= limit
