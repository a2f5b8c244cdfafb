"""Every repository path the docs name exists, so that moving a file cannot leave the docs behind.

Checked in README.md and docs/*.md: every word that starts with a top-level folder of the
repository (``megarl/``, ``tests/``, ``tools/``, ...), in prose, `inline code` or code blocks; a
bare file name in inline code (``gather.py``) that no file under megarl/, tests/ or tools/ has;
dotted module names in code (``megarl.engine_process.sglang_main``); relative Markdown links. Run outputs
(``runs/...``, ``checkpoints/...``) are not repository paths and are not checked. The design lives
in docs/architecture.md: nothing may cite a DESIGN.md outside the repository.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
REPO_DIRS = ("megarl", "tests", "tools", "recipes", "launch", "slurm", "docs")
SOURCE_DIRS = ("megarl", "tests", "tools")

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*)" % "|".join(REPO_DIRS))
_MODULE = re.compile(r"(?<![\w./-])(megarl(?:\.\w+)+)")
_BARE_FILE = re.compile(r"^[\w-]+\.(?:py|sh|yaml)$")


def _module_exists(name: str, root: Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or base.is_dir()


def missing_paths(doc: Path, root: Path = ROOT) -> list[str]:
    """'doc: path' for each path named in `doc` that does not exist under `root`."""
    text = doc.read_text()
    rel = doc.relative_to(root).as_posix()
    blocks = [m.group(0) for m in _FENCE.finditer(text)]
    prose = _FENCE.sub("", text)
    spans = _INLINE.findall(prose)
    basenames = {p.name for d in SOURCE_DIRS for p in (root / d).rglob("*") if p.is_file()}
    basenames |= {p.name for d in REPO_DIRS if (root / d).is_dir() for p in (root / d).iterdir()}
    bad = [f"{rel}: {path}" for path in (p.rstrip(".,;:") for p in _PATH.findall(text)) if not (root / path).exists()]
    for chunk in spans + blocks:
        for name in _MODULE.findall(chunk):
            if name.endswith((".py", ".sbatch")):
                continue  # a file name such as megarl.sbatch, checked as a path
            if not _module_exists(name, root):
                bad.append(f"{rel}: {name}")
    for span in spans:
        if _BARE_FILE.match(span.strip()) and span.strip() not in basenames:
            bad.append(f"{rel}: {span.strip()}")
    for target in _LINK.findall(prose):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (doc.parent / target).exists():
            bad.append(f"{rel}: {target}")
    return bad


def _docs(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def test_every_path_in_the_docs_exists():
    bad = [b for doc in _docs() for b in missing_paths(doc)]
    assert not bad, "the docs name paths that do not exist:\n" + "\n".join(bad)


def test_nothing_cites_an_outside_design_document():
    files = [*_docs(), *sorted((ROOT / "megarl").rglob("*.py"))]
    bad = [f.relative_to(ROOT).as_posix() for f in files if "DESIGN.md" in f.read_text()]
    assert not bad, f"cite docs/architecture.md (by section title) instead of DESIGN.md in: {bad}"


def test_the_check_finds_a_missing_path(tmp_path):
    (tmp_path / "megarl" / "engines").mkdir(parents=True)
    (tmp_path / "megarl" / "engines" / "pool.py").write_text("")
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "a.md"
    doc.write_text(
        "See `megarl/engines/pool.py` and `megarl/rollout/engine.py` (`pool.py`, `gone.py`),\n"
        "and in prose megarl/engines/ and tests/test_gone.py.\n"
        "`python -m megarl.engines.pool`, `megarl.rollout.engine`, [b](b.md).\n"
        "```bash\nbash tools/missing.sh > runs/out.txt\n```\n"
    )
    assert missing_paths(doc, tmp_path) == [
        "docs/a.md: megarl/rollout/engine.py",
        "docs/a.md: tests/test_gone.py",
        "docs/a.md: tools/missing.sh",
        "docs/a.md: megarl.rollout.engine",
        "docs/a.md: gone.py",
        "docs/a.md: b.md",
    ]
