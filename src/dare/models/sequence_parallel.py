"""Ulysses sequence parallelism for the training forward (``distributed.sequence_parallel: N``).

The N ranks of a sequence-parallel group hold the same micro-batch. Each embeds and runs every decoder layer on its
1/N of the positions; attention swaps the split with two all-to-alls per layer (DeepSpeed-Ulysses): queries, keys
and values go from [all heads, my positions] to [my heads, all positions], attention runs over the whole sequence
with the whole mask (every layout: bidirectional, block-causal, ``[x_t ; x_0]``, packed), and the output goes back.
MLPs, norms and MoE routing are per token and need nothing. Activations per rank shrink by N.

Log-probabilities are taken where the rows live (``dare.diffusion.logprob.score_targets``): each rank scores the
targets predicted by its rows (Dream's shift included) and a sum over the group gives every rank the whole
``[B, L]`` log-probs, so the losses downstream are computed identically on every rank of the group.

Gradient bookkeeping: the trainer scales losses by the data-parallel size (world / N) and FSDP averages over the
world, so work every rank of a group repeats (the loss, a companion model) counts once; the group sum's backward
multiplies by N, so each rank's share of the sharded forward counts once too.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceGroup:
    """One rank's place in its sequence-parallel group."""
    group: object  # torch.distributed ProcessGroup
    size: int
    rank: int

    def local(self, length: int) -> slice:
        """The positions this rank owns of a sequence of ``length`` (a multiple of ``size``)."""
        n = length // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def heads_from_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """[B, H, L/N, D] (all heads, my positions) -> [B, H/N, L, D] (my heads, all positions)."""
        return _Swap.apply(t, self, True)

    def sequence_from_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[B, H/N, L, D] -> [B, H, L/N, D] (the inverse of ``heads_from_sequence``)."""
        return _Swap.apply(t, self, False)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's ``t`` (each rank's share, zero elsewhere); backward gives N x the gradient (see the
        module docstring)."""
        return _GroupSum.apply(t, self)


def _a2a(t: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    t = t.contiguous()
    out = torch.empty_like(t)  # contiguous too (empty_like keeps the strides of a permuted input)
    dist.all_to_all_single(out, t, group=sp.group)
    return out


def _seq_to_heads(t: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    B, H, n, D = t.shape
    N = sp.size
    # chunk j of dim 0 goes to rank j: my positions of head group j; what comes back is chunk i = rank i's positions
    out = _a2a(t.view(B, N, H // N, n, D).transpose(0, 1), sp)  # [N(source rank), B, H/N, n, D]
    return out.permute(1, 2, 0, 3, 4).reshape(B, H // N, N * n, D)


def _heads_to_seq(t: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    B, h, L, D = t.shape
    N = sp.size
    out = _a2a(t.view(B, h, N, L // N, D).permute(2, 0, 1, 3, 4), sp)  # [N(head group), B, h, L/N, D]
    return out.transpose(0, 1).reshape(B, N * h, L // N, D)


class _Swap(torch.autograd.Function):
    """``_seq_to_heads`` (``to_heads``) or ``_heads_to_seq``; the backward is the other one."""

    @staticmethod
    def forward(ctx, t, sp, to_heads: bool):
        ctx.sp, ctx.to_heads = sp, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(t, sp)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.sp), None, None


class _GroupSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, sp):
        ctx.size = sp.size
        out = t.clone()
        dist.all_reduce(out, group=sp.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Ulysses gives each rank whole heads: N must divide the query heads (key/value heads that N does not divide
    are repeated up to the query heads)."""
    if num_heads % size:
        raise ValueError(f"distributed.sequence_parallel={size} must divide the model's {num_heads} attention heads "
                         f"(num_attention_heads); choose a divisor of {num_heads}")


def check_model(model, size: int) -> None:
    """Fail at assembly (before any rollout) when ``model`` cannot run ``size``-way sequence parallel."""
    if size == 1:
        return
    if not getattr(model, "supports_sequence_parallel", False):
        raise ValueError(f"distributed.sequence_parallel={size}: {type(model).__name__} has no sequence-parallel "
                         f"forward (the native DiffusionLM families have one); use distributed.sequence_parallel: 1")
    check_heads(model.arch.num_heads, model.arch.num_kv_heads, size)


_ACTIVE: list = [None]


@contextlib.contextmanager
def sharding_sequences(sp: Optional[SequenceGroup]) -> Iterator[None]:
    """Within this context ``score_targets`` runs policy forwards sequence-parallel over ``sp`` (the trainer's score
    and update phases; never decoding, whose data-dependent loops cannot hold collectives)."""
    previous = _ACTIVE[0]
    _ACTIVE[0] = sp
    try:
        yield
    finally:
        _ACTIVE[0] = previous


def active() -> Optional[SequenceGroup]:
    return _ACTIVE[0]
