"""Forward corruption (noising) primitives shared by every training method.

All functions are per-sample and take explicit generators (see ``noise.py``), so a sample's corrupted input
depends only on its own key, never on batching. The masks they return are bool tensors (True = replaced by the
mask token); callers build model inputs with ``apply_mask``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..models import masks as attn_masks


def apply_mask(ids: torch.Tensor, masked: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Replace ``masked`` positions of ``ids`` by the mask token."""
    return torch.where(masked, torch.full_like(ids, mask_token_id), ids)


def bernoulli_mask(length: int, p: float, gen: torch.Generator) -> torch.Tensor:
    """``length`` independent draws, True with probability ``p`` (the MDM forward process at noise level p)."""
    return torch.rand(length, generator=gen) < p


def exact_count_mask(length: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """Exactly ``count`` of ``length`` positions, chosen uniformly (LLaDA's low-variance ``l ~ U{1..L}`` form)."""
    if not 0 <= count <= length:
        raise ValueError(f"cannot mask {count} of {length} positions")
    out = torch.zeros(length, dtype=torch.bool)
    out[torch.randperm(length, generator=gen)[:count]] = True
    return out


def scatter_into(region: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Put ``values`` (one per True of ``region``, in order) into a bool tensor shaped like ``region``."""
    out = torch.zeros_like(region)
    out[region] = values.to(out.device)
    return out


def cart_weights(masked: torch.Tensor, clean: torch.Tensor, geo_p: float = 0.3) -> torch.Tensor:
    """Dream's context-adaptive weights for one document (float [L]).

    ``w_i = 1[i masked] * sum_{j clean} 0.5 * p * (1-p)^max(|i-j|-1, 0)``: a masked token next to many clean
    tokens gets a larger weight. O(L^2) per document, computed in row chunks to bound memory.
    """
    L = masked.shape[0]
    idx = torch.arange(L, dtype=torch.float64)
    clean_f = clean.to(torch.float64)
    out = torch.zeros(L, dtype=torch.float64)
    rows = torch.nonzero(masked).flatten()
    log_q = torch.log(torch.tensor(1.0 - geo_p, dtype=torch.float64))
    for chunk in rows.split(1024):
        dist = (idx[chunk, None] - idx[None, :]).abs()
        kernel = 0.5 * geo_p * torch.exp((dist - 1).clamp_min(0) * log_q)
        out[chunk] = kernel @ clean_f
    return out.float()


def block_diffusion_inputs(noisy: torch.Tensor, clean: torch.Tensor, position_ids: torch.Tensor,
                           valid: Optional[torch.Tensor] = None, packed: bool = True, clean_causal: bool = False,
                           block_size: Optional[int] = None):
    """The one-pass ``[x_t ; x_0]`` input (length 2L) and its attention layout (SDAR / LLaDA2 training; with
    ``clean_causal`` and the layout's own ``block_size``, Nemotron-Labs-Diffusion's ``block_diff``).

    Logits for the noisy tokens are read from the first half. ``packed`` treats every restart of the position
    ids as a new document (no attention across documents).
    """
    doc = attn_masks.doc_ids_from_positions(position_ids) if packed else None
    layout = attn_masks.block_diffusion_layout(position_ids, doc, valid, clean_causal, block_size)
    return torch.cat([noisy, clean], dim=1), layout
