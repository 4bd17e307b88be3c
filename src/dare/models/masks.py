"""Attention masks for diffusion LMs, written once as a predicate over per-token metadata.

Every mask this project needs is one rule over four per-token tensors:

* ``doc``   document id (packed rows hold several documents; no attention across documents),
* ``pos``   position id (RoPE position; block index = pos // block_size, counted from absolute position 0),
* ``seg``   0 for a noisy copy, 1 for a clean copy (the block-diffusion ``[x_t ; x_0]`` training layout), 2 for a
  clean copy that is token-causal (Nemotron-Labs-Diffusion's ``block_diff`` paradigm: its clean half is trained as
  an autoregressive model),
* ``valid`` False for padding keys.

``allowed(q, k)`` is::

    same doc and valid key and (
        (noisy q, noisy k) -> same block                 # BD: a noisy block sees only itself
        (noisy q, clean k) -> block(k) <  block(q)       # OBC: noisy block b sees clean blocks < b
        (clean q, clean k) -> block(k) <= block(q)       # BC: the clean copy is block-causal
        (causal clean q, clean k) -> pos(k) <= pos(q)    # the token-causal clean copy (seg 2)
        (clean q, noisy k) -> never )

With ``block_size=None`` every document is one block, so an all-clean layout gives full bidirectional
attention (LLaDA, Dream), an all-clean layout with a block size gives SDAR/LLaDA2 block-causal attention,
and a ``[noisy ; clean]`` layout gives the block-diffusion training mask. A layout may carry its own block size
(``TokenLayout.block_size``: a bidirectional model trained with blocks, Nemotron's ``block_diff``); the model's
applies otherwise. The same rule becomes a dense bool tensor (SDPA; CPU training) or a FlexAttention ``BlockMask``
(GPU training).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class TokenLayout:
    doc: torch.Tensor  # [B, L] int
    pos: torch.Tensor  # [B, L] long
    seg: torch.Tensor  # [B, L] int (0 noisy, 1 clean, 2 clean and token-causal)
    valid: torch.Tensor  # [B, L] bool
    block_size: Optional[int] = None  # the rule's block size for this layout (None: the model's own)

    @property
    def shape(self):
        return self.pos.shape

    @staticmethod
    def plain(pos: torch.Tensor, valid: Optional[torch.Tensor] = None, doc: Optional[torch.Tensor] = None) -> "TokenLayout":
        """All-clean tokens (inference / MDM training)."""
        return TokenLayout(
            doc=doc if doc is not None else torch.zeros_like(pos),
            pos=pos,
            seg=torch.ones_like(pos),
            valid=valid if valid is not None else torch.ones(pos.shape, dtype=torch.bool, device=pos.device),
        )

    def slice(self, start: int, end: Optional[int] = None) -> "TokenLayout":
        return TokenLayout(self.doc[:, start:end], self.pos[:, start:end], self.seg[:, start:end], self.valid[:, start:end],
                           self.block_size)

    @staticmethod
    def cat(parts: list["TokenLayout"]) -> "TokenLayout":
        """Side by side along the sequence (one row's segments)."""
        return TokenLayout(*(torch.cat([getattr(p, f) for p in parts], dim=1) for f in ("doc", "pos", "seg", "valid")),
                           parts[0].block_size)

    @staticmethod
    def cat_batch(parts: list["TokenLayout"]) -> "TokenLayout":
        """One batch of the rows of ``parts`` (same length)."""
        return TokenLayout(*(torch.cat([getattr(p, f) for p in parts], dim=0) for f in ("doc", "pos", "seg", "valid")),
                           parts[0].block_size)


def allowed(q_doc, q_pos, q_seg, k_doc, k_pos, k_seg, k_valid, block_size: Optional[int]):
    """The mask predicate on broadcastable tensors (also used as a FlexAttention mask_mod body)."""
    same_doc = (q_doc == k_doc) & k_valid
    if block_size is None:
        q_blk = torch.zeros_like(q_pos)
        k_blk = torch.zeros_like(k_pos)
    else:
        q_blk = torch.div(q_pos, block_size, rounding_mode="floor")
        k_blk = torch.div(k_pos, block_size, rounding_mode="floor")
    q_noisy = q_seg == 0
    k_noisy = k_seg == 0
    rule = torch.where(
        q_noisy,
        torch.where(k_noisy, q_blk == k_blk, k_blk < q_blk),
        (~k_noisy) & torch.where(q_seg == 2, k_pos <= q_pos, k_blk <= q_blk),
    )
    return same_doc & rule


def dense_mask(q: TokenLayout, k: TokenLayout, block_size: Optional[int]) -> torch.Tensor:
    """Bool mask [B, 1, Lq, Lk] (True = may attend)."""
    m = allowed(
        q.doc[:, :, None], q.pos[:, :, None], q.seg[:, :, None],
        k.doc[:, None, :], k.pos[:, None, :], k.seg[:, None, :], k.valid[:, None, :],
        block_size,
    )
    return m[:, None]


def flex_block_mask(q: TokenLayout, k: TokenLayout, block_size: Optional[int], device=None):
    """The same rule as a FlexAttention BlockMask (GPU training; forward-only on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, qi, ki):
        return allowed(q.doc[b, qi], q.pos[b, qi], q.seg[b, qi], k.doc[b, ki], k.pos[b, ki], k.seg[b, ki], k.valid[b, ki], block_size)

    B, Lq = q.shape
    Lk = k.shape[1]
    return create_block_mask(mask_mod, B, None, Lq, Lk, device=device or q.pos.device)


def block_diffusion_layout(pos: torch.Tensor, doc: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None,
                           clean_causal: bool = False, block_size: Optional[int] = None) -> TokenLayout:
    """Layout of the one-pass ``[x_t ; x_0]`` input (length 2L): positions repeated, noisy half then clean half
    (``clean_causal``: the clean half token-causal, seg 2; ``block_size``: the layout's own, else the model's)."""
    base = TokenLayout.plain(pos, valid, doc)
    noisy = TokenLayout(base.doc, base.pos, torch.zeros_like(base.seg), base.valid, block_size)
    clean = TokenLayout(base.doc, base.pos, torch.full_like(base.seg, 2) if clean_causal else base.seg, base.valid,
                        block_size)
    return TokenLayout.cat([noisy, clean])


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> additive 0/-inf mask in ``dtype``."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, float("-inf"))


def positions_from_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding (cumsum(mask) - 1, pads at 0), so a padded row equals its unpadded run."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def doc_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids of a packed row whose position ids restart at 0 for every document."""
    starts = (position_ids == 0).long()
    return starts.cumsum(-1)


def cu_seqlens_from_doc_ids(doc: torch.Tensor) -> torch.Tensor:
    """flash-attn varlen ``cu_seqlens`` (int32) of a flattened packed batch."""
    flat = doc.reshape(-1)
    # New sequence wherever the doc id changes (including across rows).
    change = torch.ones_like(flat, dtype=torch.bool)
    change[1:] = flat[1:] != flat[:-1]
    if doc.dim() == 2 and doc.shape[0] > 1:
        change.view(doc.shape)[:, 0] = True
    starts = torch.nonzero(change).flatten()
    return torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)
