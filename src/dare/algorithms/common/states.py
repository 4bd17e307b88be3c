"""The rollout's states from its step map (pure functions): which completion block each decoding step wrote and how
many tokens, the first stop token, how many pre-step states a sampler that stops at its answer records, and the split
of those states over inner iterations (d-OPSD trains on them; docs/algorithms/d_opsd.md)."""
from __future__ import annotations

from typing import Optional

import torch

from .replay import INF_STEP


def step_table(ranks: torch.Tensor, block_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and step rank: ``(block [B, R], count [B, R])`` -- the completion block of the tokens written at the
    step and how many there are (R = the most steps of any row; padded steps: block -1, count 0). ``ranks [B, Lc]``
    is each token's step rank (``INF_STEP``: never written)."""
    B, Lc = ranks.shape
    written = ranks < INF_STEP
    R = int(ranks[written].max()) + 1 if bool(written.any()) else 0
    idx = torch.where(written, ranks, torch.full_like(ranks, R))  # never-written tokens go to a spare column
    pos_block = (torch.arange(Lc, device=ranks.device) // block_length).expand(B, Lc)
    block = torch.full((B, R + 1), Lc, dtype=torch.long, device=ranks.device).scatter_reduce(1, idx, pos_block, "amin")
    count = torch.zeros(B, R + 1, dtype=torch.long, device=ranks.device).scatter_add(1, idx, torch.ones_like(idx))
    block, count = block[:, :R], count[:, :R]
    return torch.where(count > 0, block, torch.full_like(block, -1)), count


def first_stop(ids: torch.Tensor, stop_ids, present: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[...]`` index of the first stop token along the last dimension (its length if none); ``present`` (bool, same
    shape as ``ids``) restricts the search to those positions."""
    stop = torch.isin(ids, torch.as_tensor(list(stop_ids), dtype=ids.dtype, device=ids.device))
    if present is not None:
        stop = stop & present
    L = ids.shape[-1]
    return torch.where(stop.any(-1), stop.float().argmax(-1), torch.full(stop.shape[:-1], L, device=ids.device))


def recorded_states(ranks: torch.Tensor, completion_ids: torch.Tensor, stop_ids, block: torch.Tensor,
                    last_block: int) -> torch.Tensor:
    """``[B]``: how many pre-step states the authors' sampler records: states 0, 1, ... while the state's text before
    its first (written) stop token still holds a mask and its step is not in the last block (``utils.generate``)."""
    B, R = block.shape
    if R == 0:
        return torch.zeros(B, dtype=torch.long, device=ranks.device)
    r = torch.arange(R, device=ranks.device)
    masked = ranks[:, None, :] >= r[None, :, None]  # [B, R, Lc]: masked in the state before step r
    comp = completion_ids[:, None, :].expand_as(masked)
    stop_at = first_stop(comp, stop_ids, present=~masked)  # [B, R]
    Lc = ranks.shape[1]
    before = torch.arange(Lc, device=ranks.device)[None, None] < stop_at[..., None]
    open_ = (masked & before).any(-1)  # no stop yet counts as open (stop_at = Lc)
    record = open_ & (block >= 0) & (block < last_block)
    return record.long().cumprod(1).sum(1)


def chunk_plan(states: torch.Tensor, chunks: int, width: int) -> torch.Tensor:
    """``[B, chunks, width]`` step rank of the state view r of inner iteration j trains (-1: none): row i's first
    ``b_i = (T_i - 1) // chunks`` states per chunk, in order (the last recorded state is only a "student output" in
    the reference and the remainder is never used)."""
    per = ((states - 1).clamp_min(0) // chunks)[:, None, None]
    j = torch.arange(chunks, device=states.device)[None, :, None]
    r = torch.arange(width, device=states.device)[None, None, :]
    return torch.where(r < per, j * per + r, torch.full_like(j * per + r, -1))
