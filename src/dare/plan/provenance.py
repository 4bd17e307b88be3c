"""What a plan depends on, recorded while it is made, so a stored plan can be checked current without planning again.

A plan is a function of its recipe (``scripts/plan_recipes.py``'s shape key), the files it read (the shipped
config.json) and the code that ran. ``recording()`` traces one planning call into a record, {key: fingerprint}:

- every function and method of dare and transformers that ran, as a *unit*: a module-level function or a method
  (a nested function, lambda or comprehension counts as part of the unit that holds it), fingerprinted by its syntax
  tree without docstrings, so comments, docstrings, formatting and moved lines do not count;
- the *skeleton* of each module that had a unit run: the module without its function bodies (constants, class
  attributes, dataclass fields, imports), which those functions read; of a module that was only imported, the part
  that can change what ran (``narrow``), so one method's edit leaves other methods' plans current;
- every file under the dare package that was opened (a shipped config.json, an index), by its bytes;
- torch's version (its kernels and meta functions are not traced; a plan is checked under the torch it was made by).

``Fingerprinter.changed(record)`` recomputes each fingerprint from the files as they are now and names each one that
moved; ``store`` / ``load`` keep the records of many plans in one table.
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from .imported import IMPORTED, ImportedSkeleton, Live, imported_key, parse_imported_key  # noqa: F401
from .imported import narrow as _narrow

TRACED_PACKAGES = ("dare", "transformers")
SELF = ("dare/plan/provenance.py", "dare/plan/imported.py")  # the recorder is not what a plan depends on


def _package_roots() -> dict[str, Path]:
    """Package name -> the folder that holds it (``src`` for dare), for the traced packages that are importable."""
    import importlib.util
    roots = {}
    for name in TRACED_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            roots[name] = Path(spec.origin).resolve().parent.parent
    return roots


def _relative(path: str, roots: dict[str, Path]) -> Optional[str]:
    """``dare/trainer/loop.py`` for a file of a traced package, else None."""
    p = Path(path)
    if not p.is_absolute():
        return None
    for name, root in roots.items():
        try:
            rel = p.resolve().relative_to(root)
        except ValueError:
            continue
        if rel.parts and rel.parts[0] == name:
            return rel.as_posix()
    return None


# --- fingerprints -----------------------------------------------------------------------------------------------


def _strip_docstring(body: list) -> list:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:]
    return body


def _serialise(node, out: list) -> None:
    """A version-stable text of a syntax tree: node types and field values, no positions; empty and None fields are
    left out (newer Pythons add optional fields, e.g. ``type_params``), docstrings dropped."""
    if isinstance(node, ast.AST):
        out.append(type(node).__name__ + "(")
        for name in node._fields:
            value = getattr(node, name, None)
            if name == "body" and isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                value = _strip_docstring(value)
            if value is None or value == [] or name == "ctx":
                continue
            out.append(name + "=")
            _serialise(value, out)
            out.append(",")
        out.append(")")
    elif isinstance(node, list):
        out.append("[")
        for item in node:
            _serialise(item, out)
            out.append(",")
        out.append("]")
    else:
        out.append(repr(node))


def _digest(node) -> str:
    out: list = []
    _serialise(node, out)
    return hashlib.sha1("".join(out).encode()).hexdigest()[:16]


@dataclass
class _Unit:
    qualname: str
    first: int  # first line (its first decorator's)
    last: int
    nodes: list = field(default_factory=list)  # a name defined twice (under if / else) is one unit


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


class ModuleFingerprints:
    """The units and the skeleton of one source file, parsed once."""

    def __init__(self, source: str):
        self._source = source
        tree = ast.parse(source)
        self.units: dict[str, _Unit] = {}
        self._collect(tree.body, "")
        self.skeleton = _digest(_Skeleton().visit(tree))

    def _collect(self, body: list, prefix: str) -> None:
        for node in body:
            if isinstance(node, _DEFS):
                name = prefix + node.name
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                unit = self.units.setdefault(name, _Unit(name, first, node.end_lineno))
                unit.first, unit.last = min(unit.first, first), max(unit.last, node.end_lineno)
                unit.nodes.append(node)
            elif isinstance(node, ast.ClassDef):
                self._collect(node.body, f"{prefix}{node.name}.")
            else:  # defs under module-level if / try / with / for
                for attr in ("body", "orelse", "finalbody", "handlers"):  # a handler's own body is its "body"
                    inner = getattr(node, attr, None)
                    if isinstance(inner, list):
                        self._collect(inner, prefix)

    def unit_at(self, line: int) -> Optional[str]:
        """The unit whose lines hold ``line`` (a code object's first line), or None for module or class-body code."""
        best = None
        for unit in self.units.values():
            if unit.first <= line <= unit.last and (best is None or unit.first >= best.first):
                best = unit
        return best.qualname if best is not None else None

    def digest(self, qualname: str) -> Optional[str]:
        unit = self.units.get(qualname)
        return None if unit is None else _digest(unit.nodes)

    def imported(self, watched: dict[str, frozenset]) -> str:
        """The fingerprint of the module as a plan that only imported it reads it (see ``narrow``)."""
        return _digest(ImportedSkeleton(watched).visit(ast.parse(self._source)))

    def attribute_names(self, qualname: str) -> set[str]:
        """The names a unit looks up by string (``getattr(x, "name")``, ``hasattr``, ``setattr``)."""
        out = set()
        for node in self.units[qualname].nodes if qualname in self.units else []:
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and len(call.args) >= 2 \
                        and call.func.id in ("getattr", "hasattr", "setattr", "delattr") \
                        and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str):
                    out.add(call.args[1].value)
        return out


