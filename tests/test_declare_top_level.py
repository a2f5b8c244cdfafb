"""tools/declare_top_level.py: Python's package -> distribution mapping unchanged, found without RECORD."""
import importlib.metadata as metadata
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from declare_top_level import declare_top_level, search_paths  # noqa: E402


def _dist(root: Path, name: str, files: list[str], top_level: str | None = None) -> Path:
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    for file in files:
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        (root / file).write_text("")
    record = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in record))
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level)
    return info


def test_declared_names_equal_the_inferred_ones_and_record_is_no_longer_read(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    _dist(tmp_path, "alpha", ["alpha/__init__.py", "alpha/core.py", "alpha_ext.py", "bin/tool"])
    _dist(tmp_path, "beta", ["beta/__init__.py"], top_level="beta\n")
    _dist(tmp_path, "gamma", ["gamma.data/x.json"])  # nothing importable: left without the file
    before = metadata.packages_distributions()
    assert before == {"alpha": ["alpha"], "alpha_ext": ["alpha"], "bin": ["alpha"], "beta": ["beta"]}

    assert declare_top_level(metadata.distributions()) == ["alpha"]
    assert (tmp_path / "alpha-1.0.dist-info" / "top_level.txt").read_text() == "alpha\nalpha_ext\nbin\n"
    assert not (tmp_path / "gamma-1.0.dist-info" / "top_level.txt").exists()
    (tmp_path / "alpha-1.0.dist-info" / "RECORD").unlink()  # the mapping no longer needs it
    assert metadata.packages_distributions() == before
    assert declare_top_level(metadata.distributions()) == []  # a second run changes nothing


def test_the_project_venv_declares_every_inferable_top_level():
    """tools/setup_venv.sh ran it: no distribution of this interpreter (Ray's vendored ones included) is
    left to infer from RECORD."""
    undeclared = [d.metadata["Name"] for d in metadata.distributions(path=search_paths())
                  if not metadata._top_level_declared(d) and list(metadata._top_level_inferred(d))]
    assert undeclared == [], (f"{undeclared}: installed after tools/setup_venv.sh? run .venv/bin/python "
                              "tools/declare_top_level.py")
