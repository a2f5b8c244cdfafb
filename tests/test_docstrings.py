"""What megarl's docstrings may say, checked on the source: each package's docstring names exactly the
modules and subpackages in its folder, and no docstring holds a machine's figures (measured times,
rates, dates): those belong in docs/status.md with the command that reproduces them."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MEGARL = ROOT / "megarl"


def package_members(package: Path) -> set[str]:
    """The modules (``x.py``) and subpackages (``x/__init__.py``) directly in ``package``."""
    return ({p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
            | {d.name for d in package.iterdir() if (d / "__init__.py").is_file()})


def named_members(docstring: str, dotted: str) -> set[str]:
    """The member names a package docstring gives: ````x````, ````x.py````, ````x/```` or
    ``:mod:`dotted.x```` (also ``~dotted.x`` and ``.x``)."""
    plain = re.findall(r"``([a-z_][a-z0-9_]*)(?:\.py|/)?``", docstring)
    referenced = re.findall(r":mod:`~?(?:" + re.escape(dotted) + r")?\.([a-z_][a-z0-9_]*)", docstring)
    return set(plain) | set(referenced)


def docstring_drift(root: Path = MEGARL) -> list[str]:
    """``package: missing [...] / not a member [...]`` for each package whose docstring does not name
    exactly its members."""
    found = []
    for init in sorted(root.rglob("__init__.py")):
        package = init.parent
        dotted = ".".join(package.relative_to(root.parent).parts)
        members = package_members(package)
        named = named_members(ast.get_docstring(ast.parse(init.read_text())) or "", dotted)
        missing, extra = sorted(members - named), sorted(named - members)
        if missing or extra:
            found.append(f"{dotted}: missing {missing} / not a member {extra}")
    return found


# A machine's figures: an approximate time or size, a rate, a figure "on this machine" or "here", a
# measurement with its number, a date.
FIGURES = [
    (r"~\s*\d[\d.,]*\s*(?:s|ms|us|min|[KMG]i?B)\b", "an approximate time or size"),
    (r"\d\s*[KMG]i?(?:B|bit)/s\b", "a rate"),
    (r"\d[\d.]*\s*(?:s|ms|us|min|[KMG]i?B)\b[^.;]{0,60}\b(?:on this machine|here)\b", "a figure of this machine"),
    (r"\bmeasured\b[^.;]{0,40}\d\s*(?:s|ms|us|min|[KMG]i?B|%)", "a measurement"),
    (r"\b20\d\d-\d\d-\d\d\b", "a date"),
]


def figures_in(text: str) -> list[str]:
    """What in ``text`` reads as a machine's figure (the names of :data:`FIGURES` that match)."""
    return [name for pattern, name in FIGURES if re.search(pattern, text)]


def docstrings_with_figures(root: Path = MEGARL) -> list[str]:
    """``path:line: what`` for each docstring (module, class, function) of ``root`` holding a figure."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in [tree, *ast.walk(tree)]:
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node, clean=False)
            what = figures_in(doc) if doc else []
            if what:
                line = node.body[0].lineno if node.body else 1
                found.append(f"{path.relative_to(root.parent)}:{line}: {', '.join(what)}")
    return sorted(set(found))


def test_every_package_docstring_names_exactly_its_modules():
    drift = docstring_drift()
    assert not drift, "package docstrings out of step with their folders:\n" + "\n".join(drift)


def test_no_docstring_holds_a_machines_figures():
    found = docstrings_with_figures()
    assert not found, ("machine figures in docstrings (move them to docs/status.md with their command):\n"
                       + "\n".join(found))


def test_the_checks_catch_drift_and_figures(tmp_path):
    package = tmp_path / "megarl" / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "__init__.py").write_text('"""Nothing in it."""\n')
    (package / "__init__.py").write_text('"""Holds ``a`` and :mod:`megarl.pkg.gone`."""\n')
    (package / "a.py").write_text('"""A module."""\n')
    (package / "b.py").write_text('def f():\n    """Takes ~0.3 s on this machine."""\n')
    (tmp_path / "megarl" / "__init__.py").write_text('"""Its package ``pkg``."""\n')
    assert docstring_drift(tmp_path / "megarl") == ["megarl.pkg: missing ['b', 'sub'] / not a member ['gone']"]
    assert docstrings_with_figures(tmp_path / "megarl") == [
        "megarl/pkg/b.py:2: an approximate time or size, a figure of this machine"]
    assert figures_in("measured 12 ms on 2026-12-04, 40 MB/s") == ["a rate", "a measurement", "a date"]
    assert figures_in("the measured KL; bounded by sync.timeout_s (30 s); runs on this machine") == []
