"""docs/configuration.md is generated from the schema and cannot drift from it."""
import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megarl.config.schema import MegarlConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "tools" / "gen_config_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaf_keys(node, prefix=""):
    for key in node.keys():
        child = node._get_node(key)
        if hasattr(child, "keys"):
            yield from _leaf_keys(child, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_committed_doc_is_the_generated_one():
    assert _tool().main(["--check"]) == 0, "docs/configuration.md is stale: run python tools/gen_config_doc.py"


def test_every_schema_key_has_a_row_with_its_default_and_comment():
    text = _tool().render()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    assert set(_leaf_keys(OmegaConf.structured(MegarlConfig))) <= rows
    assert "| `rollout.max_total_tokens` | int or null | `null` | engine KV-cache capacity in tokens" in text
    assert "| `model.hf_path` | str | `???` |" in text
    assert "`colocated`: trainer and engines share devices" in text  # the enum members' comments


def test_check_fails_on_a_stale_doc(tmp_path, monkeypatch):
    tool = _tool()
    stale = tmp_path / "configuration.md"
    stale.write_text(tool.render().replace("`512`", "`256`"))
    monkeypatch.setattr(tool, "OUTPUT", stale)
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    assert tool.main(["--check"]) == 1
