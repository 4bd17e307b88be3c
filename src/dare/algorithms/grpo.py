"""Shared GRPO scaffolding for dLLM RL methods (algorithms.md section 1), implemented once.

``GRPOConfig`` holds every shared option (clip low/high, dual clip, log-ratio clamp, KL k1/k2/k3 with beta and its
target, advantage normalisation, token vs sequence aggregation, inner iterations ``mu``, the DAPO zero-variance
group filter, reference sync); a method's config subclasses it and changes defaults. ``GRPOAlgorithm``
implements the advantage, loss and normaliser hooks on top of the RL batch layout below; a method adds its
corruption (and, if needed, its likelihood estimator or backward).

The batch is a ``dare.algorithms.batch.RLBatch`` (B samples, groups of G completions of one prompt). Groups are kept
within a rank (each rank generates all G completions of its prompts), so group statistics never need
communication. The math lives in ``dare.algorithms.advantages`` (estimators, aggregation modes) and
``dare.algorithms.losses`` (the token-level loss); the hooks here only gather the batch's tensors for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from .advantages import ADVANTAGE_ESTIMATORS, AGGREGATIONS, AdvantageMode, Aggregation, group_advantages, zero_variance_groups
from .base import Algorithm, AlgorithmConfig, StepContext, cost
from .batch import Advantages, LogLik, RLBatch
from .losses import token_policy_loss


@dataclass
class GRPOConfig(AlgorithmConfig):
    name: str = "grpo"
    inner_iterations: int = cost(1, "iterations")  # mu: optimizer updates per rollout batch, each with fresh (stored) noise
    clip_low: float = 0.2
    clip_high: Optional[float] = None  # None = clip_low (symmetric); DAPO/DiRL "clip-higher" sets it larger
    dual_clip: Optional[float] = None  # c > 1: for A < 0 the loss is capped at -c * A
    logratio_clamp: Optional[float] = None  # clamp log(ratio) before exp (TraceRL/DiRL: 10)
    beta: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_target: Literal["reference", "old"] = "reference"  # TraceRL penalises KL to the rollout policy
    advantage: AdvantageMode = "mean"
    advantage_eps: float = 0.0  # added to the std in mean_std (MDPO: 1e-4); std = 0 gives A = 0 when eps = 0
    aggregation: Aggregation = "token_mean"
    filter_zero_variance: bool = False  # DAPO: groups whose rewards are all equal get weight 0
    ref_sync_every: int = 0  # copy reference: theta_ref <- a * theta + (1 - a) * theta_ref every N steps (0 = never)
    ref_sync_alpha: float = 1.0

    def __post_init__(self):
        if self.inner_iterations < 1:
            raise ValueError(f"inner_iterations must be >= 1, got {self.inner_iterations}")
        if self.clip_low < 0 or (self.clip_high is not None and self.clip_high < 0):
            raise ValueError("clip_low / clip_high must be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if not 0.0 < self.ref_sync_alpha <= 1.0:
            raise ValueError(f"ref_sync_alpha must be in (0, 1], got {self.ref_sync_alpha}")
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"unknown advantage mode {self.advantage!r}; use one of {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; use one of {', '.join(AGGREGATIONS)}")

    def group_need(self) -> tuple[int, str]:
        if self.advantage == "none":
            return 1, ""
        return 2, (f"advantage: {self.advantage} is relative to the prompt's group, so a lone completion gets "
                   f"advantage 0: loss 0, no gradient")


class GRPOAlgorithm(Algorithm):
    """Shared advantage / clipped-loss / KL / aggregation hooks; subclasses provide ``corrupt``."""
    config_class = GRPOConfig
    data_kind = "prompts"
    uses_rollout = True

    @property
    def inner_iterations(self) -> int:
        return self.config.inner_iterations

    @property
    def needs_old_logp(self) -> bool:
        # With mu = 1 the old policy is the current one: old := logp.detach() (ratio 1, gradient A * grad logp).
        return self.config.inner_iterations > 1 or (self.config.beta > 0 and self.config.kl_target == "old")

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0 and self.config.kl_target == "reference"

    @property
    def reference_sync(self) -> tuple[int, float]:
        return self.config.ref_sync_every, self.config.ref_sync_alpha

    def loss_mask(self, batch: RLBatch) -> torch.Tensor:
        return batch.completion_mask.float() * batch.active.float()[:, None]

    def normalizers(self, batch: RLBatch) -> dict[str, float]:
        m = self.loss_mask(batch)
        return {"tokens": float(m.sum()), "seqs": float(batch.active.float().sum()), "samples": float(batch.size)}

    def advantage_rewards(self, ctx: StepContext, batch: RLBatch) -> torch.Tensor:
        """The rewards the advantages are computed from (default: the batch's; TraceRL scores truncated ones as 0)."""
        return batch.rewards

    def advantages(self, ctx: StepContext, batch: RLBatch) -> Advantages:
        cfg = self.config
        rewards, groups = self.advantage_rewards(ctx, batch), batch.group
        adv = group_advantages(rewards, groups, cfg.advantage, cfg.advantage_eps)
        active = torch.ones(batch.size, device=adv.device)
        if cfg.filter_zero_variance:
            active = (~zero_variance_groups(rewards, groups)).float()
        return Advantages(adv, active.to(adv.device))

    def old_and_ref(self, batch: RLBatch, current: LogLik, iteration: int):
        old = batch.old_logp[iteration] if self.needs_old_logp else current.value.detach()
        ref = None
        if self.config.beta > 0:
            ref = old if self.config.kl_target == "old" else batch.ref_logp[iteration]
        return old, ref

    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int):
        cfg = self.config
        logp = current.value
        old, ref = self.old_and_ref(batch, current, iteration)
        return token_policy_loss(
            logp, old, batch.advantages.values.to(logp.device), self.loss_mask(batch), norms=ctx.norms,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, logratio_clamp=cfg.logratio_clamp,
            ref_logp=ref, beta=cfg.beta, kl_estimator=cfg.kl_estimator, aggregation=cfg.aggregation,
            entropy=current.entropy, length=batch.completion_ids.shape[1])
