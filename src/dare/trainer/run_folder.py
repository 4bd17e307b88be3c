"""A run folder belongs to one run of one recipe: an exclusive lock while a process writes it, and the recipe's
fingerprint in every checkpoint so that a resume cannot silently continue another recipe.

Lock: ``<folder>/.lock``, held with ``fcntl.flock`` by ``dare train`` (rank 0) and ``dare eval`` for their whole
life. The kernel drops a flock when its process dies, so a run killed with ``kill -9`` leaves no stale lock: the
file stays, the lock does not. The file records who holds it, for the message the next process prints.

Fingerprint: the resolved recipe, flattened to dotted keys, minus the keys a resumed run may change without changing
what it computes (``RESUMABLE``: logging, where and how often to save, the step budget, performance knobs). Resuming
compares it key by key with the recipe stored in the checkpoint and names every change (old -> new).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ..config.core import shown, to_dict

# Dotted keys (or section prefixes) a resume may change. ``train.steps`` may grow (extend a finished run); the
# checkpoint's own step is checked against it separately. Micro-batching, process count, attention kernel and
# gradient checkpointing change how a step is computed, not what it computes (losses are additive; tested).
RESUMABLE = ("logging", "eval", "train.output_dir", "train.resume", "train.allow_recipe_change", "train.steps",
             "train.save_every", "train.keep_checkpoints", "train.log_every", "train.max_bad_steps", "train.export",
             "train.eval_every", "train.chunk_size", "train.micro_batch_size", "rollout.micro_batch_size",
             "reward.workers", "distributed", "model.attn_backend", "model.gradient_checkpointing")


class RunFolderBusy(ValueError):
    """Another process holds the run folder."""


class RecipeChanged(ValueError):
    """The recipe differs from the one that wrote the checkpoint being resumed."""


# ------------------------------------------------------------------------------------------------ lock
_HELD: dict[str, list] = {}  # real path -> [fd, count]: one process may open a folder more than once (tests do)


class RunLock:
    def __init__(self, folder: Path, what: str):
        self.folder, self.what, self.held = Path(folder), what, False

    def acquire(self) -> "RunLock":
        check_folder(self.folder, "output folder")
        self.folder.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.folder)
        if key in _HELD:
            _HELD[key][1] += 1
            self.held = True
            return self
        fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip() or "unknown process"
            os.close(fd)
            raise RunFolderBusy(f"{self.folder} is in use by another run ({holder}); wait for it to end or use "
                                f"another output folder") from None
        info = (f"{self.what}, pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                f"{' '.join(sys.argv)[:300]}")
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode() + b"\n", 0)
        _HELD[key] = [fd, 1]
        self.held = True
        return self

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        key = os.path.realpath(self.folder)
        entry = _HELD.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[key]
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            os.close(entry[0])

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_folder(path: Path, what: str) -> None:
    """A clear error when ``path`` (or a parent) exists but is not a folder."""
    for p in [Path(path), *Path(path).parents]:
        if p.exists():
            if not p.is_dir():
                raise ValueError(f"{what} {path}: {p} is a file, not a folder")
            return


# ------------------------------------------------------------------------------------------------ fingerprint
def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def _resumable(key: str) -> bool:
    return any(key == r or key.startswith(r + ".") for r in RESUMABLE)


def fingerprint_items(recipe_dict: dict) -> dict[str, Any]:
    """The keys that define a run (dotted, JSON-normalised values)."""
    plain = json.loads(json.dumps(recipe_dict, default=str, sort_keys=True))
    return {k: v for k, v in sorted(_flat(plain).items()) if not _resumable(k)}


def fingerprint(recipe) -> str:
    items = fingerprint_items(to_dict(recipe))
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


def recipe_changes(old_recipe: dict, new_recipe: dict) -> list[str]:
    """``key: old -> new`` for every fingerprinted key the two recipes both have and disagree on (a key only one side
    has comes from another dare version's schema; ``algorithm.name`` covers a switch of algorithm section)."""
    old, new = fingerprint_items(old_recipe), fingerprint_items(new_recipe)
    return [f"{k}: {shown(old[k], 60)} -> {shown(new[k], 60)}" for k in sorted(set(old) & set(new)) if old[k] != new[k]]


def check_resume(recipe, state: dict, checkpoint: Path) -> list[str]:
    """Raise ``RecipeChanged`` when ``recipe`` differs from the one stored in ``state`` (unless the recipe opts in with
    ``train.allow_recipe_change``; then the changes are returned for a warning). Also refuses a step budget below
    the checkpoint's step."""
    step = int(state.get("step", 0))
    if recipe.train.steps < step:
        raise RecipeChanged(f"train.steps={recipe.train.steps}, but {checkpoint} is at step {step}; raise train.steps "
                            f"to continue it, or start over with train.resume=never in a new train.output_dir")
    stored = state.get("recipe")
    if not isinstance(stored, dict):
        return []
    changes = recipe_changes(stored, to_dict(recipe))
    if changes and not recipe.train.allow_recipe_change:
        raise RecipeChanged(
            f"{recipe.train.output_dir} holds a run of another recipe (checkpoint {checkpoint.name}); changed: "
            f"{'; '.join(changes)}. Start a new run with train.resume=never and a new train.output_dir, or continue "
            f"this one with the changes: train.allow_recipe_change=true")
    return changes
