"""Atomic, resumable checkpoints: model + optimizer (DTensor-aware, torch.distributed.checkpoint), scheduler,
RNG states, step and data position.

A checkpoint is written to ``checkpoints/.tmp-step-N``; then ``manifest.json`` (size and sha256 of every file, so
``sha256sum`` can check it too), then ``COMPLETE``, then the folder is renamed to ``checkpoints/step-N`` (a rename is
atomic on POSIX). A run killed at any moment leaves either a complete ``step-N`` or a ``.tmp-*`` folder that is never
loaded (and is removed by the next save, or at once when the save itself fails, e.g. on a full disk). The data
position is the step number (the sampler is a pure function of the step), and every random draw in training is
keyed by (seed, step, ...), so a resumed run continues bit for bit.

Resuming verifies the manifest first: a truncated or bit-flipped file is named, and ``resume: auto`` falls back to
the newest intact checkpoint with a warning naming what it skipped. A checkpoint without a manifest (an older dare's,
or one whose manifest was deleted) is checked against itself: every shard byte range its DCP metadata names must be
there, so a lost shard also falls back instead of stopping the run at load. A state that is not finite (weights or
optimizer moments, ``dare.trainer.finite_state``) is never written (the run stops, naming the tensor and the last intact
checkpoint) and is an error naming the tensor when a checkpoint holding one is loaded.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from .distributed import DistEnv

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (incomplete, unreadable, or written by another recipe); names the folder."""


def _fsync_dir(path: Path) -> None:
    from ..files import fsync_dir
    fsync_dir(path)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _root_cause(e: BaseException) -> str:
    """One line for a DCP failure (its message otherwise embeds every rank's full traceback)."""
    failures = getattr(e, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        e = inner[0] if isinstance(inner, tuple) else inner
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _payload(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (COMPLETE, MANIFEST))


def write_manifest(folder: Path, step: int) -> None:
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in _payload(folder)}
    _write_text(folder / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))


def verify(folder: Path) -> Optional[str]:
    """None when ``folder`` is a complete checkpoint whose files match its manifest, else what is wrong (one line).
    A checkpoint written before manifests existed is accepted unverified (logged)."""
    folder = Path(folder)
    if not (folder / COMPLETE).exists():
        return f"incomplete (no {COMPLETE} marker)"
    if not (folder / MANIFEST).exists():
        # An older dare wrote no manifest; a deleted one looks the same. Check the checkpoint against itself.
        problem = _self_consistency(folder)
        if problem is None:
            log.warning("%s has no %s (written by an older dare); its files are all there, resuming from it without "
                        "checksums", folder, MANIFEST)
        return problem
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {want.get('bytes')} (truncated or overwritten)"
        if _sha256(path) != want.get("sha256"):
            return f"{name} does not match its sha256 in {MANIFEST} (corrupted)"
    unknown = [p.relative_to(folder).as_posix() for p in _payload(folder) if p.relative_to(folder).as_posix() not in files]
    return f"{unknown[0]} is not in {MANIFEST}" if unknown else None


