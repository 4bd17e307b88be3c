"""wd1: weighted policy optimisation without ratios (Tang et al. 2025; algorithms.md section 9).

Likelihood: d1's one-step mean-field estimate (every completion position masked, real prompt tokens masked with
``p_mask_prompt``, keyed per (iteration, sample) -- ``common.views.one_step_view``), summed over the completion:
``S_i = sum_k m_ik logp_ik``. Only the current policy is scored: no importance ratio, no clipping, no KL.

Loss: with ``A = r - mean`` per group, ``w+ = softmax(A)`` and ``w- = softmax(-A)`` over each group's completions,

    L = sum_groups [ -sum_i w+_i S_i + sum_i w-_i S_i ]  /  #groups

so likely-good completions are pushed up and likely-bad ones down, and a group whose advantages are all equal
contributes exactly zero (w+ = w-). The reference takes the softmax over the per-device batch, which its configs
make equal to one group (per-device batch = G = 6), and averages the per-group losses over gradient-accumulation
steps and devices; here the group is explicit (``batch.group``) and the mean is over all groups of the step, so
micro-batching cannot split a softmax. Defaults follow ``wd1/train.yaml`` and ``run/wll_NP_*.sh`` (mu 12,
p_mask_prompt 0.15). Every family d1 supports: on block-diffusion models ``S_i`` is d1's block estimate (all of x_t
masked, block b conditioned on the clean blocks before it; ``one_step_view``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import StepContext, cost
from .batch import Advantages, LogLik, RLBatch, View
from .common.views import one_step_view
from .grpo import GRPOAlgorithm, GRPOConfig
from .paper import LrDeparture, PaperSettings
from .registry import register_algorithm


@dataclass
class WD1Config(GRPOConfig):
    name: str = "wd1"
    inner_iterations: int = cost(12, "iterations")
    clip_low: float = 0.5  # unused (no ratio); d1's value, whose estimate wd1 scores
    beta: float = 0.0
    p_mask_prompt: float = 0.15
    ref_sync_every: int = 0
    ref_sync_alpha: float = 0.6

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.p_mask_prompt <= 1.0:
            raise ValueError(f"p_mask_prompt must be in [0, 1], got {self.p_mask_prompt}")
        if self.beta != 0.0:
            raise ValueError(f"wd1 has no KL term (the reference trainer applies none); set beta to 0, got {self.beta}")

    def group_need(self) -> tuple[int, str]:
        return 2, "its weights are softmaxes over the prompt's group, constant for a lone completion"


def group_softmax(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``softmax(values)`` taken separately over the members of each group (``values [B]``, fp64 inside)."""
    out = torch.zeros(values.shape, dtype=torch.float64, device=values.device)
    v = values.double()
    for g in torch.unique(groups):
        sel = groups == g
        out[sel] = torch.softmax(v[sel], dim=0)
    return out.float()


@dataclass
class WD1Advantages(Advantages):
    """The group-softmax weights ``w+ = softmax(A)``, ``w- = softmax(-A)`` ``[B]``: they need the whole group, so they
    are fixed with the advantages (full batch) and sliced with the micro-batches."""
    w_pos: torch.Tensor = None
    w_neg: torch.Tensor = None


@register_algorithm
class WD1(GRPOAlgorithm):
    """d1's one-step estimate summed per sequence; ratio-free group-softmax weights w+ = softmax(A), w- = softmax(-A)."""
    name = "wd1"
    paper = PaperSettings(
        lr=3e-6, grad_clip=0.2, temperature=0.9, lora={"r": 128, "alpha": 64},
        published_code=True,
        source="xiaohangt/wd1 wd1/train.yaml (lr, max_grad_norm, use_peft; temperature: d1's config default 0.9); run/wll_NP_sudoku.sh (NUM_ITER=8)",
        per_task={"sudoku": {"algorithm": {"inner_iterations": 8}}})
    departure = LrDeparture(
        1 / 3,
        "at its paper ratio (3x Coupled-GRPO's lr: 3e-4 on the tiny LLaDA with its LoRA; no ratio, clip or "
        "KL) seed 0 gained +7.3 points and seed 1 lost 6.4 (held-out 41.0 -> 34.6 %, its training reward fell "
        "0.43 -> 0.15 in the last step, gradient norm 2.9); at 1e-4 (factor 1/3) seeds 0, 1 and 2 rose to "
        "57.1, 56.4 and 56.4 (200 held-out puzzles, docs/comparison.md).",
        ("lazy-sudoku-llada-sft",), "docs/comparison.md")
    config_class = WD1Config
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal", "encoder_decoder")

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        return [one_step_view(ctx, batch, iteration, self.config.p_mask_prompt)]

    @property
    def needs_old_logp(self) -> bool:
        return False  # no ratio: mu inner iterations only refresh the prompt masks

    @property
    def needs_reference(self) -> bool:
        return False

    def advantages(self, ctx: StepContext, batch: RLBatch) -> WD1Advantages:
        base = super().advantages(ctx, batch)
        adv, groups = base.values, batch.group.to(base.values.device)
        return WD1Advantages(adv, base.active, group_softmax(adv, groups), group_softmax(-adv, groups))

    def normalizers(self, batch: RLBatch) -> dict[str, float]:
        out = super().normalizers(batch)
        active = batch.active.bool()
        out["groups"] = float(torch.unique(batch.group[active.to(batch.group.device)]).numel())
        return out

    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int):
        adv = batch.advantages
        if not isinstance(adv, WD1Advantages):
            raise TypeError("wd1's loss needs its own advantages (WD1Advantages: the group softmax weights)")
        mask = self.loss_mask(batch)
        seq_logp = (current.value * mask).sum(-1)  # S_i
        coef = (adv.w_neg - adv.w_pos).to(seq_logp.device) * batch.active.float().to(seq_logp.device)
        loss = (coef * seq_logp).sum() / max(ctx.norms["groups"], 1.0)
        tok = max(ctx.norms["tokens"], 1.0)
        metrics = {"logp_token_mean": float(seq_logp.detach().sum()) / tok}
        if current.entropy is not None:
            metrics["entropy"] = float((current.entropy * mask).sum()) / tok
        return loss, metrics
