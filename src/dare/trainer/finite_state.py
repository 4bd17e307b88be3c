"""Non-finite values anywhere in a run's state (weights, optimizer moments, reference, companions), for checkpoints.

A finite loss can still leave the optimizer poisoned: one step whose gradient squares overflow makes Adam's
``exp_avg_sq`` infinite while the weights stay finite (the update of those entries is then 0, forever). Checked on
the weights alone, such a state was saved, rotated the good checkpoints away, resumed silently, and was named "the
last intact checkpoint" when the loss went NaN (issue 41, finding 4). ``checkpoint.py`` checks the whole state when it
writes one (and writes none that is not finite) and when it loads one.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


def first_non_finite(state: Any, prefix: str = "") -> Optional[str]:
    """The dotted name of the first floating-point tensor of ``state`` (nested dicts, lists, tuples; a DTensor by its
    local shard) that holds a NaN or an infinity, or None when every one is finite."""
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        local = state.to_local() if hasattr(state, "to_local") else state
        if isinstance(local, torch.Tensor) and local.is_floating_point() and not bool(torch.isfinite(local).all()):
            return prefix or "(state)"
        return None
    for key, value in items:
        found = first_non_finite(value, f"{prefix}.{key}" if prefix else str(key))
        if found is not None:
            return found
    return None


def agreed(local: Optional[str], distributed: bool) -> Optional[str]:
    """``local`` where every rank sees its own shards: each rank learns whether any rank found a non-finite tensor
    (the name is the lowest such rank's), so all of them write, or refuse to write, the same checkpoint."""
    if not distributed:
        return local
    import torch.distributed as dist
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, local)
    return next((f"{name} (rank {rank})" for rank, name in enumerate(found) if name is not None), None)
