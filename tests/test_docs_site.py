"""The documentation site (mkdocs.yml over docs/) builds with ``mkdocs build --strict``: a broken link
or anchor, or a page under docs/ that the navigation leaves out, fails the build and so this test."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``root/mkdocs.yml`` into ``site``; output captured as text."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(root / "mkdocs.yml"), "--site-dir", str(site)],
                          capture_output=True, text=True, env=env, timeout=300)


def nav_pages(config: Path) -> list[str]:
    """The Markdown files the navigation of ``config`` lists, in order (relative to docs/)."""
    return [page for entry in yaml.safe_load(config.read_text())["nav"] for page in entry.values()]


def copy_of_the_docs(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    return root


def test_the_site_builds_strictly_with_every_page(tmp_path):
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    pages = nav_pages(ROOT / "mkdocs.yml")
    assert sorted(pages) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    for page in pages:
        html = tmp_path / "site" / ("index.html" if page == "index.md" else f"{Path(page).stem}/index.html")
        assert html.is_file(), f"{page} was not rendered"
    reference = (tmp_path / "site" / "configuration" / "index.html").read_text()
    assert "rollout.max_total_tokens" in reference  # the generated configuration reference is in the site


def test_a_broken_link_fails_the_build(tmp_path):
    root = copy_of_the_docs(tmp_path)
    page = root / "docs" / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [the old page](no_such_page.md).\n")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0
    assert "no_such_page.md" in result.stdout + result.stderr


def test_a_broken_anchor_fails_the_build(tmp_path):
    root = copy_of_the_docs(tmp_path)
    page = root / "docs" / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [the figures](status.md#no-such-section).\n")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-section" in result.stdout + result.stderr


def test_a_page_left_out_of_the_navigation_fails_the_build(tmp_path):
    root = copy_of_the_docs(tmp_path)
    (root / "docs" / "orphan.md").write_text("# Orphan\n")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0
    assert "orphan.md" in result.stdout + result.stderr
