"""Views of an RL or preference sample: the ``[prompt ; completion]`` input in the layout its model's attention needs,
and the one-step (mean-field) corruption of d1 that several methods score.

Prompts are left-padded, completions right-padded; padding is masked out of attention and positions restart after
left padding, so a sample's log-probs do not depend on how much padding its batch needs. ``block_layout=True``
builds the block-diffusion ``[x_t ; x_0]`` input (for ELBOs on block models: noisy block b sees clean blocks < b);
``canvas_length=C`` the encoder-decoder input ``[prompt ; clean completion ; canvas]`` (DiffusionGemma: the encoder
reads the prompt and the clean blocks, canvas block b sees the prompt and the clean blocks < b). ``completion_view``
is the one place that picks the layout from the model's attention kind.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...models import masks as attn_masks
from ...models.canvas import completion_layout, encoded_completion_len
from ..batch import View


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


def completion_view(ctx, batch, completion_input: torch.Tensor, targets: torch.Tensor,
                    prompt_input: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
                    info: Optional[dict] = None) -> View:
    """A view of an RL batch's completions ``completion_input [B, Lc]`` (corrupted), scoring ``targets [B, Lc]`` with
    optional ``weight [B, Lc]``, in the layout of the model's attention kind (``ctx.adapter``):

    * masked-diffusion models: one ``[prompt ; x_t]`` input;
    * block-diffusion models: the one-pass ``[prompt ; x_t ; prompt ; y]`` layout, so the scored tokens of noisy block
      b see x_t's block b and the clean blocks before it -- the block NELBO's conditional ``p(. | y_t^b, y^{<b}, x)``;
    * encoder-decoder models: ``[prompt ; clean blocks ; canvas]``, canvas block b seeing the clean blocks < b.

    A perturbed ``prompt_input [B, P]`` is the condition of every block, so on block and encoder-decoder models it
    fills both halves (in the noisy half alone it would reach only the block holding the prompt's tail)."""
    adapter = ctx.adapter
    if adapter.is_encoder_decoder or adapter.is_block_causal:
        prompt = batch.prompt_ids if prompt_input is None else prompt_input
        return prompt_completion_view(prompt, batch.prompt_mask, batch.completion_ids, completion_input, targets,
                                      weight=weight, info=info, **layout_kwargs(adapter))
    return prompt_completion_view(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, completion_input, targets,
                                  prompt_input=prompt_input, weight=weight, info=info)


def prompt_masks(ctx, batch, iteration: int, p: float) -> torch.Tensor:
    """Bool ``[B, P]``: real prompt tokens masked i.i.d. with probability p, keyed per (iteration, sample).

    Draws cover the real (unpadded) tokens only, so a sample's mask does not depend on how much left padding its
    batch needs.
    """
    pmask = batch.prompt_mask.bool().cpu()
    out = torch.zeros_like(pmask)
    for i, uid in enumerate(batch.uid.tolist()):
        n = int(pmask[i].sum())
        if n and p > 0:
            out[i, pmask[i]] = torch.rand(n, generator=ctx.generator(iteration, uid, 0)) < p
    return out.to(batch.prompt_ids.device)


def one_step_view(ctx, batch, iteration: int, p_mask_prompt: float) -> View:
    """d1's one-step (mean-field) estimate: every completion position corrupted (masked, or uniformly re-drawn on
    uniform-noise models: t = 1), each real prompt token with probability ``p_mask_prompt`` (keyed per (iteration,
    sample)), logits only where the loss reads them: completion positions up to the first EOS."""
    uid = batch.uid
    masked_prompt = prompt_masks(ctx, batch, iteration, p_mask_prompt)
    noisy_prompt = ctx.corrupt(batch.prompt_ids, masked_prompt, uid, iteration, "prompt", valid=batch.prompt_mask)
    comp = batch.completion_ids
    all_masked = ctx.corrupt(comp, torch.ones_like(comp, dtype=torch.bool), uid, iteration, "completion")
    return completion_view(ctx, batch, all_masked, batch.completion_mask.bool(), prompt_input=noisy_prompt,
                           info={"prompt_masked": masked_prompt})
