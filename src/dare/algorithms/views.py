"""Builders for the common ``[prompt ; completion]`` view (RL and preference methods).

Prompts are left-padded, completions right-padded; padding is masked out of attention and positions restart after
left padding, so a sample's log-probs do not depend on how much padding its batch needs. ``block_layout=True``
builds the block-diffusion ``[x_t ; x_0]`` input (for ELBOs on block models: noisy block b sees clean blocks < b);
``canvas_length=C`` the encoder-decoder input ``[prompt ; clean completion ; canvas]`` (DiffusionGemma: the encoder
reads the prompt and the clean blocks, canvas block b sees the prompt and the clean blocks < b).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..models import masks as attn_masks
from ..models.canvas import completion_layout, encoded_completion_len
from .base import View


def layout_kwargs(adapter) -> dict:
    """How the model family's views are laid out (the ``prompt_completion_view`` keywords)."""
    return {"block_layout": adapter.is_block_causal,
            "canvas_length": adapter.block_size if adapter.is_encoder_decoder else None}


def prompt_completion_view(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                           completion_input: torch.Tensor, targets: torch.Tensor, *,
                           completion_valid: Optional[torch.Tensor] = None, prompt_input: Optional[torch.Tensor] = None,
                           weight: Optional[torch.Tensor] = None, block_layout: bool = False,
                           canvas_length: Optional[int] = None, info=None) -> View:
    """One view whose K slots are the completion positions.

    ``completion_input [B, Lc]`` is the (corrupted) completion, ``targets [B, Lc]`` the scored positions,
    ``weight [B, Lc]`` optional per-target coefficients, ``completion_valid`` which completion positions exist
    (None: all; RL completions have a fixed generation length), ``prompt_input`` a corrupted prompt (d1).
    """
    B, P = prompt_ids.shape
    Lc = completion_ids.shape[1]
    dev = completion_ids.device
    cvalid = torch.ones(B, Lc, dtype=torch.bool, device=dev) if completion_valid is None else completion_valid.bool()
    valid = torch.cat([prompt_mask.bool(), cvalid], dim=1)
    noisy = torch.cat([prompt_ids if prompt_input is None else prompt_input, completion_input], dim=1)
    clean = torch.cat([prompt_ids, completion_ids], dim=1)
    full_targets = torch.cat([torch.zeros(B, P, dtype=torch.bool, device=dev), targets.bool() & cvalid], dim=1)
    full_weight = None
    if weight is not None:
        full_weight = torch.cat([torch.zeros(B, P, dtype=weight.dtype, device=dev), weight], dim=1)
    if canvas_length:
        E = encoded_completion_len(Lc, canvas_length)
        layout = completion_layout(prompt_mask, Lc, canvas_length, E, cvalid)
        zeros = torch.zeros(B, P + E, dtype=torch.bool, device=dev)
        ids = torch.cat([prompt_ids if prompt_input is None else prompt_input, completion_ids[:, :E], completion_input], 1)
        full_weight = None if weight is None else torch.cat([zeros.to(weight.dtype), weight], 1)
        index = (P + E + torch.arange(Lc, device=dev)).expand(B, Lc).contiguous()
        return View(ids, torch.cat([zeros, targets.bool() & cvalid], 1), torch.cat([prompt_ids, completion_ids[:, :E], completion_ids], 1),
                    full_weight, layout=layout, score_index=index, info=dict(info or {}))
    index = (P + torch.arange(Lc, device=dev)).expand(B, Lc).contiguous()
    if block_layout:
        pos = attn_masks.positions_from_padding(valid)
        layout = attn_masks.block_diffusion_layout(pos, None, valid)
        return View(torch.cat([noisy, clean], dim=1), full_targets, clean, full_weight, layout=layout,
                    score_index=index, info=dict(info or {}))
    return View(noisy, full_targets, clean, full_weight, attention_mask=valid, score_index=index, info=dict(info or {}))


def with_attention_blocks(view: View, block_size: int) -> View:
    """A ``[x_t ; x_0]`` view whose attention uses ``block_size`` -- the sampler's block length -- instead of the
    model's (a dense mask from the same rule: noisy block b sees itself and the clean blocks before it)."""
    dense = attn_masks.dense_mask(view.layout, view.layout, block_size)
    return View(view.input_ids, view.targets, view.labels, view.weight, attention_mask=dense,
                position_ids=view.layout.pos, score_index=view.score_index, info=view.info)
