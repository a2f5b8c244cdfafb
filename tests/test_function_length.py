"""Functions that fit a screen: no function or method of ``megarl/pipeline/`` (a run's start-up and
its step, where long functions grow first) is longer than :data:`MAX_LINES`, measured on the source
with ``ast`` from its ``def`` (decorators included) to its last line."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60
CHECKED = ("megarl/pipeline",)


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length in lines) of every function in ``source``, methods and
    nested functions included; a nested function's lines count in its parent's too."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found.append((prefix + child.name, first, child.end_lineno - first + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def too_long(root: Path = ROOT, folders=CHECKED, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (n lines)`` for each function of ``folders`` longer than ``limit`` lines."""
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for name, line, length in function_lengths(path.read_text()):
                if length > limit:
                    out.append(f"{path.relative_to(root)}:{line} {name} ({length} lines)")
    return out


def test_no_pipeline_function_is_longer_than_a_screen():
    long = too_long()
    assert not long, f"functions over {MAX_LINES} lines (split them into named parts):\n" + "\n".join(long)


def test_the_measure_counts_every_line_of_methods_nested_and_decorated_functions(tmp_path):
    source = ("import functools\n\n"
              "class A:\n"
              "    @functools.cache\n"
              "    def m(self):\n"
              "        def inner():\n"
              "            return 1\n"
              "\n"
              "        return inner()\n\n"
              "async def f():\n" + "    x = 1\n" * 60 + "    return x\n")
    assert function_lengths(source) == [("A.m", 4, 6), ("A.m.inner", 6, 2), ("f", 11, 62)]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(source)
    assert too_long(tmp_path, ("pkg",), limit=60) == ["pkg/mod.py:11 f (62 lines)"]
    assert too_long(tmp_path, ("pkg",), limit=62) == []
