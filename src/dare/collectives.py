"""Collectives that every layer above the models may need, with nothing of the trainer: the algorithms use them
inside their hooks and the trainer around them (so no algorithm imports the trainer).

* ``agree_max``: every data-parallel rank must run the same number of forwards under FSDP (each forward
  all-gathers), so a count that depends on a rank's data is agreed on first.
* ``gathered_for_inference``: parameters all-gathered once for a phase of forward-only passes (decoding), so a
  data-dependent number of forwards runs without collectives.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def agree_max(values: list[int], device) -> list[int]:
    """Element-wise max over data-parallel ranks: every rank must run the same number of forwards (FSDP)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


@contextmanager
def gathered_for_inference(model: torch.nn.Module):
    """All-gather FSDP2 parameters once for a phase of forward-only passes (rollouts, evaluation).

    Under FSDP every forward all-gathers each layer's parameters, a collective all ranks must join. Diffusion
    decoding runs a data-dependent number of forwards (threshold decoding, stop tokens, early stops), so a rank
    that finishes first would leave the others waiting in an all-gather forever. Gathering once before the phase
    and resharding after it removes every collective from the decoding loop (and an all-gather per step).
    A no-op for models that are not sharded.
    """
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not mods:
        yield model
        return
    if isinstance(model, FSDPModule):
        # FSDP2 finds its root in the first forward, and takes the first FSDP module a forward reaches for it. A
        # sampler that calls submodules (DiffusionGemma's encoder and decoder) would make a layer unit the root (one
        # of two modules: "requires a single root module"), so the root is settled here first.
        model._get_fsdp_state()._lazy_init()
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
    for m in mods:
        m.unshard()
    try:
        yield model
    finally:
        for m in mods:
            m.reshard()
            # FSDP2 never reshards the root after forward (the loss reads lm_head.weight right after the forward,
            # e.g. chunked log-probs); only the layers go back to resharding.
            if m is not model:
                m.set_reshard_after_forward(True, recurse=False)
