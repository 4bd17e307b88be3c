"""Parsed local data files, kept per process: a process that builds several runs on one dataset (``dare compare``'s
methods, a sweep in a notebook, the test suite) parses each file once.

``load_examples`` parses every row of a file whenever it shuffles (the shuffle is over all valid rows), which is most
of a small run's start-up: the bundled Countdown training file (20,000 rows) takes about 1.3 s to parse for a run that
keeps 64 of them. A file's parsed rows are kept under its path and the hash of its bytes and every field of the
data config that shapes parsing (all but ``limit`` and ``shuffle_seed``, which act on the parsed list), so an edited
file or another layout parses again. Only files whose every row parsed are kept (a skipped row's warning is not said
twice; nor a bundled split with known-bad rows), only files up to ``MAX_BYTES`` and ``MAX_ROWS`` rows, and only the
``KEEP`` most recent. Callers get deep copies: an example a run changes does not change the next run's.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections import OrderedDict
from pathlib import Path
from typing import Optional

KEEP = 4
MAX_ROWS = 100_000
MAX_BYTES = 64 << 20

_kept: "OrderedDict[tuple, list[dict]]" = OrderedDict()


def source_file(cfg) -> Optional[Path]:
    """The local file ``cfg`` reads (a ``path``, or the bundled split its source picks), None for a hub dataset."""
    if cfg.path:
        from .readers import resolve_data_path
        return resolve_data_path(cfg.path)
    if cfg.hf or cfg.loader:  # the hub, or a user's function: nothing on disk says when its rows change
        return None
    from .registry import get_dataset
    try:
        spec = get_dataset(cfg.name)
    except ValueError:  # load_examples says what is wrong with the name
        return None
    if spec.known_bad.get(cfg.split):  # its parse says which rows it drops (an info line per row): parsed each time
        return None
    return spec.bundled(cfg.split) if cfg.source in ("bundled", "auto") else None


def key(cfg, path: Optional[Path]) -> Optional[tuple]:
    """The memo key of ``cfg``'s parsed rows read from the local file ``path`` (None: not kept, e.g. a hub dataset)."""
    if path is None:
        return None
    try:
        if not path.is_file() or path.stat().st_size > MAX_BYTES:
            return None
        digest = hashlib.sha1(path.read_bytes()).hexdigest()  # ~2 ms a MB; a timestamp can miss a quick rewrite
    except OSError:
        return None
    shape = dataclasses.replace(cfg, limit=None, shuffle_seed=None)
    return (str(path.resolve()), digest, repr(shape))


def get(k: Optional[tuple]) -> Optional[list[dict]]:
    """A copy of the rows kept under ``k`` (None when none are)."""
    if k is None or k not in _kept:
        return None
    _kept.move_to_end(k)
    return list(_kept[k])


def put(k: Optional[tuple], examples: list[dict]) -> None:
    if k is None or len(examples) > MAX_ROWS:
        return
    _kept[k] = copy.deepcopy(examples)
    _kept.move_to_end(k)
    while len(_kept) > KEEP:
        _kept.popitem(last=False)


def clear() -> None:
    _kept.clear()


def detached(examples: list[dict]) -> list[dict]:
    """Deep copies of kept examples (what a caller may change)."""
    return copy.deepcopy(examples)
