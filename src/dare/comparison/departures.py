"""The comparison's documented departures from a method's paper settings: factors on its paper-relative lr.

These are outcomes of ``dare compare`` on the tiny shipped checkpoints (each method oscillated, collapsed or left the
reference in one step at its paper's ratio there), not properties of the methods; each method's manifest carries its
own (``Algorithm.departure``, an ``LrDeparture``), so no list here names a method. ``dare compare`` multiplies the
method's paper-relative lr by ``factor`` (``paper_overrides(..., lr_factor=...)``); the method's doc prints the note
after its paper settings (the block that ``scripts/generate.py`` writes). A method without one runs at its paper
ratio. Each entry names the shipped checkpoints the experiment ran on and the document that holds it; a test checks
both exist.
"""
from __future__ import annotations

from typing import Optional

from ..algorithms import ALGORITHMS, load_builtin_algorithms
from ..algorithms.paper import LrDeparture, own

__all__ = ["LrDeparture", "departure", "departure_markdown", "lr_departures", "lr_factor"]


def departure(name: str) -> Optional[LrDeparture]:
    """The departure algorithm ``name`` declares, or None (also for a name no algorithm is registered under)."""
    load_builtin_algorithms()
    cls = ALGORITHMS.get(name)
    return own(cls, "departure") if cls is not None else None


def lr_departures() -> dict[str, LrDeparture]:
    """Every registered method's departure, by name."""
    load_builtin_algorithms()
    return {name: own(cls, "departure") for name, cls in sorted(ALGORITHMS.items()) if own(cls, "departure")}


def lr_factor(name: str) -> float:
    """The factor ``dare compare`` applies to algorithm ``name``'s paper-relative lr (1.0: none)."""
    entry = departure(name)
    return entry.factor if entry is not None else 1.0


def departure_markdown(name: str) -> str:
    """The sentence the method doc prints after its paper settings (with a leading space), or "" for none."""
    entry = departure(name)
    if entry is None:
        return ""
    return f" On the embedded CPU task `dare compare` multiplies its relative lr by {entry.factor:.3g}: {entry.note}"
