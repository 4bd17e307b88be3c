"""Shared GRPO scaffolding for dLLM RL methods (algorithms.md section 1), implemented once.

``GRPOConfig`` holds every shared option (clip low/high, dual clip, log-ratio clamp, KL k1/k2/k3 with beta and its
target, advantage normalisation, token vs sequence aggregation, inner iterations ``mu``, the DAPO zero-variance
group filter, reference sync); a method's config subclasses it and changes defaults. ``GRPOAlgorithm``
implements the advantage, loss and normaliser hooks on top of the RL batch layout below; a method adds its
corruption (and, if needed, its likelihood estimator or backward).

RL batch fields (built by the trainer from a rollout; B samples, groups of G completions of one prompt):
``uid [B]`` global sample id, ``group [B]`` prompt id, ``prompt_ids [B, P]`` left-padded, ``prompt_mask [B, P]``,
``completion_ids [B, Lc]``, ``completion_mask [B, Lc]`` (positions up to and including the first EOS),
``rewards [B]`` (or ``[B, S]`` per-step rewards), optional ``step_map [B, Lc]`` / ``trajectory``; the loop adds
``advantages``, ``active`` (0 for filtered groups), ``views``, ``old_logp`` and ``ref_logp`` (per iteration).
Groups are kept within a rank (each rank generates all G completions of its prompts), so group statistics
never need communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from .base import Algorithm, AlgorithmConfig, Batch, LogLik, StepContext, View
from .views import prompt_completion_view

AdvantageMode = Literal["mean", "mean_std", "loo", "none"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_sum"]


@dataclass
class GRPOConfig(AlgorithmConfig):
    name: str = "grpo"
    inner_iterations: int = 1  # mu: optimizer updates per rollout batch, each with fresh (stored) noise
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

    def group_need(self) -> tuple[int, str]:
        if self.advantage == "none":
            return 1, ""
        return 2, (f"advantage: {self.advantage} is relative to the prompt's group, so a lone completion gets "
                   f"advantage 0: loss 0, no gradient")


# ----------------------------------------------------------------------------------------------------------
# Shared math (pure functions; tested directly)
# ----------------------------------------------------------------------------------------------------------


def group_mean_std(values: torch.Tensor, groups: torch.Tensor):
    """Per-sample group mean, population std and group size (values ``[B]`` or ``[B, S]``: per column)."""
    v = values.double()
    _, inv = torch.unique(groups.to(v.device), return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    shape = (n_groups,) + tuple(v.shape[1:])
    counts = torch.bincount(inv, minlength=n_groups).double()
    cshape = (-1,) + (1,) * (v.dim() - 1)
    mean = torch.zeros(shape, dtype=v.dtype, device=v.device).index_add_(0, inv, v) / counts.view(cshape)
    dev = (v - mean[inv]) ** 2
    var = torch.zeros(shape, dtype=v.dtype, device=v.device).index_add_(0, inv, dev) / counts.view(cshape)
    return mean[inv], var.sqrt()[inv], counts[inv].view(cshape).expand_as(v)


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, mode: str = "mean", eps: float = 0.0) -> torch.Tensor:
    """Group-relative advantages.

    ``mean``: r - mean (d1, CJ-GRPO, wd1, SPG); ``mean_std``: (r - mean) / (std + eps) with the population std,
    0 where the std is 0 and eps is 0 (TraceRL, DiRL; MDPO per step with eps 1e-4 on ``[B, S]`` rewards);
    ``loo``: leave-one-out ``r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean)`` (Coupled-GRPO); ``none``: r.
    """
    r = rewards.double()
    if mode == "none":
        return r.float()
    mean, std, n = group_mean_std(r, groups)
    centred = r - mean
    if mode == "mean":
        out = centred
    elif mode == "mean_std":
        denom = std + eps
        out = torch.where(denom > 0, centred / denom.clamp_min(1e-300), torch.zeros_like(centred))
    elif mode == "loo":
        out = torch.where(n > 1, centred * n / (n - 1).clamp_min(1), torch.zeros_like(centred))
    else:
        raise ValueError(f"unknown advantage mode {mode!r}; use mean, mean_std, loo or none")
    return out.float()


def zero_variance_groups(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Bool ``[B]``: True where the sample's group has identical rewards (no learning signal; DAPO filter)."""
    r = rewards if rewards.dim() == 1 else rewards.reshape(rewards.shape[0], -1).sum(-1)
    _, std, _ = group_mean_std(r, groups)
    return std == 0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of KL(pi || ref) from samples of pi: k1 = l - r, k2 = (l - r)^2 / 2, k3 = e^(r-l) - (r-l) - 1."""
    delta = ref_logp - logp
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta ** 2
    if estimator == "k3":
        delta = delta.clamp(-20.0, 20.0)  # exp overflow guard; k3 is exact (0 at l = r) inside the clamp
        return torch.exp(delta) - delta - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")


def clip_ratio_loss(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: Optional[float] = None,
                    dual_clip: Optional[float] = None):
    """PPO loss ``-min(rho A, clip(rho, 1 - lo, 1 + hi) A)`` (+ dual clip) for a given ratio. Returns (loss, clipped).

    Takes the ratio itself so that surrogates that are not ``exp(logp - old)`` (BGPO's linear bound) share it."""
    hi = clip_low if clip_high is None else clip_high
    adv = advantages if advantages.dim() == ratio.dim() else advantages.view(-1, *([1] * (ratio.dim() - 1)))
    unclipped = ratio * adv
    clipped_term = ratio.clamp(1.0 - clip_low, 1.0 + hi) * adv
    loss = -torch.minimum(unclipped, clipped_term)
    clipped = clipped_term < unclipped
    if dual_clip is not None:
        cap = -dual_clip * adv
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(capped, cap.expand_as(loss), loss)
        clipped = clipped | capped
    return loss, clipped


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: Optional[float] = None, dual_clip: Optional[float] = None,
                      logratio_clamp: Optional[float] = None):
    """PPO token loss with ``rho = exp(logp - old_logp)`` (see ``clip_ratio_loss``). Returns (loss, ratio, clipped)."""
    logratio = logp - old_logp
    if logratio_clamp is not None:
        logratio = logratio.clamp(-logratio_clamp, logratio_clamp)
    ratio = torch.exp(logratio)
    loss, clipped = clip_ratio_loss(ratio, advantages, clip_low, clip_high, dual_clip)
    return loss, ratio, clipped


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norms: dict, length: int) -> torch.Tensor:
    """This micro-batch's share of the global loss (``norms``: global ``tokens`` and ``seqs``)."""
    m = mask.float()
    if mode == "token_mean":
        return (per_token * m).sum() / max(norms["tokens"], 1.0)
    if mode == "token_sum":
        return (per_token * m).sum()
    seq_sum = (per_token * m).sum(-1)
    if mode == "seq_mean_token_mean":
        return (seq_sum / m.sum(-1).clamp_min(1.0)).sum() / max(norms["seqs"], 1.0)
    if mode == "seq_mean_token_sum":
        return seq_sum.sum() / max(norms["seqs"], 1.0)
    if mode == "seq_mean_token_sum_norm":
        return seq_sum.sum() / (max(norms["seqs"], 1.0) * length)
    raise ValueError(f"unknown aggregation {mode!r}")