class _Skeleton(ast.NodeTransformer):
    """The module without function bodies: a def keeps only its name (its unit fingerprints the rest)."""

    def visit_FunctionDef(self, node):
        return ast.Name(id="def " + node.name)

    visit_AsyncFunctionDef = visit_FunctionDef


# --- recording --------------------------------------------------------------------------------------------------
# A record is flat, {key: fingerprint}, with one key syntax per kind of dependency:
#   "dare/trainer/loop.py::Trainer.train_step"   a unit (function or method)
#   "dare/trainer/loop.py"                       a module's skeleton
#   "dare/rewards/x.py#imported:Cls=name,..."    what a plan reads of a module it only imported (``narrow``)
#   "dare/plan/configs/x.json"                   a file the plan read (sha1 of its bytes)
#   "version:torch"                              a package pinned by version (its version)


def _file_sha(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()[:16]


def _version(package: str) -> Optional[str]:
    """The installed version of a package (without a local build tag), or None."""
    import importlib.metadata
    try:
        return importlib.metadata.version(package).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def recording() -> Iterator[dict]:
    """Trace the body: the yielded dict is filled with the record ({key: fingerprint}) when the body ends (also when
    it raises)."""
    roots = _package_roots()
    codes: dict[int, object] = {}
    opened: set[str] = set()
    active = [True]

    def tracer(frame, event, arg):  # called once per Python call, no line events
        codes[id(frame.f_code)] = frame.f_code

    def audit(event, args):  # audit hooks cannot be removed: this one goes quiet when the recording ends
        if active[0] and event == "open" and isinstance(args[0], (str, Path)):
            opened.add(str(args[0]))

    sys.addaudithook(audit)
    record: dict = {"version:torch": _version("torch")}
    # This thread: cProfile's C hook, one entry per function that ran (a Python trace function costs a Python call per
    # call: a plan took 2.8x its time under it, 1.5x under this, with the same record); threads started meanwhile: the
    # trace function.
    import cProfile
    profiler, old, old_profile = cProfile.Profile(subcalls=False, builtins=False), threading.gettrace(), sys.getprofile()
    threading.settrace(tracer)
    try:
        profiler.enable()
    except ValueError:  # another profiler is active (Python 3.12+ refuses a second): the trace function then
        profiler, old_trace = None, sys.gettrace()
        sys.settrace(tracer)
    try:
        yield record
    finally:
        if profiler is not None:
            profiler.disable()
            sys.setprofile(old_profile)  # the profile hook it replaced (Python 3.11 takes it over)
            codes.update({id(e.code): e.code for e in profiler.getstats() if not isinstance(e.code, str)})
        else:
            sys.settrace(old_trace)
        threading.settrace(old)
        active[0] = False
        record.update(narrow(_fingerprints_of(codes.values(), opened, roots)))


def _fingerprints_of(codes, opened: set, roots: dict) -> dict:
    out = {}
    by_file: dict[str, list] = {}
    for code in codes:
        rel = _relative(code.co_filename, roots)
        if rel is not None and rel.endswith(".py") and rel not in SELF:
            by_file.setdefault(rel, []).append(code)
    for package in {rel.split("/")[0] for rel in by_file} - {"dare"}:
        out[f"version:{package}"] = _version(package)  # its units are compared only under another version
    for rel, file_codes in by_file.items():
        fp = ModuleFingerprints((roots[rel.split("/")[0]] / rel).read_text(encoding="utf-8"))
        out[rel] = fp.skeleton
        for code in file_codes:
            unit = fp.unit_at(code.co_firstlineno)
            if unit is not None:
                out[f"{rel}::{unit}"] = fp.digest(unit)
    for name in opened:
        rel = _relative(name, {"dare": roots["dare"]})
        if rel is not None and not rel.endswith((".py", ".pyc")) and "__pycache__" not in rel \
                and (roots["dare"] / rel).is_file():
            out[rel] = _file_sha(roots["dare"] / rel)
    return out


def narrow(record: dict, fp: Optional["Fingerprinter"] = None) -> dict:
    """``record`` with each module the plan only imported narrowed to what can change what ran
    (``dare.plan.imported``)."""
    return _narrow(record, fp or Fingerprinter())


# --- checking ---------------------------------------------------------------------------------------------------


class Fingerprinter:
    """Current fingerprints, each source file parsed once (one instance checks every stored plan)."""

    def __init__(self):
        self.roots = _package_roots()
        self.live = Live(self.roots, _relative)
        self._modules: dict[str, Optional[ModuleFingerprints]] = {}
        self._now: dict[str, Optional[str]] = {}

    def _module(self, rel: str) -> Optional[ModuleFingerprints]:
        if rel not in self._modules:
            root = self.roots.get(rel.split("/")[0])
            path = root / rel if root is not None else None
            self._modules[rel] = (ModuleFingerprints(path.read_text(encoding="utf-8"))
                                  if path is not None and path.is_file() else None)
        return self._modules[rel]

    def now(self, key: str) -> Optional[str]:
        """The key's fingerprint from the files as they are now; None when its unit, module or file is gone."""
        if key not in self._now:
            if key.startswith("version:"):
                value = _version(key[8:])
            elif IMPORTED in key:
                rel, watched = parse_imported_key(key)
                fp = self._module(rel)
                value = fp.imported(watched) if fp is not None else None
            elif "::" in key:
                rel, qualname = key.split("::", 1)
                fp = self._module(rel)
                value = fp.digest(qualname) if fp is not None else None
            elif key.endswith(".py"):
                fp = self._module(key)
                value = fp.skeleton if fp is not None else None
            else:
                root = self.roots.get(key.split("/")[0])
                value = _file_sha(root / key) if root is not None and (root / key).is_file() else None
            self._now[key] = value
        return self._now[key]

    def changed(self, record: dict) -> dict[str, str]:
        """What moved since ``record`` was taken: key -> one line ("dare/x.py::f changed", "... is gone")."""
        out = {}
        # another package's code is read only when its version moved (a released version does not change)
        same = {k[8:] for k, v in record.items() if k.startswith("version:") and self.now(k) == v}
        for key, digest in sorted(record.items()):
            if key.split("/")[0] in same:
                continue
            now = self.now(key)
            if now == digest:
                continue
            if key.startswith("version:"):
                out[key] = f"{key[8:]} {digest} made the plan, this is {key[8:]} {now}"
            elif now is None:
                out[key] = f"{key} is gone"
            elif "::" not in key and key.endswith(".py"):
                out[key] = f"{key}: its module-level code (constants, class attributes, imports) changed"
            elif IMPORTED in key:
                out[key] = (f"{key.partition(IMPORTED)[0]}: what a plan that only imported it reads (constants, class "
                            "attributes, imports, registrations, overrides of what ran) changed")
            else:
                out[key] = f"{key} changed"
        return out


# --- storage ----------------------------------------------------------------------------------------------------
# Plans share most of their dependencies: a stored set of plans keeps one table of (key, fingerprint) entries and, per
# plan, the indices of its entries as ranges ("0-17,19,25-30"). A key may have two entries when a plan made before a
# change is kept beside one made after it.


def encode_indices(indices) -> str:
    out, run = [], None
    for i in sorted(set(indices)):
        if run is not None and i == run[1] + 1:
            run[1] = i
            continue
        if run is not None:
            out.append(f"{run[0]}-{run[1]}" if run[1] > run[0] else str(run[0]))
        run = [i, i]
    if run is not None:
        out.append(f"{run[0]}-{run[1]}" if run[1] > run[0] else str(run[0]))
    return ",".join(out)


def decode_indices(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def store(records: dict) -> tuple[dict, dict]:
    """``records`` ({plan id: record}) as (table {"keys": [...], "fingerprints": [...]}, {plan id: ranges})."""
    entries = sorted({(k, d) for record in records.values() for k, d in record.items()})
    index = {e: i for i, e in enumerate(entries)}
    return ({"keys": [k for k, _ in entries], "fingerprints": [d for _, d in entries]},
            {pid: encode_indices(index[e] for e in record.items()) for pid, record in records.items()})


def load(table: dict, ranges: str) -> dict:
    """One plan's record from the stored table and its ranges."""
    keys, digests = table["keys"], table["fingerprints"]
    return {keys[i]: digests[i] for i in decode_indices(ranges)}


def is_own(key: str) -> bool:
    """Whether a key is dare's own (code, a file, a missing record: a change a contributor made) rather than another
    package's (its version or code)."""
    return not key.startswith("version:") and key.split("/")[0] not in TRACED_PACKAGES[1:]
