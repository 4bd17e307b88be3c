"""Explicit, keyed randomness for training.

Every random draw in training (masks, timesteps, rollout seeds) comes from a ``torch.Generator`` whose seed is
a hash of the run seed and a key such as ``(step, inner_iteration, sample_uid, mc_index)``. Consequences:

* old, reference and current policies score bit-identical corrupted inputs (they ask for the same key),
* the ``mu`` inner iterations of an RL step replay their noise exactly, whatever the micro-batching,
* a sample's noise does not depend on which rank or micro-batch it lands in, so a 2-process run sees the same
  masks as a 1-process run, and a resumed run the same as an uninterrupted one,
* nothing reseeds the global RNGs (the reference repos call ``set_seed`` in the middle of training).

Generators are CPU generators (draws are moved to the model's device afterwards) so that a run reproduces
across devices.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Union

import torch

KeyPart = Union[int, str]

# Named streams, so that two uses of the same (step, sample) key never share noise by accident.
STREAM_CORRUPT = "corrupt"
STREAM_ROLLOUT = "rollout"
STREAM_DATA = "data"


def derive_seed(run_seed: int, *key: KeyPart) -> int:
    """A 63-bit seed from the run seed and a key (stable across processes, platforms and Python versions)."""
    h = hashlib.blake2b(digest_size=8)
    for part in (int(run_seed),) + tuple(key):
        if isinstance(part, bool) or not isinstance(part, (int, str)):
            raise TypeError(f"noise key parts must be int or str, got {type(part).__name__} {part!r}")
        if isinstance(part, int):
            h.update(b"i" + struct.pack("<q", part))
        else:
            raw = part.encode()
            h.update(b"s" + struct.pack("<I", len(raw)) + raw)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def keyed_generator(run_seed: int, *key: KeyPart) -> torch.Generator:
    """A fresh CPU generator for ``key`` (see module docstring)."""
    return torch.Generator(device="cpu").manual_seed(derive_seed(run_seed, *key))


def sample_time(gen: torch.Generator, low: float = 0.0, high: float = 1.0, eps: float = 1e-3) -> float:
    """One diffusion time ``t ~ U(max(low, eps), high]`` (LLaDA: ``(1 - eps) u + eps``)."""
    lo = max(low, eps)
    if not 0.0 <= lo < high <= 1.0:
        raise ValueError(f"time range must satisfy 0 <= low < high <= 1, got low={low}, high={high}, eps={eps}")
    u = torch.rand((), generator=gen).item()
    return lo + (high - lo) * u


def stratified_times(gen: torch.Generator, n: int, low: float = 0.0, high: float = 1.0, eps: float = 1e-3) -> torch.Tensor:
    """``n`` times, one uniformly inside each of ``n`` equal strata of ``(low, high]`` (variance reduction, VRPO)."""
    lo = max(low, eps)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    return (lo + (high - lo) * (torch.arange(n, dtype=torch.float64) + u) / n).float()
