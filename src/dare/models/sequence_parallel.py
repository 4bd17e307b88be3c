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


@dataclass
class ShardedInputs:
    """A forward's inputs made ready for a sequence-parallel group (padded so every part splits evenly), and which
    row of the caller's ``[B, L]`` input each of this rank's hidden rows is (``rows``: -1 for padding)."""
    input_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    layout: object
    rows: torch.Tensor  # [n_local] long

    def local_rows(self, length: int) -> torch.Tensor:
        """[length] long: this rank's hidden row of each input row, -1 where another rank holds it."""
        out = torch.full((length,), -1, dtype=torch.long, device=self.rows.device)
        held = self.rows >= 0
        out[self.rows[held]] = torch.arange(self.rows.numel(), device=self.rows.device)[held]
        return out


def pad_end(t: torch.Tensor, pad: int, value) -> torch.Tensor:
    """``t`` [B, L] with ``pad`` columns of ``value`` appended."""
    return torch.cat([t, t.new_full((t.shape[0], pad), value)], dim=1) if pad else t


def owned_rows(sp: SequenceGroup, padded: int, real: int, offset: int = 0) -> torch.Tensor:
    """The input rows this rank holds of a part of ``padded`` positions (``real`` of them real) that starts at row
    ``offset`` of the caller's input: -1 for the padding."""
    own = sp.local(padded)
    idx = torch.arange(own.start, own.stop)
    return torch.where(idx < real, idx + offset, -1)


def split_sequence(sp: SequenceGroup, input_ids, attention_mask=None, position_ids=None, layout=None) -> ShardedInputs:
    """The native models' split: inputs padded at the end to a multiple of the group size (the padding masked out
    as keys, its rows never read); rank r holds the r-th slice of the positions."""
    L = input_ids.shape[1]
    pad = -L % sp.size
    if pad:
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"sequence parallelism pads the sequence to a multiple of {sp.size}; a 4-D attention_mask "
                             f"cannot be padded (pass a 2-D mask or a layout, or a length divisible by {sp.size})")
        if layout is not None:
            layout = type(layout)(pad_end(layout.doc, pad, -1), pad_end(layout.pos, pad, 0),
                                  pad_end(layout.seg, pad, 1), pad_end(layout.valid, pad, False), layout.block_size)
        else:
            if attention_mask is None:
                attention_mask = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
            attention_mask = pad_end(attention_mask, pad, 0)
            if position_ids is not None:
                position_ids = pad_end(position_ids, pad, 0)
    return ShardedInputs(pad_end(input_ids, pad, 0), attention_mask, position_ids, layout,
                         owned_rows(sp, L + pad, L).to(input_ids.device))


def _a2a(t: torch.Tensor, sp: SequenceGroup, arrange) -> torch.Tensor:
    """``arrange`` (a copy into the caller's layout) of what the group sends back for ``t``. The send buffer is held
    until the copy is made: a real process group may hold it that long anyway (gloo frees it when its worker thread
    retires the work, which races with the caller), so the peak does not depend on that race and ``dare plan``,
    whose fake group frees it at once, plans the same peak (measured: -8 % to -10 % in scoring before)."""
    send = t.contiguous()
    out = torch.empty_like(send)  # contiguous too (empty_like keeps the strides of a permuted input)
    dist.all_to_all_single(out, send, group=sp.group)
    result = arrange(out)
    del send
    return result


def _seq_to_heads(t: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    B, H, n, D = t.shape
    N = sp.size
    # chunk j of dim 0 goes to rank j: my positions of head group j; what comes back is chunk i = rank i's positions
    return _a2a(t.view(B, N, H // N, n, D).transpose(0, 1), sp,  # back: [N(source rank), B, H/N, n, D]
                lambda out: out.permute(1, 2, 0, 3, 4).reshape(B, H // N, N * n, D))


def _heads_to_seq(t: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    B, h, L, D = t.shape
    N = sp.size
    return _a2a(t.view(B, h, N, L // N, D).permute(2, 0, 1, 3, 4), sp,  # back: [N(head group), B, h, L/N, D]
                lambda out: out.transpose(0, 1).reshape(B, N * h, L // N, D))


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


HF_ATTENTION = "dare_ulysses_sdpa"


def hf_attention(module, query, key, value, attention_mask, *, dare_sequence: Optional[SequenceGroup] = None,
                 dare_prefix_keys: int = 0, **kwargs):
    """Ulysses around transformers' own SDPA attention, for models whose layers are transformers' (DiffusionGemma):
    registered in transformers' ``AttentionInterface`` as ``HF_ATTENTION`` and selected while a sequence-parallel
    forward runs a layer (``hf_attention_layers``).

    ``query`` [B, H, n, D] holds this rank's positions; ``key`` / ``value`` [B, Hk, m, D] its keys, which for a
    layer that reads a cache are ``[this rank's cached prefix (dare_prefix_keys) ; its own keys]``: each part is
    swapped separately, so the keys come out in the model's order ``[whole prefix ; whole sequence]`` that the
    (whole-sequence) ``attention_mask`` describes. Returns transformers' ``[B, n, H, D]`` output of this rank's rows.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    sp = dare_sequence
    if sp is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    H, Hk = query.shape[1], key.shape[1]
    if Hk % sp.size:  # key/value heads N does not divide: repeat them up to the query heads
        key, value = (t.repeat_interleave(H // Hk, dim=1) for t in (key, value))

    def swap(t):
        parts = (t[:, :, :dare_prefix_keys], t[:, :, dare_prefix_keys:]) if dare_prefix_keys else (t,)
        return torch.cat([sp.heads_from_sequence(p) for p in parts], dim=2)

    q, k, v = sp.heads_from_sequence(query), swap(key), swap(value)
    # The head ratio after the swap (1 where the key heads were repeated); the rest is what SDPA reads of a module.
    shim = _AttentionShape(q.shape[1] // k.shape[1], getattr(module, "is_causal", False), module.training)
    out, _ = sdpa_attention_forward(shim, q, k, v, attention_mask, **kwargs)  # [B, L, H/N, D]
    return sp.sequence_from_heads(out.transpose(1, 2)).transpose(1, 2).contiguous(), None


@dataclass(frozen=True)
class _AttentionShape:
    num_key_value_groups: int
    is_causal: bool
    training: bool


@contextlib.contextmanager
def hf_attention_layers(configs, sp: Optional[SequenceGroup]) -> Iterator[None]:
    """transformers layers of ``configs`` (their config objects) run ``hf_attention`` within this context when
    ``sp`` is given (a no-op otherwise)."""
    if sp is None:
        yield
        return
    from transformers import AttentionInterface
    if HF_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(HF_ATTENTION, hf_attention)
    before = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = HF_ATTENTION
    try:
        yield
    finally:
        for c, name in zip(configs, before):
            c._attn_implementation = name


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
