"""Measured figures live in one place, docs/status.md, each with its date and the command that
reproduces it; the README and the quick start link there instead of quoting figures that go stale."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
POINTING_PAGES = ("README.md", "docs/quickstart.md", "docs/index.md")

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE = re.compile(r"`[^`\n]+`")
_NUMBER = r"(?<![\w.])~?\d+(?:\.\d+)?"
_FIGURES = {
    "a duration": re.compile(_NUMBER + r"\s?(?:min|minutes?|s|sec|seconds?|h|hours?)\b"),
    "a size": re.compile(_NUMBER + r"\s?(?:[KMGT]i?B)\b"),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a percentage": re.compile(_NUMBER + r"\s?%"),
    "a measured fraction": re.compile(r"(?<![\w.])~?0\.\d+(?![\w.])"),
}
_DATE = re.compile(r"^20\d\d-\d\d-\d\d$")


def quoted_figures(text: str) -> list[str]:
    """'kind: match' for each measured-looking figure in prose and in the comments of code blocks
    (commands and inline code left out)."""
    comments = [line.split("#", 1)[1] for block in _FENCE.finditer(text)
                for line in block.group(0).splitlines() if "#" in line]
    prose = _INLINE.sub("", "\n".join([_FENCE.sub("", text), *comments]))
    return [f"{kind}: {m.group(0).strip()}" for kind, pattern in _FIGURES.items() for m in pattern.finditer(prose)]


def benchmark_rows(status: str) -> list[dict[str, str]]:
    """The rows of the table under '## Benchmarks' in docs/status.md, by column name."""
    section = status.split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def test_the_readme_and_quick_start_quote_no_figure():
    found = {page: quoted_figures((ROOT / page).read_text()) for page in POINTING_PAGES}
    found = {page: figures for page, figures in found.items() if figures}
    assert not found, f"measured figures belong in docs/status.md (link to it instead): {found}"


def test_every_benchmark_figure_has_a_date_and_a_command():
    rows = benchmark_rows((ROOT / "docs" / "status.md").read_text())
    assert len(rows) >= 5
    for row in rows:
        assert _DATE.match(row["date"]), f"no YYYY-MM-DD date: {row}"
        assert "`" in row["command"] or row["command"].startswith("the command above"), f"no command: {row}"
        assert re.search(r"\d", row["figure"]), f"no figure: {row}"


def test_the_check_finds_figures_in_prose_and_not_in_code():
    text = ("The demo takes ~11 min (2026-12-01), 5 min 52 s on 2 cores, ~7 GB; reward 0.81, 53% of\n"
            "episodes; sglang 0.5.23, `--lr 0.5`, 64 prompts x 8 samples, 2 layers.\n"
            "```bash\nsleep 30s\nbash launch/demo.sh   # the demo (~11 min)\n```\n")
    assert quoted_figures(text) == [
        "a duration: ~11 min", "a duration: 5 min", "a duration: 52 s", "a duration: ~11 min",
        "a size: ~7 GB",
        "a date: 2026-12-01",
        "a percentage: 53%",
        "a measured fraction: 0.81",
    ]
