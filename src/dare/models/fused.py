"""Fused projections at inference, with the published separate parameters kept.

At batch 1 a diffusion step feeds only a block of 32 tokens, so each GEMM has few rows and q/k/v (and gate/up)
as separate GEMMs pay their fixed cost three (two) times. ``fuse_linears`` moves the weights of several
``nn.Linear`` into row blocks of one buffer: each parameter becomes a view of it, so names, LoRA targets,
optimizer state, ``state_dict`` and the saved checkpoint layout are unchanged, and in-place updates (optimizer
steps, ``load_state_dict`` copies, LoRA merges) land in the buffer. ``live_fused`` hands out the buffer only
while that is still true and no gradient has to reach the separate parameters; anything that gives a weight new
storage (assign-loading, ``.to(dtype)``, FSDP sharding) or wraps a projection (LoRA) makes it return None, and
the caller falls back to the separate projections. One GEMM over the buffer gives the same bits as the separate
ones (the output columns are independent), which the parity tests check.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import nn


class FusedLinear(NamedTuple):
    weight: torch.Tensor  # [sum of out_features, in_features]
    bias: Optional[torch.Tensor]
    splits: tuple[int, ...]  # out_features of every part
    pointers: tuple[int, ...]  # data_ptr of every part's weight while it is a view of ``weight``


def is_plain_tensor(t: torch.Tensor) -> bool:
    """A materialised plain tensor (not a meta tensor, not a DTensor or other subclass, e.g. an FSDP shard)."""
    return type(t.data) is torch.Tensor and not t.is_meta


def fuse_linears(linears: Sequence[nn.Module]) -> Optional[FusedLinear]:
    """Make the weights (and biases) of ``linears`` views of one buffer; None where that is not possible."""
    if not all(type(m) is nn.Linear for m in linears):
        return None
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    first = weights[0]
    if not all(is_plain_tensor(w) and w.dtype == first.dtype and w.device == first.device and w.shape[1] == first.shape[1]
               for w in weights):
        return None
    has_bias = [b is not None for b in biases]
    if any(has_bias) and not (all(has_bias) and all(is_plain_tensor(b) and b.dtype == first.dtype for b in biases)):
        return None
    with torch.no_grad():
        buf = torch.cat([w.detach() for w in weights])
        bias = torch.cat([b.detach() for b in biases]) if all(has_bias) else None
    splits, start = [], 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = buf[start:start + n]
        if bias is not None:
            m.bias.data = bias[start:start + n]
        splits.append(n)
        start += n
    return FusedLinear(buf, bias, tuple(splits), tuple(m.weight.data_ptr() for m in linears))


def views_intact(fused: FusedLinear, linears: Sequence[nn.Module]) -> bool:
    """True while every part of ``linears`` is a plain ``nn.Linear`` whose weight (and bias) is still its view."""
    start = 0
    for m, ptr, n in zip(linears, fused.pointers, fused.splits):
        if type(m) is not nn.Linear or m.weight.data_ptr() != ptr:
            return False
        if fused.bias is not None and (m.bias is None or m.bias.data_ptr() != fused.bias[start:].data_ptr()):
            return False
        start += n
    return True


class FusedProjections:
    """Mixin of a module with groups of projections that run as one GEMM at inference.

    ``_fused_groups`` names each group's attribute and its projections; ``live_fused(name)`` returns the group's
    ``FusedLinear`` while it may be used, drops it for good once a part got new storage (so a dead buffer is
    not kept alive), and returns None while gradients must reach the parts (training forwards)."""

    _fused_groups: dict[str, tuple[str, ...]] = {}

    def fuse_projections(self) -> None:
        for name, parts in self._fused_groups.items():
            linears = tuple(getattr(self, p, None) for p in parts)
            current = self.__dict__.get(name)
            if None in linears or (current is not None and views_intact(current, linears)):
                continue
            self.__dict__[name] = fuse_linears(linears)

    def live_fused(self, name: str) -> Optional[FusedLinear]:
        f = self.__dict__.get(name)
        if f is None:
            return None
        linears = tuple(getattr(self, p) for p in self._fused_groups[name])
        if not views_intact(f, linears):
            self.__dict__[name] = None
            return None
        if torch.is_grad_enabled() and any(m.weight.requires_grad for m in linears):
            return None
        return f
