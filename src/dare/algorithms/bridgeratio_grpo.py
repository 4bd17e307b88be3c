"""BridgeRatio-GRPO (DARE, yjyddq/DARE commit 6d4791f, July 2026; docs/algorithms/bridgeratio_grpo.md).

The PPO ratio of a diffusion LM is ``p_theta(y|c) / p_old(y|c)``, but only path estimates of the likelihood are
at hand. Coupled-GRPO and d1 estimate each log-likelihood apart and subtract; BridgeRatio estimates the *ratio*
from the K denoising paths both policies score with the same noise::

    log r = logsumexp_k l_theta(tau_k) - logsumexp_k l_old(tau_k)

Paths (DARE's ``_forward_process_coupled_grpo``, Coupled-GRPO's views, ``coupled_grpo.coupled_masks``): per sample
and inner iteration one ``t ~ U[t_min, t_max]`` and a uniform draw per completion token; path 0 masks the whole
completion (weight 1), path 1 the tokens drawn below t (weight 1/t), path 2 the others (weight 1/(1 - t)).
``l(tau_k) = sum of the path's masked log-probs x weight / Lc`` (the ``token`` scale: DARE's score divided by the
padded completion length; ``sequence`` drops the division, ``valid_tokens`` multiplies it by the sample's own
length, as DARE's ``_scale_bridge_path_scores`` does).

Corrections of the log-ratio (``correction``):

* ``delta``: ``+ (CV^2_theta - CV^2_old) / (2K)``, CV^2 the squared coefficient of variation of the path weights
  ``exp(l_k)`` (the first-order bias of a log of a mean), detached by default;
* ``jackknife``: ``K log r - (K - 1) mean_i log r_{-i}`` (leave-one-path-out);
* ``cumulant``: ``mean_w(Delta) + var_w(Delta) / 2`` with ``Delta_k = l_theta(tau_k) - l_old(tau_k)`` and weights
  ``softmax_k l_old(tau_k)`` (the second-order cumulant expansion of ``log E_w exp(Delta)``).

Loss: dual-clip PPO on the sequence ratio (clip 0.2 both sides, c = 3 for A < 0), token mean over the step (every
token of a sample carries its sequence's term), GRPO advantages ``(r - mean) / (std + 1e-6)`` with the unbiased std
(verl's ``compute_grpo_outcome_advantage``). DARE's scripts train it without a KL term and with one update per
rollout batch (``ppo_epochs`` 1, one mini-batch): the ratio is then 1 and the gradient is the path-softmax weighted
``A sum_k softmax_k(l) grad l_k``. Deviation: DARE's paths also score every position whose attention mask is 0 --
the prompt's left padding and the completion after its end -- with the zero logits of unpadded rows (``log V`` each,
divided by its ``p_mask``); dare scores the completion's own tokens only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .base import StepContext, cost
from .batch import LogLik, RLBatch, View
from .common.scoring import score_views
from .common.views import completion_view
from .coupled_grpo import CoupledGRPO, CoupledGRPOConfig, coupled_masks
from .grpo import AdvantageMode
from .losses import clip_ratio_loss
from .paper import PaperSettings
from .registry import register_algorithm

Correction = Literal["none", "delta", "jackknife", "cumulant"]
ScoreScale = Literal["token", "sequence", "valid_tokens"]


@dataclass
class BridgeRatioGRPOConfig(CoupledGRPOConfig):
    name: str = "bridgeratio_grpo"
    inner_iterations: int = cost(1, "iterations")  # DARE: ppo_epochs 1, the whole rollout batch one mini-batch
    clip_low: float = 0.2
    dual_clip: float = 3.0  # verl's clip_ratio_c
    beta: float = 0.0  # DARE: use_kl_loss False
    advantage: AdvantageMode = "mean_std_unbiased"
    advantage_eps: float = 1e-6
    ref_sync_every: int = 0
    correction: Correction = "none"
    detach_correction: bool = True  # the delta term and the cumulant weights carry no gradient
    score_scale: ScoreScale = "token"
    cv_eps: float = 1e-8  # floor of the squared mean in CV^2

    def __post_init__(self):
        super().__post_init__()
        if self.correction not in ("none", "delta", "jackknife", "cumulant"):
            raise ValueError(f"bridgeratio_grpo correction must be none, delta, jackknife or cumulant, "
                             f"got {self.correction!r}")
        if self.score_scale not in ("token", "sequence", "valid_tokens"):
            raise ValueError(f"bridgeratio_grpo score_scale must be token, sequence or valid_tokens, "
                             f"got {self.score_scale!r}")
        if self.beta != 0:
            raise ValueError("bridgeratio_grpo has no KL term (DARE trains it without one): set algorithm.beta=0 "
                             "or use coupled_grpo for a KL-regularised coupled estimator")
        if self.aggregation != "token_mean":
            raise ValueError(f"bridgeratio_grpo's loss is a token mean over the step (verl's token-mean), got "
                             f"aggregation={self.aggregation!r}")
        if self.dual_clip is None:
            raise ValueError("bridgeratio_grpo is a dual-clip PPO (verl's clip_ratio_c): dual_clip must be a number "
                             "> 1 (3.0 in DARE)")
        if not self.full_mask_view:
            raise ValueError("bridgeratio_grpo's paths are the all-masked, t and 1-t views: full_mask_view must be "
                             "true")


def _cv_squared(paths: torch.Tensor, eps: float) -> torch.Tensor:
    """Squared coefficient of variation of the path weights ``exp(paths [B, K])`` (shift-invariant) -> ``[B]``."""
    w = torch.exp(paths - paths.max(dim=1, keepdim=True).values)
    mean = w.mean(1)
    return (w - mean[:, None]).square().mean(1) / mean.square().clamp_min(eps)


def bridge_log_ratio(paths: torch.Tensor, old: torch.Tensor, correction: str = "none", detach_correction: bool = True,
                     eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """(log r ``[B]``, its correction ``[B]``) from the K path scores of the current and old policies ``[B, K]``."""
    K = paths.shape[1]
    plain = torch.logsumexp(paths, 1) - torch.logsumexp(old, 1)
    if correction == "none":
        return plain, torch.zeros_like(plain)
    if correction == "delta":
        term = 0.5 / K * (_cv_squared(paths, eps) - _cv_squared(old, eps))
        term = term.detach() if detach_correction else term
        return plain + term, term
    if correction == "jackknife":
        if K < 2:
            return plain, torch.zeros_like(plain)
        keep = [[j for j in range(K) if j != i] for i in range(K)]
        loo = torch.stack([torch.logsumexp(paths[:, k], 1) - torch.logsumexp(old[:, k], 1) for k in keep], 1)
        value = K * plain - (K - 1) * loo.mean(1)
        return value, value - plain
    if correction == "cumulant":
        delta = paths - old
        w = torch.softmax(old, 1)
        w = w.detach() if detach_correction else w
        mean = (w * delta).sum(1)
        value = mean + 0.5 * (w * (delta - mean[:, None]).square()).sum(1)
        return value, value - plain
    raise ValueError(f"unknown bridge-ratio correction {correction!r}")


@register_algorithm
class BridgeRatioGRPO(CoupledGRPO):
    """PPO ratio from K coupled denoising paths: logsumexp_k l(tau_k) - logsumexp_k l_old(tau_k); dual clip."""
    name = "bridgeratio_grpo"
    paper = PaperSettings(
        lr=5e-7, grad_clip=1.0, temperature=0.6,
        published_code=True,
        source="yjyddq/DARE@6d4791f recipe/llada/run_bridgeratio_grpo_llada_8b_instruct.sh -> "
               "run_coupled_grpo_llada_8b_instruct.sh (lr 5e-7, train_temperature 0.6; Dream's script 0.2, "
               "bridge_ratio_correction none, score scale token, use_kl_loss False); verl/trainer/config/"
               "ppo_trainer.yaml (grad_clip 1.0, clip_ratio 0.2, clip_ratio_c 3.0, ppo_epochs 1, token-mean)")
    config_class = BridgeRatioGRPOConfig

    @property
    def mc_samples(self) -> int:
        return 3

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        """The three paths: all masked (weight 1), ``R < t`` (1/t), ``R >= t`` (1/(1-t)), the prompt clean."""
        cfg = self.config
        comp, scored, uid = batch.completion_ids, batch.completion_mask.bool(), batch.uid
        v1, t = coupled_masks(ctx, batch, iteration, cfg.t_min, cfg.t_max, cfg.t_sharing)
        ones = torch.ones_like(scored)
        views = []
        for name, masked, w in (("v0", ones, torch.ones_like(t)), ("v1", v1, 1.0 / t), ("v2", ~v1, 1.0 / (1.0 - t))):
            targets = masked & scored
            views.append(completion_view(ctx, batch, ctx.corrupt(comp, masked, uid, iteration, name), targets,
                                         weight=w[:, None].float() * targets, info={"t": t, "v1": v1}))
        return views

    def log_likelihood(self, ctx: StepContext, model, batch, views: list[View], *, with_entropy: bool = False) -> LogLik:
        """Path scores ``value [B, K]``: each view's weighted log-probs summed over its targets, on ``score_scale``."""
        cols, ent_total = [], None
        for v, (logp, ent) in zip(views, score_views(model, views, ctx.chunk_size, with_entropy)):
            cols.append((logp * v.weight).sum(1))
            if ent is not None:
                e = (ent * v.targets).sum(1, keepdim=True) / v.targets.sum(1, keepdim=True).clamp_min(1)
                ent_total = e / len(views) if ent_total is None else ent_total + e / len(views)
        paths = torch.stack(cols, 1)
        scale = self.config.score_scale
        if scale == "token":
            paths = paths / batch.completion_ids.shape[1]
        elif scale == "valid_tokens":  # DARE: the token-scale score times the sample's own length
            paths = paths * batch.completion_mask.float().sum(1, keepdim=True).clamp_min(1) / batch.completion_ids.shape[1]
        return LogLik(paths, ent_total)

    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int):
        cfg = self.config
        old, _ = self.old_and_ref(batch, current, iteration)
        log_ratio, correction = bridge_log_ratio(current.value, old.to(current.value.device), cfg.correction,
                                                 cfg.detach_correction, cfg.cv_eps)
        if cfg.logratio_clamp is not None:  # DARE's bridge_ratio_log_clip
            log_ratio = log_ratio.clamp(-cfg.logratio_clamp, cfg.logratio_clamp)
        adv = batch.advantages.values.to(log_ratio.device).float()
        terms, _ = clip_ratio_loss(torch.exp(log_ratio), adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        # token mean over the step: every scored token of sample b carries b's sequence term
        weight = self.loss_mask(batch).sum(1) / max(ctx.norms.get("tokens", 0.0), 1.0)
        loss = (terms * weight).sum()
        with torch.no_grad():
            lr = log_ratio.detach()
            ratio = lr.exp()
            hi = cfg.clip_low if cfg.clip_high is None else cfg.clip_high
            unclipped = -adv * ratio
            ppo = torch.maximum(unclipped, -adv * ratio.clamp(1 - cfg.clip_low, 1 + hi))
            metrics = {"ratio_mean": float((ratio * weight).sum()), "log_ratio_mean": float((lr * weight).sum()),
                       "ppo_kl": float(((torch.exp(-lr) + lr - 1) * weight).sum()),
                       "clip_frac": float(((ppo > unclipped).float() * weight).sum()),
                       "dual_clip_frac": float((((adv < 0) & (ppo > -adv * cfg.dual_clip)).float() * weight).sum()),
                       "correction_mean": float((correction.detach() * weight).sum())}
            if current.entropy is not None:  # mean entropy of the scored tokens, over the paths
                metrics["entropy"] = float((current.entropy.detach().reshape(-1) * weight).sum())
        return loss, metrics
