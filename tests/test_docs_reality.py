"""What README.md and docs/*.md name is what megarl does: every metric name is one megarl writes, every
dotted config key is in the schema (or in the planner's JSON, where the docs say so), every command run
from the virtual environment is there, and the planner examples print what the docs quote.

A metric is written when its name is a literal of megarl's sources, or when its prefix is one of theirs
(``"sync/"``, ``f"buffer/{...}"``) and its last part a word of them (rows built from field names:
``sync/total_s`` from ``SyncReport.total_s``, ``train/kl`` from the step's ``kl``); ``p/*`` and
``p/<k>`` stand for a prefix's names, and wandb's ``_at_`` for ``@``."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megarl.config.schema import MegarlConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = "\n".join(p.read_text() for p in sorted((ROOT / "megarl").rglob("*.py")))
NOT_METRICS = ("checkpoints", "runs", "application")  # paths and MIME types that look alike
_LITERAL = re.compile(r"""["']([a-z_]+/[\w@.]+)["']""")
_PREFIX = re.compile(r"""f?["']([a-z_]+)/""")


def inline_code(path: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", path.read_text())


def unwritten_metrics(names: list[str], sources: str) -> list[str]:
    """The metric ``names`` (``prefix/name``, of a prefix the sources use) that ``sources`` does not write."""
    literals = set(_LITERAL.findall(sources))
    prefixes = {p for p in _PREFIX.findall(sources)} - set(NOT_METRICS)
    words = set(re.findall(r"[\w@]+", sources))
    missing = []
    for name in names:
        prefix, _, rest = name.partition("/")
        if prefix not in prefixes or name in literals:
            continue
        last = re.sub(r"@\d+$", "@", rest.replace("_at_", "@")).rsplit("/", 1)[-1]
        if rest in ("*", "") or last.startswith("<") or last.endswith("@<k>"):
            continue
        if last.rstrip("@") not in words and last not in words and f"{last}{{" not in sources:
            missing.append(name)
    return missing


def doc_metrics() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for code in inline_code(doc):
            if re.fullmatch(r"[a-z_]+/[\w@<>*/]+", code):
                found.setdefault(code, []).append(doc.name)
    return found


def test_every_metric_the_docs_name_is_written():
    names = doc_metrics()
    missing = unwritten_metrics(sorted(names), SOURCES)
    assert not missing, {m: names[m] for m in missing}


def test_the_metric_check_finds_a_metric_nothing_writes():
    sources = 'row = {"time/wait_s": w}\nout = {f"sync/{k}": v}\n@dataclass\nclass R:\n    total_s: float\n'
    assert unwritten_metrics(["time/wait_s", "time/rollout_s", "sync/total_s", "sync/*", "x/y"], sources) \
        == ["time/rollout_s"]


def plan_json_keys() -> set[str]:
    """Dotted keys of the planner's JSON (``python -m megarl.plan --json``), of a recipe whose architecture
    needs no checkpoint."""
    from megarl.config import load_config
    from megarl.planner.layout import plan_layout

    def walk(node: dict, prefix: str):
        for key, value in node.items():
            yield f"{prefix}{key}"
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")

    return set(walk(plan_layout(load_config(["recipe=qwen3_30b_a3b"])).to_dict(), ""))


FILE_SUFFIXES = (".json", ".jsonl", ".yaml", ".safetensors", ".py", ".md", ".txt")  # a file's name, not a key


def test_every_config_key_the_docs_name_exists():
    schema = OmegaConf.structured(MegarlConfig)
    sections = [k for k in schema.keys() if OmegaConf.is_config(schema._get_node(k))]
    pattern = re.compile(r"((?:%s)(?:\.[a-z_0-9]+)+)(?:[=:]\S*)?" % "|".join(sections))
    unknown: dict[str, list[str]] = {}
    for doc in DOCS:
        for code in inline_code(doc):
            match = pattern.fullmatch(code)
            if match and not code.endswith(FILE_SUFFIXES) and not _in_schema(schema, match.group(1)):
                unknown.setdefault(match.group(1), []).append(doc.name)
    if unknown:
        unknown = {k: v for k, v in unknown.items() if k not in plan_json_keys()}
    assert not unknown, unknown


def _in_schema(schema, key: str) -> bool:
    node = schema
    for part in key.split("."):
        if not OmegaConf.is_config(node) or part not in node.keys():  # "in" skips a value left ???
            return False
        node = node._get_node(part)
    return True


def test_every_command_run_from_the_virtual_environment_is_there():
    missing = {}
    for doc in DOCS:
        for command in set(re.findall(r"\.venv/bin/([\w.-]+)", doc.read_text())):
            if not (ROOT / ".venv" / "bin" / command).exists():
                missing.setdefault(command, []).append(doc.name)
    assert not missing, missing
    bare = [doc.name for doc in DOCS for code in inline_code(doc) if re.match(r"tensorboard\s", code)]
    assert not bare, f"tensorboard is not on the PATH outside the venv: write .venv/bin/tensorboard ({bare})"


def test_the_planner_examples_print_what_the_docs_quote(capsys):
    """Each ``$ python -m megarl.plan ...`` line of the docs followed by a ``plan: ...`` line: the same
    command prints that line."""
    from megarl.plan import main

    examples = [(m.group(1), m.group(2)) for doc in DOCS
                for m in re.finditer(r"^\$ python -m megarl\.plan (.+)\n(plan: .+)$", doc.read_text(), re.M)]
    assert examples
    for args, quoted in examples:
        main(shlex.split(args))
        printed = capsys.readouterr().err.splitlines()
        assert quoted in printed, (args, quoted, printed)
