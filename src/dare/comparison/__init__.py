"""The RL comparison (``dare compare``): every registered RL algorithm on the embedded CPU task with a matched budget
and each method's own paper settings, its report, and what it measured. See docs/comparison.md.

- ``run``: the runs (``CompareOptions``, ``run_compare``; imports the trainer, so it is loaded only when asked);
- ``report``: the report's data (``comparison.json``) and the table rendered from it alone, and the figure;
- ``departures``: the documented factors on a method's paper-relative lr, with what was measured.
"""
from .departures import LrDeparture, departure_markdown, lr_departures, lr_factor

__all__ = ["LrDeparture", "departure_markdown", "lr_departures", "lr_factor", "run_compare", "CompareOptions"]


def __getattr__(name):  # the runs import the trainer; load them only when asked
    if name in ("run_compare", "CompareOptions"):
        from . import run
        return getattr(run, name)
    raise AttributeError(name)
