"""Generate docs/configuration.md from the config schema (megarl/config/schema.py).

usage: python tools/gen_config_doc.py [--check]

Walks the dataclasses from ``MegarlConfig`` down: every key with its type, default and the
comment beside or above it in the source of the class that declares it (a section a component owns
is declared in that component's module, e.g. ``megarl/models/lora.py``), and the class docstring
per section. ``--check``
writes nothing and exits 1 when the committed file differs (tests/test_config_doc.py runs it).
"""
import argparse
import ast
import dataclasses
import enum
import inspect
import re
import sys
import typing
from pathlib import Path

from omegaconf import MISSING

from megarl.config import schema

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "configuration.md"
HEADER = """# Configuration reference

Generated from `megarl/config/schema.py` by `tools/gen_config_doc.py`: do not edit by hand; run
`python tools/gen_config_doc.py` after changing the schema (`tests/test_config_doc.py` fails while
this file is stale). A recipe in `recipes/` sets any of these keys, and any key can be overridden on
the command line (`python -m megarl.train recipe=NAME parallel.tp=2 rollout.top_k=50`); Hydra
rejects unknown keys and wrong types, `megarl/config/validate.py` rejects impossible combinations.
`???` marks a key that has no default and must be set.
"""


def source_comments(module) -> dict[tuple[str, str], str]:
    """{(class, attribute): comment} from trailing ``#`` comments and the comment lines just above."""
    source = inspect.getsource(module)
    lines = source.splitlines()
    comments = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign):
                name = stmt.target.id
            elif isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                name = stmt.targets[0].id
            else:
                continue
            above, row = [], stmt.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#"):
                above.insert(0, lines[row].strip().lstrip("#").strip())
                row -= 1
            trailing = re.search(r"#\s*(.*)$", lines[stmt.end_lineno - 1])
            text = " ".join(above + ([trailing.group(1)] if trailing else []))
            comments[(node.name, name)] = text
    return comments


def type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " / ".join(f"`{m.value}`" for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: dataclasses.Field) -> str:
    value = field.default
    if value is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    if value is MISSING:
        return "`???`"
    if value is None:
        return "`null`"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`" if value != "" else '`""`'


def declaring_class(cls, name: str):
    """The class of ``cls``'s MRO whose body declares field ``name`` (an inherited field's base)."""
    return next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))


def describe(cls, field: dataclasses.Field, comments: dict, hints: dict) -> str:
    text = comments.get((declaring_class(cls, field.name).__name__, field.name), "")
    for constant in re.findall(r"\b[A-Z][A-Z_]+\b", text):  # e.g. "one of MODES"
        values = getattr(schema, constant, None)
        if isinstance(values, tuple):
            text += " (" + ", ".join(f"`{v}`" for v in values) + ")"
    annotation = hints[field.name]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        notes = [f"`{m.value}`: {comments[(annotation.__name__, m.name)]}" for m in annotation
                 if comments.get((annotation.__name__, m.name))]
        text = "; ".join([t for t in [text] if t] + notes)
    return text.replace("|", "\\|")


def sections(cls, prefix: str = ""):
    """(key prefix, dataclass) for ``cls`` and every nested dataclass, depth first."""
    yield prefix, cls
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            yield from sections(hints[field.name], f"{prefix}{field.name}.")


def render() -> str:
    classes = [c for _, cls in sections(schema.MegarlConfig) for c in cls.__mro__ if dataclasses.is_dataclass(c)]
    enums = [t for c in classes for t in typing.get_type_hints(c).values()
             if isinstance(t, type) and issubclass(t, enum.Enum)]
    modules = {inspect.getmodule(c) for c in [*classes, *enums]} | {schema}
    comments = {k: v for module in sorted(modules, key=lambda m: m.__name__)
                for k, v in source_comments(module).items()}
    out = [HEADER]
    for prefix, cls in sections(schema.MegarlConfig):
        hints = typing.get_type_hints(cls)
        title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
        out.append(f"## {title}\n")
        doc = inspect.getdoc(cls)
        if doc and not doc.startswith(f"{cls.__name__}("):  # dataclasses invent a signature docstring
            out.append(" ".join(doc.split()) + "\n")
        out.append("| key | type | default | description |\n| --- | --- | --- | --- |")
        for field in dataclasses.fields(cls):
            annotation = hints[field.name]
            if dataclasses.is_dataclass(annotation):
                key = f"{prefix}{field.name}"
                out.append(f"| `{key}` | section | | see [`{key}`](#{key.replace('.', '')}) |")
                continue
            out.append(f"| `{prefix}{field.name}` | {type_name(annotation).replace('|', '/')} | {default_text(field)} "
                       f"| {describe(cls, field, comments, hints)} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run python tools/gen_config_doc.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
