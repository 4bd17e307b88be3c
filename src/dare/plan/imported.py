"""What a plan reads of a module it only imported (``dare.plan.provenance`` records it; this is part of the recorder).

A plan imports every module of dare (the registries import every method, family and reward) and runs functions of
about half. A module none of whose functions ran can change the plan only through what its import did: constants,
class attributes, fields and imports (read by code that ran), registrations, a dunder (run implicitly), a def that
overrides what ran in an ancestor class (a method, a class attribute, a field), a def that shadows a name the module
imported or defined, or a name code that ran looked up by string (``getattr(x, "name")``). Its key,
``dare/x.py#imported:<scope>=<names>;...`` (watched names per class qualname, "" the module, "?" every scope, "*"
every def of the class), is fingerprinted by ``ImportedSkeleton``: the module without function bodies and without the
defs no watched name covers. So a method's own edit (a helper added, an override removed, a body changed) stales no
other method's plans, while its constants and registrations still count for every plan.

Not seen: a def found by other introspection (``vars(cls)``, ``dir``, ``inspect.getmembers``) in a class whose
functions never ran.
"""
from __future__ import annotations

import ast
import inspect
import sys
import types
from typing import Callable, Optional

IMPORTED = "#imported"
# Bases with no method a plan can run through a subclass: any other base outside the traced packages (torch's Module,
# dict, Enum, Exception) makes every def of the subclass count ("*").
_PLAIN_BASES = ("builtins.object", "abc.ABC", "typing.Generic", "typing.Protocol")


def imported_key(rel: str, watched: dict[str, frozenset]) -> str:
    spec = ";".join(f"{scope}={','.join(sorted(names))}" for scope, names in sorted(watched.items()) if names)
    return f"{rel}{IMPORTED}" + (f":{spec}" if spec else "")


def parse_imported_key(key: str) -> tuple[str, dict[str, frozenset]]:
    rel, _, spec = key.partition(IMPORTED)
    parts = (part.partition("=") for part in filter(None, spec[1:].split(";")))
    return rel, {scope: frozenset(filter(None, names.split(","))) for scope, _, names in parts}


class ImportedSkeleton(ast.NodeTransformer):
    """The module as a plan that ran none of its functions reads it: the skeleton (constants, class attributes,
    fields, imports, class decorators) and, of its defs, a module-level def with decorators (a registration), a dunder
    and a def whose name is watched in its scope (``watched``); a def kept keeps its name and decorators, never its
    body."""

    def __init__(self, watched: dict[str, frozenset]):
        self.watched, self.scope = watched, []

    def visit_ClassDef(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()
        return node

    def visit_FunctionDef(self, node):
        name, here = node.name, self.watched.get(".".join(self.scope), ())
        keep = (name.startswith("__") and name.endswith("__")) or name in here or "*" in here \
            or name in self.watched.get("?", ()) or (not self.scope and node.decorator_list)
        return ast.Call(func=ast.Name(id="def " + name), args=list(node.decorator_list), keywords=[]) if keep else None

    visit_AsyncFunctionDef = visit_FunctionDef


class Live:
    """The modules of the traced packages as this process loaded them, by file (``dare/x.py``)."""

    def __init__(self, roots: dict, relative: Callable[[str, dict], Optional[str]]):
        self.roots, self.relative, self._by_rel = roots, relative, None

    def rel(self, mod) -> Optional[str]:
        path = getattr(mod, "__file__", None)
        return self.relative(path, self.roots) if isinstance(path, str) else None

    def module(self, rel: str):
        import importlib
        if self._by_rel is None:
            self._by_rel = {found: m for m in list(sys.modules.values()) if (found := self.rel(m)) is not None}
        if rel not in self._by_rel:
            try:
                mod = importlib.import_module(rel[:-3].replace("/", ".").removesuffix(".__init__"))
            except Exception:  # not importable here: the module keeps its whole skeleton
                mod = None
            self._by_rel[rel] = mod if mod is not None and self.rel(mod) == rel else None
        return self._by_rel[rel]

    def rel_of(self, obj) -> Optional[str]:
        return self.rel(sys.modules.get(getattr(obj, "__module__", None) or ""))


def _attributes(cls) -> set:
    """A class's own names that are not plain functions: class attributes, properties, fields (a def of that name in
    a subclass overrides them)."""
    own = vars(cls)
    return ({n for n, v in own.items() if not inspect.isfunction(v) and not n.startswith("__")}
            | set(own.get("__dataclass_fields__", {})) | set(own.get("__annotations__", {})))


def watched_names(mod, owners: dict, lookups: set, live: Live) -> dict[str, frozenset]:
    """Per scope of an imported module, the def names that would change what a plan ran (``owners``: (file, class
    qualname or "") -> names of the units of it that ran; ``lookups``: names code that ran looked up by string)."""
    watched = {"?": frozenset(lookups)}
    # the module: a def would rebind a name it imported from the traced packages (a function, a class, a submodule)
    # or a class it defines
    watched[""] = frozenset(
        n for n, v in vars(mod).items() if not n.startswith("__") and not (
            inspect.isfunction(v) and v.__module__ == mod.__name__) and (
            live.rel(v) is not None if isinstance(v, types.ModuleType) else live.rel_of(v) is not None))
    stack, seen = [v for v in vars(mod).values() if inspect.isclass(v) and v.__module__ == mod.__name__], set()
    while stack:
        cls = stack.pop()
        if cls in seen or "<locals>" in cls.__qualname__:
            continue
        seen.add(cls)
        stack.extend(v for v in vars(cls).values() if inspect.isclass(v) and v.__module__ == mod.__name__)
        names: set = _attributes(cls)
        for base in cls.__mro__[1:]:
            if f"{base.__module__}.{base.__qualname__}" in _PLAIN_BASES:
                continue
            rel = live.rel_of(base)
            if rel is None:  # another package's class (torch's Module, dict, Enum): its methods that ran are unknown
                names = {"*"}
                break
            names |= owners.get((rel, base.__qualname__), set()) | _attributes(base)
        watched[cls.__qualname__] = frozenset(names)
    return watched


def narrow(record: dict, fp) -> dict:
    """``record`` with the whole skeleton of each dare module none of whose functions ran replaced by its imported
    key (``fp``: a ``dare.plan.provenance.Fingerprinter``). Only a current record is narrowed, so a stored one is
    narrowed exactly (its modules and units are as the plan saw them); narrowing a narrowed record changes nothing."""
    units = [key.split("::", 1) for key in record if "::" in key]
    ran = {rel for rel, _ in units}
    if not any(key.startswith("dare/") and key.endswith(".py") and key not in ran for key in record):
        return dict(record)  # nothing to narrow (a record made since narrowing was added)
    if any(fp.now(key) != digest for key, digest in record.items() if key.startswith("dare/")):
        return dict(record)  # stale: planned again, not narrowed
    owners, lookups = {}, set()
    for rel, qual in units:
        owner, _, name = qual.rpartition(".")
        owners.setdefault((rel, owner), set()).add(name)
        module = fp._module(rel) if rel.startswith("dare/") else None
        lookups |= module.attribute_names(qual) if module is not None else set()
    out, live = {}, fp.live
    for key, digest in record.items():
        if key.startswith("dare/") and key.endswith(".py") and key not in ran:
            mod = live.module(key)
            if mod is not None:
                new = imported_key(key, watched_names(mod, owners, lookups, live))
                out[new] = fp.now(new)
                continue
        out[key] = digest
    return out
