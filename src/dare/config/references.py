"""A user's own code named in a recipe: ``module:attr`` (an importable module, or a ``module.py`` in the working
directory) or ``path/to/file.py:attr`` (a file, relative to the working directory or absolute).

Recipes use it for a reward (``reward.name: ./my_rewards.py:score``, or a key of ``reward.terms``) and for a dataset
loader (``data.loader: my_data:load``), so a user plugs in code from ``dare train`` without writing a launcher.
``load_reference`` imports the code once per process; ``absolute`` turns a reference into one that names the same code
from any working directory (what reward worker processes are sent).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

_ATTR = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_MODULE = re.compile(rf"^{_ATTR}:{_ATTR}$")
_FILE = re.compile(rf"^(?P<file>.+\.py):(?P<attr>{_ATTR})$")


class ReferenceError_(ValueError):
    """A reference that does not name loadable code (a one-line message naming the reference and the cause)."""


def is_reference(text: Any) -> bool:
    """True for ``module:attr`` and ``file.py:attr`` (the built-in names of rewards and datasets hold no ':')."""
    return isinstance(text, str) and bool(_FILE.match(text) or _MODULE.match(text))


def _split(ref: str) -> tuple[str, str, bool]:
    m = _FILE.match(ref)
    if m:
        return m["file"], m["attr"], True
    if _MODULE.match(ref):
        module, attr = ref.split(":")
        return module, attr, False
    raise ReferenceError_(f"{ref!r} is not a reference to code: write module:function or path/to/file.py:function")


def absolute(ref: str) -> str:
    """The same reference from any working directory: a file made absolute; a module that is only importable as a
    file of the working directory named by that file. Kept per (reference, working directory): a reward looks its
    function up for every scored completion, and resolving touches the file system."""
    return _absolute(ref, os.getcwd())


@functools.lru_cache(maxsize=None)
def _absolute(ref: str, cwd: str) -> str:
    target, attr, is_file = _split(ref)
    if is_file:
        return f"{(Path(cwd) / Path(target).expanduser()).resolve()}:{attr}"
    local = Path(cwd) / (target.replace(".", os.sep) + ".py")
    if importlib.util.find_spec(target.split(".")[0]) is None and local.is_file():
        return f"{local.resolve()}:{attr}"
    return ref


def _load_file(path: Path):
    name = "dare_user_" + re.sub(r"\W", "_", path.stem) + "_" + hashlib.sha1(str(path).encode()).hexdigest()[:8]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@functools.lru_cache(maxsize=None)
def _load(ref: str) -> Callable:
    target, attr, is_file = _split(ref)
    if is_file:
        path = Path(target).expanduser()
        if not path.is_absolute():
            path = Path.cwd() / path
        if not path.is_file():
            raise ReferenceError_(f"{ref!r}: no file {path}")
        module = _load_file(path.resolve())
    else:
        local = Path.cwd() / (target.replace(".", os.sep) + ".py")
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name != target.split(".")[0] or not local.is_file():
                raise ReferenceError_(f"{ref!r}: no module named {e.name!r} (neither importable nor a file "
                                      f"{local.name} in {Path.cwd()})") from None
            module = _load_file(local.resolve())
    value: Any = module
    for part in attr.split("."):
        if not hasattr(value, part):
            raise ReferenceError_(f"{ref!r}: {getattr(module, '__file__', target)} defines no {attr!r}")
        value = getattr(value, part)
    if not callable(value):
        raise ReferenceError_(f"{ref!r}: {attr} is a {type(value).__name__}, not a function")
    return value


def load_reference(ref: str, where: str) -> Callable:
    """The function ``ref`` names, imported once per process. Any failure, the user's module raising included, is a
    ``ValueError`` of one line that starts with ``where`` (the recipe key)."""
    try:
        return _load(absolute(ref))
    except ReferenceError_ as e:
        raise ValueError(f"{where}: {e}") from None
    except Exception as e:  # the user's module failed to import
        raise ValueError(f"{where}: importing {ref!r} failed: {type(e).__name__}: {e}") from e


class Referenced:
    """A referenced function as a picklable callable: it pickles as its absolute reference, so a worker process (spawn
    or forkserver) imports the user's code itself, once, instead of needing it importable by module name."""

    def __init__(self, ref: str, name: str | None = None):
        self.ref = absolute(ref)
        self.__name__ = name or ref  # what logs and metrics call it: the reference as the user wrote it

    def __call__(self, *args, **kwargs):
        return _load(self.ref)(*args, **kwargs)

    def __reduce__(self):
        return (Referenced, (self.ref, self.__name__))

    def __repr__(self) -> str:
        return f"Referenced({self.__name__!r})"