def aggregation_weights(mask: torch.Tensor, mode: str, norms: dict, length: int,
                        seq_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token weights ``w [B, L]`` with ``aggregate(x, mask, mode, norms, length) == (x * w).sum()``.

    For methods that score a micro-batch's tokens in several forwards and back-propagate each one on its own (the
    loss is linear in the per-token terms once the global counts are fixed). ``seq_counts [B]``: the per-sequence
    token counts of ``seq_mean_token_mean`` when ``mask`` is only part of each sequence's tokens.
    """
    m = mask.float()
    if mode == "token_mean":
        return m / max(norms["tokens"], 1.0)
    if mode == "token_sum":
        return m
    seqs = max(norms["seqs"], 1.0)
    if mode == "seq_mean_token_mean":
        counts = m.sum(-1) if seq_counts is None else seq_counts.float()
        return m / (counts.clamp_min(1.0)[:, None] * seqs)
    if mode == "seq_mean_token_sum":
        return m / seqs
    if mode == "seq_mean_token_sum_norm":
        return m / (seqs * length)
    raise ValueError(f"unknown aggregation {mode!r}")


def rl_view(ctx: StepContext, batch: Batch, completion_input: torch.Tensor, targets: torch.Tensor,
            prompt_input: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None, info=None,
            block_layout: bool = False) -> View:
    """A ``[prompt ; completion]`` view of an RL batch whose slots are the completion positions.

    ``completion_input [B, Lc]`` is the (corrupted) completion, ``targets [B, Lc]`` the scored completion
    positions, ``weight [B, Lc]`` optional per-target coefficients; the prompt is clean unless ``prompt_input``
    gives a corrupted one. See ``views.prompt_completion_view``.
    """
    return prompt_completion_view(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], completion_input,
                                  targets, prompt_input=prompt_input, weight=weight, block_layout=block_layout, info=info)


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

    def loss_mask(self, batch: Batch) -> torch.Tensor:
        return batch["completion_mask"].float() * batch["active"].float()[:, None]

    def normalizers(self, batch: Batch) -> dict[str, float]:
        m = self.loss_mask(batch)
        return {"tokens": float(m.sum()), "seqs": float(batch["active"].float().sum()), "samples": float(batch.size)}

    def advantages(self, ctx: StepContext, batch: Batch) -> torch.Tensor:
        cfg = self.config
        rewards, groups = batch["rewards"], batch["group"]
        adv = group_advantages(rewards, groups, cfg.advantage, cfg.advantage_eps)
        active = torch.ones(batch.size, device=adv.device)
        if cfg.filter_zero_variance:
            active = (~zero_variance_groups(rewards, groups)).float()
        batch["active"] = active.to(adv.device)
        return adv

    def old_and_ref(self, batch: Batch, current: LogLik, iteration: int):
        old = batch["old_logp"][iteration] if self.needs_old_logp else current.value.detach()
        ref = None
        if self.config.beta > 0:
            ref = old if self.config.kl_target == "old" else batch["ref_logp"][iteration]
        return old, ref

    def loss(self, ctx: StepContext, batch: Batch, current: LogLik, iteration: int):
        cfg = self.config
        logp = current.value
        old, ref = self.old_and_ref(batch, current, iteration)
        mask = self.loss_mask(batch)
        per_token, ratio, clipped = clipped_surrogate(logp, old, batch["advantages"].to(logp.device), cfg.clip_low,
                                                      cfg.clip_high, cfg.dual_clip, cfg.logratio_clamp)
        tok = max(ctx.norms["tokens"], 1.0)
        metrics = {
            "clip_frac": float((clipped.float() * mask).sum()) / tok,
            "ratio_mean": float((ratio.detach() * mask).sum()) / tok,
        }
        if ref is not None:
            kl = kl_penalty(logp, ref, cfg.kl_estimator)
            per_token = per_token + cfg.beta * kl
            metrics["kl"] = float((kl.detach() * mask).sum()) / tok
        if current.entropy is not None:
            metrics["entropy"] = float((current.entropy * mask).sum()) / tok
        loss = aggregate(per_token, mask, cfg.aggregation, ctx.norms, batch["completion_ids"].shape[1])
        return loss, metrics
