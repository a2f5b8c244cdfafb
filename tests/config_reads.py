"""Which config keys the source reads, each followed by its section (``rollout.temperature`` is read where
``temperature`` is taken from the rollout section, not wherever some ``.temperature`` appears).

An expression holds a section when it is ``<anything>.<top-level section>`` (``cfg.rollout``,
``self.cfg.rollout``), a nested section of one (``cfg.reward.judge``), a name assigned such an
expression in the same function (or annotated with a section's class there), a parameter annotated
with a section's class (or a class that extends it), ``self`` in such a class, or a call of such a class
or of one of its class methods (``SyncSettings.from_config(cfg.sync, ...)``). A key is read by
``<section>.<key>``, ``getattr(<section>, "<key>")``, ``<section>["<key>"]`` or ``<section>.get("<key>")``;
``**<section>`` and ``asdict``/``OmegaConf.to_container``/``OmegaConf.to_object`` of it read every key.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

WHOLE_SECTION_CALLS = {"asdict", "to_container", "to_object", "vars"}
ROOT_NAMES = {"cfg", "config", "run_cfg"}  # names that hold the whole run config


def schema_sections(cls, prefix: str = "") -> tuple[dict[str, type], dict[str, list[str]]]:
    """({section path: its class}, {section path: its leaf keys}) of the schema ``cls``, "" the root."""
    classes, keys = {prefix.rstrip("."): cls}, {prefix.rstrip("."): []}
    for f in dataclasses.fields(cls):
        kind = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(kind):
            sub_classes, sub_keys = schema_sections(type(kind), f"{prefix}{f.name}.")
            classes.update(sub_classes)
            keys.update(sub_keys)
        else:
            keys[prefix.rstrip(".")].append(f.name)
    return classes, keys


class _Reads:
    def __init__(self, classes: dict[str, type], keys: dict[str, list[str]], subclasses: dict[str, set[str]]):
        self.keys = keys
        self.top = {path for path in classes if path and "." not in path}
        by_name: dict[str, set[str]] = {}
        for path, cls in classes.items():  # a section's class, and each class it extends (shared by sections)
            for base in cls.__mro__[:-1] if path else ():
                by_name.setdefault(base.__name__, set()).add(path)
        for name, bases in subclasses.items():  # a class extending a section's class holds that section
            for base in bases:
                by_name.setdefault(name, set()).update(by_name.get(base, set()))
        self.by_class = by_name
        self.found: set[str] = set()
        self.on_self: dict[str, set[str]] = {}  # self.<name> = a section (any class: names, not owners)
        self.passed: dict[tuple, set[str]] = {}  # (function name, argument index or name, via attribute) -> sections

    def _of_annotation(self, node: ast.AST | None) -> set[str]:
        if node is None:
            return set()
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        names |= {w for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  for w in n.value.replace("|", " ").replace("[", " ").replace("]", " ").split()}
        return set().union(*(self.by_class.get(n, set()) for n in names))

    def sections(self, node: ast.AST, env: dict[str, set[str]]) -> set[str]:
        if isinstance(node, ast.Name):
            return env.get(node.id, set()) | ({""} if node.id in ROOT_NAMES else set())
        if isinstance(node, ast.Attribute):
            inner = {f"{p}.{node.attr}".lstrip(".") for p in self.sections(node.value, env)
                     if f"{p}.{node.attr}".lstrip(".") in self.keys}
            kept = self.on_self.get(node.attr, set()) if isinstance(node.value, ast.Name) and \
                node.value.id == "self" else set()
            return inner | kept | ({node.attr} if node.attr in self.top else set())
        if isinstance(node, ast.Call):
            func = node.func
            owner = func.value if isinstance(func, ast.Attribute) else func
            if isinstance(owner, ast.Name):
                return set(self.by_class.get(owner.id, set()))
        return set()

    def _bind(self, target: ast.AST, value: ast.AST, env: dict[str, set[str]]) -> None:
        """``target = value``: a name, or a tuple of names unpacked from a tuple of values."""
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v, env)
        elif isinstance(target, ast.Name):
            held = self.sections(value, env)
            if held:
                env[target.id] = env.get(target.id, set()) | held
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            held = self.sections(value, env)
            if held:
                self.on_self[target.attr] = self.on_self.get(target.attr, set()) | held

    def _read(self, paths: set[str], key: str) -> None:
        self.found.update(f"{p}.{key}".lstrip(".") for p in paths if key in self.keys.get(p, ()))

    def scope(self, body: list[ast.AST], env: dict[str, set[str]]) -> None:
        """Reads in ``body`` (a function's or a module's), ``env`` its names that hold sections."""
        env = dict(env)
        nodes = [n for stmt in body for n in ast.walk(stmt)]
        for _ in range(3):  # assignments, until aliases of aliases are in
            for node in nodes:
                if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                    held = self.sections(node.value, env)
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        self._bind(target, node.value, env)
                    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):  # x: Section = ...
                        env[node.target.id] = env.get(node.target.id, set()) | self._of_annotation(node.annotation)
                elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
                    held = self.sections(node.context_expr, env)
                    if held:
                        env[node.optional_vars.id] = held
        for node in nodes:
            self._reads_at(node, env)

    def _reads_at(self, node: ast.AST, env: dict[str, set[str]]) -> None:
        if isinstance(node, ast.Attribute):
            self._read(self.sections(node.value, env), node.attr)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            self._read(self.sections(node.value, env), str(node.slice.value))
        elif isinstance(node, ast.Subscript):  # a computed key: any key of the section
            for path in self.sections(node.value, env):
                self.found.update(f"{path}.{k}".lstrip(".") for k in self.keys.get(path, ()))
        elif isinstance(node, ast.Call):
            func, args = node.func, node.args
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "getattr" and len(args) >= 2 and isinstance(args[1], ast.Constant):
                self._read(self.sections(args[0], env), str(args[1].value))
            elif name == "get" and isinstance(func, ast.Attribute) and args and isinstance(args[0], ast.Constant):
                self._read(self.sections(func.value, env), str(args[0].value))
            whole = [k.value for k in node.keywords if k.arg is None]
            whole += list(args[:1]) if name in WHOLE_SECTION_CALLS else []
            for value in whole:
                for path in self.sections(value, env):
                    self.found.update(f"{path}.{k}".lstrip(".") for k in self.keys.get(path, ()))
            self._passes(node, env)

    def _passes(self, call: ast.Call, env: dict[str, set[str]]) -> None:
        """Record the sections ``call`` hands a function, by the function's name and the argument's place."""
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name is None:
            return
        for i, arg in enumerate(call.args):
            held = self.sections(arg, env)
            if held:
                self.passed.setdefault((name, i, isinstance(func, ast.Attribute)), set()).update(held)
        for keyword in call.keywords:
            held = self.sections(keyword.value, env) if keyword.arg else set()
            if held:
                self.passed.setdefault((name, keyword.arg, isinstance(func, ast.Attribute)), set()).update(held)

    def function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, env: dict[str, set[str]],
                 owner: str | None) -> None:
        env = dict(env)
        params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
        for i, arg in enumerate(params):
            held = self._of_annotation(getattr(arg, "annotation", None))
            if i == 0 and arg.arg in ("self", "cls") and owner is not None:
                held = held | self.by_class.get(owner, set())
            method = bool(params) and params[0].arg in ("self", "cls")
            position = i - 1 if method else i
            callees = [(fn.name, (True,) if method else (True, False))]
            if fn.name == "__init__" and owner is not None:  # called as the class
                callees.append((owner, (True, False)))
            for callee, ways in callees:
                for via_attribute in ways:
                    held = held | self.passed.get((callee, position, via_attribute), set())
                    held = held | self.passed.get((callee, arg.arg, via_attribute), set())
            if held:
                env[arg.arg] = held
        self.scope(fn.body if isinstance(fn.body, list) else [fn.body], env)


def subclasses_in(trees: list[ast.Module]) -> dict[str, set[str]]:
    """{class name: the names of its bases} over ``trees``."""
    found: dict[str, set[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found[node.name] = {b.id for b in node.bases if isinstance(b, ast.Name)}
    return found


def keys_read(paths: list[Path], schema) -> set[str]:
    """The dotted keys of ``schema`` (the root config class) the files ``paths`` read."""
    trees = [ast.parse(p.read_text()) for p in paths]
    classes, keys = schema_sections(schema)
    reads = _Reads(classes, keys, subclasses_in(trees))
    for _ in range(4):  # sections handed on through calls, a few calls deep
        for tree in trees:
            reads.scope([n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef
                                                                | ast.ClassDef)], {})
            _functions(reads, tree, None)
    return reads.found


def _functions(reads: _Reads, node: ast.AST, owner: str | None) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            _functions(reads, child, child.name)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            reads.function(child, {}, owner)
            _functions(reads, child, None)
        else:
            _functions(reads, child, owner)
