"""A key/value cache with explicit write positions, shared by every diffusion sampler.

Diffusion decoding needs more than an append-only AR cache:

* block-causal models (SDAR, LLaDA2) cache finished blocks exactly: a denoising step attends to
  ``[cache ; current block]`` *without* storing it, and one extra forward stores the finished block;
* Fast-dLLM's prefix cache keeps the keys/values of everything before the current block;
* Fast-dLLM's dual cache keeps the whole sequence and overwrites the current block's slots in place.

All three are one operation: write the new keys/values at ``start`` (default: the current length) into a
preallocated buffer and attend over ``buffer[:max(length, start + q_len)]``. ``store=True`` advances the
length; otherwise the written slots are scratch that the next call overwrites. No per-step concatenation.
"""
from __future__ import annotations

from typing import Optional

import torch


class KVCache:
    def __init__(self, num_layers: int, capacity: Optional[int] = None):
        self.num_layers = num_layers
        self.capacity_hint = capacity
        self.k: list[Optional[torch.Tensor]] = [None] * num_layers
        self.v: list[Optional[torch.Tensor]] = [None] * num_layers
        self.length = 0
        # Per-forward settings, set by the model around each call.
        self.start: Optional[int] = None
        self.store = False

    def begin(self, q_len: int, start: Optional[int], store: bool) -> None:
        start = self.length if start is None else start
        if start > self.length:
            raise ValueError(f"KV write start {start} is past the cached length {self.length}")
        self.start, self.store, self._q_len = start, store, q_len

    def end(self) -> None:
        if self.store:
            self.length = max(self.length, self.start + self._q_len)
        self.start, self.store = None, False

    def _ensure(self, i: int, like: torch.Tensor, needed: int) -> None:
        buf = self.k[i]
        if buf is not None and buf.shape[2] >= needed and buf.shape[0] == like.shape[0]:
            return
        cap = max(needed, self.capacity_hint or 0, 2 * (buf.shape[2] if buf is not None else 0))
        shape = (like.shape[0], like.shape[1], cap, like.shape[3])
        k = like.new_empty(shape)
        v = like.new_empty(shape)
        if buf is not None:
            k[:, :, : self.length] = buf[:, :, : self.length]
            v[:, :, : self.length] = self.v[i][:, :, : self.length]
        self.k[i], self.v[i] = k, v

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``i``'s new keys/values [B, Hkv, q, D] at ``start``; return the keys/values to attend over."""
        q_len = k.shape[2]
        end = self.start + q_len
        self._ensure(i, k, end)
        self.k[i][:, :, self.start:end] = k
        self.v[i][:, :, self.start:end] = v
        visible = max(self.length, end)
        return self.k[i][:, :, :visible], self.v[i][:, :, :visible]

    def slot_writes(self, batch: int) -> Optional[tuple[list, list, torch.Tensor]]:
        """For the current forward, when it does not store and every layer's buffer is exactly the window it attends
        to (dual cache; prefix cache steps, which feed up to the end): the buffers and the slots the step writes, so
        that a compiled step can write by index. None otherwise."""
        if self.store or self.start is None:
            return None
        end = self.start + self._q_len
        visible = max(self.length, end)
        if any(k is None or k.shape[2] != visible or k.shape[0] != batch for k in self.k):
            return None
        return self.k, self.v, torch.arange(self.start, end, device=self.k[0].device)

    def crop(self, length: int) -> None:
        """Forget everything after ``length`` (prefix cache: keep only the part before the current block)."""
        self.length = min(self.length, length)

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (e.g. rows that have not finished)."""
        for i in range(self.num_layers):
            if self.k[i] is not None:
                self.k[i] = self.k[i].index_select(0, index)
                self.v[i] = self.v[i].index_select(0, index)