def _self_consistency(folder: Path) -> Optional[str]:
    """What is missing from a checkpoint without a manifest (None when nothing is): the trainer state, the DCP
    metadata, and every byte range the metadata says a shard file holds."""
    for name in ("trainer_state.json", "dcp/.metadata"):
        if not (folder / name).is_file():
            return f"{name} is missing"
    from torch.distributed.checkpoint import FileSystemReader
    try:
        storage = FileSystemReader(str(folder / "dcp")).read_metadata().storage_data
    except Exception as e:  # a truncated or foreign .metadata: any unpickling error
        return f"dcp/.metadata unreadable ({type(e).__name__})"
    ends: dict[str, int] = {}
    for info in (storage or {}).values():
        path, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if isinstance(path, str):
            ends[path] = max(ends.get(path, 0), end)
    for name, end in sorted(ends.items()):
        shard = folder / "dcp" / name
        if not shard.is_file():
            return f"dcp/{name} is missing"
        if shard.stat().st_size < end:
            return f"dcp/{name} has {shard.stat().st_size} bytes, its metadata needs {end} (truncated)"
    return None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` (``step-N`` folders holding the COMPLETE marker), oldest first."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / COMPLETE).exists():
                out.append((int(m.group(1)), p))
    return sorted(out)


def _state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    # Frozen parameters (a LoRA base, a frozen reference) come back from the model source, not the checkpoint.
    return StateDictOptions(ignore_frozen_params=True)


def _os_error(e: BaseException) -> Optional[OSError]:
    """The OSError behind ``e`` (DCP wraps a rank's write error in its own exception), if any."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if failures:
            inner = next(iter(failures.values()))
            e = inner[0] if isinstance(inner, tuple) else inner
        else:
            e = e.__cause__ or e.__context__
        seen += 1
    return None


def _check_finite(path: Path, state: dict) -> None:
    """The loaded state must be finite, weights and optimizer moments alike: a NaN here would only show up steps later
    as a diverged run (``dare.trainer.finite_state``)."""
    from .finite_state import first_non_finite
    name = first_non_finite(state)
    if name is not None:
        raise CheckpointError(f"{path}: tensor {name} holds non-finite values (NaN/inf); resume from an earlier "
                              f"checkpoint (train.resume=<folder>) or start over")


def _train_state(model, optimizer, reference=None, companions=None) -> dict:
    """The DCP state of a run: policy + optimizer, the synced reference, and every companion model + optimizer."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options())
    state = {"model": model_sd, "optim": optim_sd}
    if reference is not None:
        state["reference"] = get_model_state_dict(reference)
    for name, (module, optim) in (companions or {}).items():
        c_model, c_optim = get_state_dict(module, optim, options=_state_options())
        state[f"companion.{name}"] = {"model": c_model, "optim": c_optim}
    return state


def _set_trainable_state(path: Path, model, optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load the trainable parameters and the optimizer state. Frozen parameters (a LoRA base, a value model's unused
    LM head) are not in the checkpoint (``ignore_frozen_params``) and keep their values from the model source; any
    other missing or unexpected key is an error."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    keys = set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                          options=StateDictOptions(ignore_frozen_params=True, strict=False))
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    missing = [k for k in keys.missing_keys if k not in frozen]
    if missing or keys.unexpected_keys:
        raise CheckpointError(f"{path}: the checkpoint does not fit this model (missing {missing[:5]}, unexpected "
                              f"{list(keys.unexpected_keys)[:5]}); was it written by a different recipe?")


class CheckpointManager:
    def __init__(self, run_dir: Path, env: DistEnv, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.env, self.keep = env, max(1, keep)

    def latest(self) -> Optional[Path]:
        found = list_checkpoints(self.root)
        return found[-1][1] if found else None

    def latest_intact(self) -> Optional[Path]:
        return next((p for _, p in reversed(list_checkpoints(self.root)) if verify(p) is None), None)

    def resolve(self, resume: str) -> Optional[Path]:
        """``auto`` (the newest intact checkpoint, or None), ``never``, or an explicit checkpoint folder (which must be
        intact). Damaged checkpoints that ``auto`` passes over are named in a warning."""
        if resume == "never":
            return None
        if resume != "auto":
            path = Path(resume)
            if not (path / COMPLETE).exists():
                raise CheckpointError(f"train.resume={resume}: not a complete checkpoint (no {COMPLETE} marker)")
            problem = verify(path)
            if problem:
                raise CheckpointError(f"train.resume={resume}: damaged checkpoint: {problem}")
            return path
        skipped = []
        for _, path in reversed(list_checkpoints(self.root)):
            problem = verify(path)
            if problem is None:
                if skipped:
                    log.warning("resuming from %s: skipped damaged checkpoint(s) %s", path.name, "; ".join(skipped))
                return path
            skipped.append(f"{path.name}: {problem}")
        if skipped:
            raise CheckpointError(f"{self.root}: no intact checkpoint to resume from ({'; '.join(skipped)}); start over "
                                  f"with train.resume=never in a new train.output_dir")
        return None

    # --- save ---------------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, trainer_state: dict, reference=None, companions=None) -> Path:
        """``companions``: ``{name: (module, optimizer)}`` trained alongside the policy (saved and loaded with it)."""
        final = self.root / f"step-{step}"
        tmp = self.root / f".tmp-step-{step}"
        try:
            self._write(step, tmp, final, model, optimizer, trainer_state, reference, companions)
        except BaseException as e:
            if self.env.is_main:  # never leave a half-written .tmp-* behind (a full disk stays full otherwise)
                shutil.rmtree(tmp, ignore_errors=True)
            cause = _os_error(e)
            if cause is not None:
                reason = os.strerror(cause.errno) if cause.errno else str(cause)
                hint = " (free some space, or lower train.keep_checkpoints)" if cause.errno == errno.ENOSPC else ""
                raise CheckpointError(f"cannot write checkpoint step-{step} in {self.root}: {reason}{hint}; the "
                                      f"previous checkpoint {self.latest() or '(none)'} is intact") from e
            raise
        return final

    def _write(self, step: int, tmp: Path, final: Path, model, optimizer, trainer_state: dict, reference,
               companions) -> None:
        import torch.distributed.checkpoint as dcp

        if self.env.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-*"):  # left by a killed run; never loadable
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.env.barrier()
        state = _train_state(model, optimizer, reference, companions)
        from .finite_state import agreed, first_non_finite
        bad = agreed(first_non_finite(state), self.env.distributed)
        if bad is not None:  # rotating the good checkpoints away for this one would lose the run
            raise CheckpointError(f"not writing checkpoint step-{step}: tensor {bad} holds non-finite values (NaN/inf) "
                                  f"while the loss and gradient were finite; the last intact checkpoint is "
                                  f"{self.latest_intact() or '(none yet)'}. Lower optim.lr, enable optim.grad_clip, or "
                                  f"use a higher-precision model.dtype")
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": yes, it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(state, checkpoint_id=str(tmp / "dcp"))
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, tmp / f"rng-rank{self.env.rank}.pt")
        self.env.barrier()
        if self.env.is_main:
            _write_text(tmp / "trainer_state.json", json.dumps(trainer_state, indent=2, default=str))
            write_manifest(tmp, step)
            _write_text(tmp / COMPLETE, f"step {step}\n")
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            for old_step, old in list_checkpoints(self.root)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.env.barrier()

    # --- load ---------------------------------------------------------------------------------------------
    @staticmethod
    def read_state(path: Path) -> dict[str, Any]:
        try:
            return json.loads((Path(path) / "trainer_state.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}/trainer_state.json: unreadable: {e}") from e

    def load(self, path: Path, model, optimizer, reference=None, companions=None) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        path = Path(path)
        if not (path / COMPLETE).exists():
            raise CheckpointError(f"{path}: incomplete checkpoint (no {COMPLETE} marker); refusing to load it")
        trainer_state = self.read_state(path)
        state = _train_state(model, optimizer, reference, companions)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.load(state, checkpoint_id=str(path / "dcp"))
        except (Exception, CheckpointException) as e:  # shape/key mismatch: another model or config (DCP's is a BaseException)
            raise CheckpointError(f"{path}: cannot load into this model/optimizer ({_root_cause(e)}); "
                                  f"was it written by a different recipe?") from e
        _check_finite(path, state)
        _set_trainable_state(path, model, optimizer, state["model"], state["optim"])
        for name, (module, optim) in (companions or {}).items():
            part = state[f"companion.{name}"]
            _set_trainable_state(path, module, optim, part["model"], part["optim"])
        if reference is not None:
            set_model_state_dict(reference, state["reference"])
        rng_file = path / f"rng-rank{self.env.rank}.pt"
        if rng_file.exists():
            try:
                rng = torch.load(rng_file, weights_only=False)
                torch.set_rng_state(rng["torch"])
                if "cuda" in rng and torch.cuda.is_available():
                    torch.cuda.set_rng_state(rng["cuda"])
            except Exception as e:  # truncated / corrupted pickle: name the file, not a pickle traceback
                raise CheckpointError(f"{rng_file}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                                      f"the checkpoint is damaged") from e
        return trainer_state
