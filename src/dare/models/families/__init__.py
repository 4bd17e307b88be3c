"""Model families: one spec module each (``base.FamilySpec``), discovered rather than listed.

Every module of this package is imported when the package is first imported (``load_builtin_families``), so adding a
family is adding a file. The registry is read as a plain dict (``FAMILIES``: ``dare models``, the support matrix),
which is why discovery runs at import rather than on the first lookup.
"""
from __future__ import annotations

import importlib
import pkgutil

from .base import FAMILIES, FamilySpec, UnsupportedModelError, detect_family, get_family, register_family, supported_description


def load_builtin_families() -> None:
    """Import every family module of this package (each registers its spec), then order the registry by
    ``listing_order`` (ties keep registration order). Idempotent."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_") and info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")
    ordered = sorted(FAMILIES.values(), key=lambda f: f.listing_order)
    FAMILIES.clear()
    FAMILIES.update((f.name, f) for f in ordered)


load_builtin_families()

__all__ = ["FAMILIES", "FamilySpec", "UnsupportedModelError", "detect_family", "get_family", "register_family",
           "supported_description", "load_builtin_families"]
