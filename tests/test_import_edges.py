"""The package layering of megarl (docs/architecture.md, "Packages"), checked on the source.

A unit is the first name under ``megarl/``: a subpackage (``engines``) or a top-level module
(``sample``, ``train``). Each unit sits on a layer; it may import units of its own layer or lower
ones, never higher, and two units of one layer must not import each other (directly or round a
longer loop). Separately, no two megarl modules may import each other, directly or round a longer
loop. Every import counts, wherever it is written: at module level, deferred into a function body,
or under ``if TYPE_CHECKING:`` (a deferred or type-only import still ties one module to the other;
a type both need belongs in a module of its own). A new unit fails the test until it is placed in
LAYERS.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. Keep in step with the table in docs/architecture.md ("Packages").
LAYERS: dict[str, int] = {
    "sample": 0, "log": 0, "gc_pause": 0, "lifetime": 0, "parallel": 0, "platform": 0, "metrics": 0, "fields": 0,
    "wire": 0,
    "algos": 1, "tasks": 1,
    "models": 2, "engine_process": 2,
    "engines": 3,
    "rollout": 4, "agents": 4,
    "sync": 5,
    "trainer": 6,
    "config": 7,
    "planner": 8,
    "pipeline": 9,
    "train": 10, "plan": 10, "rehearsal": 10,
}


@dataclass(frozen=True)
class Edge:
    path: str  # importing file, relative to the repo root
    line: int
    source: str  # importing module, e.g. megarl.engines.pool
    target: str  # imported module (resolved to a known module where possible)


def load_sources(root: Path = ROOT) -> dict[str, str]:
    """megarl/**/*.py as {repo-relative path: text}."""
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted((root / "megarl").rglob("*.py"))}


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str | None:
    """The unit a megarl module belongs to; None for the package root itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "megarl" else None


