"""The algorithm registry: ``algorithm.name`` in a recipe -> the class registered with ``@register_algorithm``.

Every module of this package is imported on first use (``load_builtin_algorithms``), so adding a method is adding a
file; nothing lists the methods. The modules are found on disk and imported by name, so no module of the package
imports another one to be registered (and the package has no import circle).
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from .base import Algorithm, AlgorithmConfig

ALGORITHMS: dict[str, type["Algorithm"]] = {}
_LOADED = [False]


def load_builtin_algorithms() -> None:
    """Import every module of this package once (each method module registers its class; the others register
    nothing)."""
    if _LOADED[0]:
        return
    _LOADED[0] = True
    package = __name__.rpartition(".")[0]
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")


def register_algorithm(cls: type["Algorithm"]) -> type["Algorithm"]:
    """Class decorator: make ``cls`` available as ``algorithm.name: <cls.name>`` in recipes."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in ALGORITHMS and ALGORITHMS[cls.name] is not cls:
        raise ValueError(f"algorithm {cls.name!r} is registered twice ({ALGORITHMS[cls.name].__name__}, {cls.__name__})")
    ALGORITHMS[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type["Algorithm"]:
    load_builtin_algorithms()
    if name not in ALGORITHMS:
        import difflib
        close = difflib.get_close_matches(name, list(ALGORITHMS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown algorithm {name!r}.{hint} Registered: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]


def build_algorithm(config: "AlgorithmConfig") -> "Algorithm":
    cls = get_algorithm(config.name)
    if not isinstance(config, cls.config_class):
        raise TypeError(f"algorithm {config.name!r} needs a {cls.config_class.__name__}, got {type(config).__name__}")
    return cls(config)
