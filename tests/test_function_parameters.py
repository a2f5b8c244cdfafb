"""Settings travel as values, not as loose keywords: no function or method of ``megarl/`` takes more than
:data:`MAX_PARAMETERS` parameters (``self`` and ``cls`` aside; ``*args`` and ``**kwargs`` count one each),
measured on the source with ``ast``. Functions that replace a library's own and so take its signature
stand apart, each named here (:data:`LIBRARY_SIGNATURES`; one that fits or is gone fails the test until
removed)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAMETERS = 8

# SGLang's TorchNativeAttnBackend._run_sdpa_forward_* and its sampler, replaced with the same signature
# (megarl/platform/), and the kernels those replacements hand the same arguments to
LIBRARY_SIGNATURES = {
    "megarl/platform/sglang_cpu_attention.py:decode",
    "megarl/platform/sglang_cpu_attention.py:extend",
    "megarl/platform/sglang_cpu_attention.py:install._run_sdpa_forward_extend",
    "megarl/platform/sglang_cpu_attention.py:install._run_sdpa_forward_decode",
    "megarl/platform/sglang_cpu_sampling.py:sample",
}


def parameter_counts(source: str) -> list[tuple[str, int]]:
    """(qualified name, parameter count without a leading ``self`` / ``cls``) of every function in
    ``source``, methods and nested functions included."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                names = [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
                if names[:1] in (["self"], ["cls"]):
                    names = names[1:]
                found.append((prefix + child.name, len(names) + bool(a.vararg) + bool(a.kwarg)))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return found


def over_limit(root: Path = ROOT) -> dict[str, int]:
    """``path:qualified name`` -> parameters, for every function of ``megarl/`` over the limit."""
    out = {}
    for path in sorted((root / "megarl").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        out |= {f"{rel}:{name}": n for name, n in parameter_counts(path.read_text()) if n > MAX_PARAMETERS}
    return out


def test_no_function_takes_more_than_eight_parameters():
    found = over_limit()
    new = sorted(f"{name} ({n})" for name, n in found.items() if name not in LIBRARY_SIGNATURES)
    assert not new, f"functions over {MAX_PARAMETERS} parameters (pass a value instead):\n" + "\n".join(new)
    stale = sorted(LIBRARY_SIGNATURES - set(found))
    assert not stale, f"within the limit now or gone, take them off LIBRARY_SIGNATURES: {stale}"


def test_the_counter_skips_self_and_counts_star_arguments():
    source = ("class A:\n    def m(self, a, b, *, c): ...\n    @classmethod\n    def k(cls, *args, **kw): ...\n"
              "def f(a, /, b, *rest, d=1, **opts):\n    def inner(x): ...\n")
    assert parameter_counts(source) == [("A.m", 3), ("A.k", 2), ("f", 5), ("f.inner", 1)]
