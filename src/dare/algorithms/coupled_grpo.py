"""Coupled-GRPO (DiffuCoder, Gong et al. 2025; algorithms.md section 3).

Likelihood: a complementary-mask pair. Per sample and inner iteration draw ``t ~ U[t_min, t_max]`` (0.2, 0.8) and
``R ~ U[0,1]^Lc``; view v1 masks the completion positions with ``R < t``, view v2 the others (``R >= t``), so every
completion token is masked -- and scored -- in exactly one of the two views ("full coverage"). With the extra
fully-masked view v0 (``full_mask_view``, on in the reference code) the per-token estimate is::

    l_k = 1/2 [ logp_k(v0) + logp_k(v1) / t ]        if k in v1
    l_k = 1/2 [ logp_k(v0) + logp_k(v2) / (1 - t) ]  if k in v2

Without v0 it is ``1/2 logp_k(v_k) / w_k`` (the pair average of the two 1/t-weighted ELBO terms; the coupled term
keeps the weight it has in the reference). Three forwards per iteration (two without v0); the prompt is never
masked. Masks come from ``ctx.generator(iteration, uid)``: old, reference and current policies score identical
inputs, each sample gets its own t (the reference draws one t per call and, in the original DARE port, reseeds a
fixed 42 on every call -- neither is done here; ``t_sharing="group"`` shares t within a GRPO group instead).

Loss: token-level clipped GRPO (eps 0.5 both sides) + beta 0.01 KL3 to the reference, leave-one-out advantages
``A_i = r_i - mean_{j != i} r_j = G/(G-1)(r_i - mean)`` without std scaling, token mean over the whole step.
Defaults follow ``recipes/config_coupled_code.yaml`` (mu 2, reference sync every 64 steps).

Uniform-noise models (DiffusionGemma): the complementary *corruption* sets, with corrupted positions holding uniform
random tokens (the indicator ELBO of docs/algorithms/uniform_noise.md has the same 1/t weights); v0 is the fully-noised
canvas. Block-diffusion models: the pair is the block NELBO's. The complementary masks apply per token within x_t (one t per
sample, shared by the blocks as in SDAR's training) and every view is scored over the ``[x_t ; x_0]`` layout, so a
token of block b is predicted from x_t's block b and the clean blocks before it; v0 is d1's block estimate. Each
token is still scored exactly once between v1 and v2 with its 1/t or 1/(1-t) weight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from .base import StepContext, cost
from .batch import RLBatch, View
from .common.views import completion_view
from .grpo import AdvantageMode, GRPOAlgorithm, GRPOConfig
from .paper import PaperSettings
from .registry import register_algorithm


@dataclass
class CoupledGRPOConfig(GRPOConfig):
    name: str = "coupled_grpo"
    inner_iterations: int = cost(2, "iterations")
    clip_low: float = 0.5
    beta: float = 0.01
    advantage: AdvantageMode = "loo"
    ref_sync_every: int = 64
    ref_sync_alpha: float = 0.6
    t_min: float = 0.2
    t_max: float = 0.8
    full_mask_view: bool = True  # the reference code's extra all-masked view (d1 estimate averaged in)
    # "sample" (default): every sample draws its own t. "group": one t per GRPO group, fresh per step and
    # iteration (the reference draws one t per call); the 1/t weights are then equal within a group, so the
    # zero-sum advantages cancel the weight-scaled "raise every sample's likelihood" direction exactly. Masks stay
    # per sample either way. On the tiny Sudoku model the gradient noise was the same with both (docs/quickstart.md).
    t_sharing: Literal["sample", "group"] = "sample"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.t_min <= self.t_max < 1.0:
            raise ValueError(f"coupled_grpo needs 0 < t_min <= t_max < 1 (both views use 1/t weights), "
                             f"got t_min={self.t_min}, t_max={self.t_max}")


def coupled_masks(ctx: StepContext, batch: RLBatch, iteration: int, t_min: float, t_max: float,
                  t_sharing: str = "sample"):
    """(v1 mask bool ``[B, Lc]``, t ``[B]``): v1 = ``R < t``; its complement is v2. R is keyed per (iteration, uid);
    t per (iteration, uid) or, with ``t_sharing="group"``, per (iteration, group)."""
    comp = batch.completion_ids
    B, Lc = comp.shape
    v1 = torch.zeros(B, Lc, dtype=torch.bool)
    t = torch.zeros(B)
    for i, (uid, group) in enumerate(zip(batch.uid.tolist(), batch.group.tolist())):
        g = ctx.generator(iteration, uid, 0)
        t_gen = ctx.generator(iteration, group, 1) if t_sharing == "group" else g
        t[i] = t_min + (t_max - t_min) * torch.rand((), generator=t_gen, dtype=torch.float64).item()
        v1[i] = torch.rand(Lc, generator=g, dtype=torch.float64) < t[i].item()
    return v1.to(comp.device), t.to(comp.device)


@register_algorithm
class CoupledGRPO(GRPOAlgorithm):
    """Complementary-mask pair (t, 1-t) + all-masked view: every token scored once with its 1/t ELBO weight."""
    name = "coupled_grpo"
    paper = PaperSettings(
        lr=1e-6, grad_clip=0.2, temperature=1.0,
        published_code=True,
        source="apple/ml-diffucoder recipes/config_coupled_code.yaml (learning_rate, max_grad_norm, generation_temperature; num_iterations 2 and beta 0.01 are the config defaults); no Sudoku script")
    config_class = CoupledGRPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal", "encoder_decoder")

    @property
    def mc_samples(self) -> int:
        return 3 if self.config.full_mask_view else 2

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        cfg = self.config
        comp, scored, uid = batch.completion_ids, batch.completion_mask.bool(), batch.uid
        v1, t = coupled_masks(ctx, batch, iteration, cfg.t_min, cfg.t_max, cfg.t_sharing)
        v2 = ~v1
        info = {"t": t, "v1": v1}
        views = []
        if cfg.full_mask_view:
            views.append(completion_view(ctx, batch, ctx.corrupt(comp, torch.ones_like(scored), uid, iteration, "v0"), scored,
                                         weight=torch.full(comp.shape, 0.5, device=comp.device) * scored, info=info))
        for name, masked, w in (("v1", v1, 1.0 / t), ("v2", v2, 1.0 / (1.0 - t))):
            targets = masked & scored
            weight = 0.5 * w[:, None].float() * targets
            views.append(completion_view(ctx, batch, ctx.corrupt(comp, masked, uid, iteration, name), targets, weight=weight,
                                         info=info))
        return views
