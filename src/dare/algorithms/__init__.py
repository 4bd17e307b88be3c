"""Training methods as plug-ins: one module per method, registered with ``@register_algorithm``.

Every module in this package is imported on first use (``load_builtin_algorithms``), so adding a method is
adding a file; nothing else needs to list it.
"""
from __future__ import annotations

import importlib
import pkgutil

from .base import (ALGORITHMS, Algorithm, AlgorithmConfig, Batch, Companion, LogLik, StepContext, View,
                   build_algorithm, get_algorithm, register_algorithm)

_LOADED = False


def load_builtin_algorithms() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_") and info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")


__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmConfig", "Batch", "Companion", "LogLik", "StepContext", "View", "build_algorithm",
           "get_algorithm", "register_algorithm", "load_builtin_algorithms"]