def _resolve(name: str, known: set[str]) -> str:
    """`name` if it is a module, else its longest prefix that is one, else `name` unchanged."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return name


def _file_edges(path: str, tree: ast.AST, known: set[str]) -> list[Edge]:
    source = module_name(path)
    package = source if path.endswith("__init__.py") else source.rpartition(".")[0]
    found: list[Edge] = []

    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [_resolve(alias.name, known) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[:len(up) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.append(full if full in known else _resolve(base, known))
        for target in targets:
            if target == "megarl" or target.startswith("megarl."):
                found.append(Edge(path, node.lineno, source, target))
    return found


def edges(sources: dict[str, str]) -> list[Edge]:
    """Every import of a megarl module in `sources`, anywhere in each file."""
    known = {module_name(p) for p in sources}
    return [e for path, text in sources.items() for e in _file_edges(path, ast.parse(text, filename=path), known)]


def unknown_units(sources: dict[str, str]) -> list[str]:
    units = {unit_of(module_name(p)) for p in sources} | {unit_of(e.target) for e in edges(sources)}
    return sorted(u for u in units - {None} if u not in LAYERS)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each elementary cycle met as a back edge of a depth-first search, rotated to start at its
    smallest node (so the same loop is reported once)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []
    found: set[tuple[str, ...]] = set()

    def dfs(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                loop = path[path.index(nxt):]
                i = loop.index(min(loop))
                found.add(tuple(loop[i:] + loop[:i]))
            elif nxt not in state:
                dfs(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)
    return [list(c) for c in sorted(found)]


def layer_violations(sources: dict[str, str]) -> list[str]:
    """`megarl/path.py: unit -> unit` for each upward edge and each edge of a loop between units
    of one layer; sorted, one entry per file and unit pair."""
    bad: set[str] = set()
    same_layer: dict[str, set[str]] = {}
    by_pair: dict[tuple[str, str], set[str]] = {}
    for e in edges(sources):
        src, dst = unit_of(e.source), unit_of(e.target)
        if src is None or dst is None or src == dst or src not in LAYERS or dst not in LAYERS:
            continue
        by_pair.setdefault((src, dst), set()).add(e.path)
        if LAYERS[dst] > LAYERS[src]:
            bad.add(f"{e.path}: {src} -> {dst}")
        elif LAYERS[dst] == LAYERS[src]:
            same_layer.setdefault(src, set()).add(dst)
    for loop in _cycles(same_layer):
        for a, b in zip(loop, loop[1:] + loop[:1]):
            bad.update(f"{p}: {a} -> {b}" for p in by_pair[(a, b)])
    return sorted(bad)


def module_cycles(sources: dict[str, str]) -> list[list[str]]:
    """The import loops between megarl modules, every import counted (module level, deferred,
    under TYPE_CHECKING)."""
    graph: dict[str, set[str]] = {}
    for e in edges(sources):
        if e.target != e.source:
            graph.setdefault(e.source, set()).add(e.target)
    return _cycles(graph)


# ---------------------------------------------------------------------------------------------
# The real tree


def test_every_unit_is_placed_on_a_layer():
    missing = unknown_units(load_sources())
    assert not missing, f"megarl units not in LAYERS (place them in tests/test_import_edges.py): {missing}"


def test_no_upward_or_mutual_import_between_units():
    bad = layer_violations(load_sources())
    assert not bad, "imports against the layering (docs/architecture.md, Packages):\n" + "\n".join(bad)


# The run config composes the components' sections from above: none of them reads it.
CONFIG_FREE = ("algos", "engines", "rollout", "sync", "trainer")


def config_imports(sources: dict[str, str]) -> list[str]:
    """`megarl/path.py:line` of each import of ``megarl.config`` (any of its modules) by a module of
    :data:`CONFIG_FREE`."""
    return sorted(f"{e.path}:{e.line}" for e in edges(sources)
                  if unit_of(e.source) in CONFIG_FREE and unit_of(e.target) == "config")


def test_no_component_imports_the_run_config():
    found = config_imports(load_sources())
    assert not found, "modules that import megarl.config (take your typed section instead):\n" + "\n".join(found)


def test_no_two_modules_import_each_other():
    loops = module_cycles(load_sources())
    assert not loops, ("import loops between modules (deferred and TYPE_CHECKING imports count):\n"
                       + "\n".join(" -> ".join(c + c[:1]) for c in loops))


# ---------------------------------------------------------------------------------------------
# The checker itself, on made-up trees


def test_checker_flags_an_upward_edge_even_when_deferred():
    fake = {
        "megarl/sample.py": "def f():\n    from megarl.pipeline.run import main\n",
        "megarl/pipeline/run.py": "from megarl.sample import RolloutSample\n",
        "megarl/engines/pool.py": "from ..sample import RolloutSample\nfrom megarl import sample\n",
    }
    assert layer_violations(fake) == ["megarl/sample.py: sample -> pipeline"]
    assert module_cycles(fake) == [["megarl.pipeline.run", "megarl.sample"]]  # deferred, still a loop


def test_checker_flags_mutual_imports_in_one_layer_and_module_cycles():
    fake = {
        "megarl/algos/kl.py": "import megarl.tasks.prompts\n",
        "megarl/tasks/__init__.py": "",
        "megarl/tasks/prompts.py": "from megarl.algos import kl\n",
        # loops inside one unit: no layer problem, but two modules tied to each other all the same
        "megarl/engines/a.py": "import megarl.engines.b\n",
        "megarl/engines/b.py": "import typing\nif typing.TYPE_CHECKING:\n    from megarl.engines import a\n",
        "megarl/rollout/x.py": "from megarl.rollout import y\n",
        "megarl/rollout/y.py": "import megarl.rollout.z\n",
        "megarl/rollout/z.py": "def f():\n    from .x import g\n",
        "megarl/rollout/one_way.py": "from megarl.rollout import x\n",
    }
    assert layer_violations(fake) == [
        "megarl/algos/kl.py: algos -> tasks",
        "megarl/tasks/prompts.py: tasks -> algos",
    ]
    assert module_cycles(fake) == [
        ["megarl.algos.kl", "megarl.tasks.prompts"],
        ["megarl.engines.a", "megarl.engines.b"],  # closed only under TYPE_CHECKING
        ["megarl.rollout.x", "megarl.rollout.y", "megarl.rollout.z"],  # closed by a deferred import
    ]


def test_checker_flags_a_component_reading_the_run_config():
    fake = {
        "megarl/config/__init__.py": "",
        "megarl/config/schema.py": "from megarl.trainer.settings import TrainerConfig\n",
        "megarl/trainer/settings.py": "",
        "megarl/trainer/step.py": "def f():\n    from megarl.config.schema import MegarlConfig\n",
        "megarl/sync/rank.py": "from megarl import config\n",
        "megarl/planner/arch.py": "from megarl.config.schema import MegarlConfig\n",
    }
    assert config_imports(fake) == ["megarl/sync/rank.py:1", "megarl/trainer/step.py:2"]


def test_checker_flags_an_unplaced_unit():
    assert unknown_units({"megarl/newpkg/x.py": "", "megarl/sample.py": "import megarl.other\n"}) == ["newpkg", "other"]
