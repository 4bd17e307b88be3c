"""BGPO -- Boundary-Guided Policy Optimisation (Lin et al. 2025; algorithms.md section 8, dare_repo.md 4).

⚠ The paper's code (THU-KEG/BGPO) was not available; this follows the paper-level spec and DARE's port
(``*_dp_actor_bgpo.py``, ``compute_policy_loss_bgpo``); choices are listed in docs/algorithms/bgpo.md.

Likelihood: ``num_mc`` MC samples of a length-normalised sequence ELBO per completion, noise shared between the
current and old policies (keyed by (iteration, uid)). MC sample j masks ``x_j`` of the L completion tokens (up to
the first EOS; post-EOS positions are always masked, i.e. marginalised), counts stratified over the MC samples
(``k ~ U{1..L}``, LLaDA's estimator); ``l_j = (1/L) sum_masked logp / (x_j/L)`` = the mean log-prob of the masked
tokens. Block-causal models (SDAR, LLaDA2) score the same masks with the ``[x_t ; x_0]`` block-diffusion layout.

Objective: the ELBO ratio ``rho = exp(mean_j Delta_j)``, ``Delta_j = l_j - l_j(old)``, is not linear in the MC
samples, so BGPO optimises a lower bound that is, term by term:

    A >= 0:  A exp(mean Delta) >= A (1 + mean_j Delta_j)       (exp x >= 1 + x)
    A <  0:  A exp(mean Delta) >= A mean_j exp(Delta_j)         (Jensen)

i.e. a per-sample surrogate ratio ``r_j = 1 + Delta_j`` or ``exp(Delta_j)``, PPO-clipped per sample (plus DARE's dual
clip c = 3 for A < 0), averaged over j and over sequences. On-policy (Delta = 0) the bound equals A and its gradient
equals that of ``A rho``. Each summand depends on one MC sample, so ``backward`` runs forward + backward per MC
sample and frees the graph (memory O(1) in ``num_mc``). The linear branch is used as is -- never through
``log(1 + Delta)`` (DARE's form, which is NaN for Delta < -1). Optional KL (``beta``) is applied per MC sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .base import StepContext, cost
from .batch import LogLik, RLBatch, View
from .common.elbo import elbo_view, sequence_loglik, stratified_masks, view_sequence_logp
from .common.scoring import backward_each_view
from .grpo import AdvantageMode, GRPOAlgorithm, GRPOConfig
from .losses import clip_ratio_loss, kl_penalty
from .paper import LrDeparture, PaperSettings
from .registry import register_algorithm

EXP_CLAMP = 20.0  # exp(Delta) guard for the Jensen branch (unselected-branch inf * 0 would be NaN in backward)


@dataclass
class BGPOConfig(GRPOConfig):
    name: str = "bgpo"
    num_mc: int = cost(16, "mc_samples")  # MC samples per sequence (the unified setting of BGPO / DARE recipes)
    clip_low: float = 0.2
    dual_clip: Optional[float] = 3.0
    advantage: AdvantageMode = "mean_std"
    advantage_eps: float = 1e-6
    per_sample_backward: bool = True  # one graph per MC sample; False builds one graph (same gradient)

    def __post_init__(self):
        super().__post_init__()
        if self.num_mc < 1:
            raise ValueError(f"num_mc must be >= 1, got {self.num_mc}")


def bgpo_ratio(delta: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """Per-MC-sample surrogate ratio: ``1 + Delta`` where A >= 0, ``exp(Delta)`` where A < 0 (``delta [B, J]``)."""
    a = adv.view(-1, *([1] * (delta.dim() - 1)))
    return torch.where(a >= 0, 1.0 + delta, torch.exp(delta.clamp(max=EXP_CLAMP)))


def bgpo_bound(delta: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """The unclipped lower bound ``A mean_j r_j`` of ``A exp(mean_j Delta_j)`` per sequence."""
    return adv * bgpo_ratio(delta, adv).mean(-1)


def bgpo_loss(l: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, active: torch.Tensor, *, num_mc: int,
              seqs: float, clip_low: float, clip_high: Optional[float] = None, dual_clip: Optional[float] = None,
              ref: Optional[torch.Tensor] = None, beta: float = 0.0, kl_estimator: str = "k3") -> tuple[torch.Tensor, dict]:
    """The loss share of the MC columns of ``l [B, k]`` (length-normalised ELBO terms; the full loss sums all
    ``num_mc`` columns): the clipped BGPO ratio of each column against ``old [B, k]`` with ``advantages [B]``, plus
    ``beta`` KL to ``ref [B, k]``, mean over the ``active [B]`` sequences (``seqs``, global) and the MC samples."""
    ratio = bgpo_ratio(l - old, advantages)
    terms, clipped = clip_ratio_loss(ratio, advantages, clip_low, clip_high, dual_clip)
    denom = num_mc * max(seqs, 1.0)
    metrics = {"ratio_mean": float((ratio.detach() * active[:, None]).sum()) / denom,
               "clip_frac": float((clipped.float() * active[:, None]).sum()) / denom,
               "elbo_per_token": float((l.detach() * active[:, None]).sum()) / denom}
    if ref is not None:
        kl = kl_penalty(l, ref, kl_estimator)
        terms = terms + beta * kl
        metrics["kl"] = float((kl.detach() * active[:, None]).sum()) / denom
    return (terms * active[:, None]).sum() / denom, metrics


@register_algorithm
class BGPO(GRPOAlgorithm):
    """Per-MC-sample length-normalised ELBO; linear (A >= 0) / Jensen (A < 0) lower bound of the ELBO ratio."""
    name = "bgpo"
    paper = PaperSettings(
        lr=1e-6, grad_clip=1.0, temperature=1.0,
        published_code=False,
        source="no published training code (THU-KEG/BGPO not available): DARE's unified RL settings (scripts/make_paper_recipes.py)")
    departure = LrDeparture(
        0.5,
        "at the unified ratio (Coupled-GRPO's lr, 1e-4 on the tiny LLaDA, full fine-tuning, mu 1, no KL) "
        "seeds 0 and 1 gained (held-out 51.6, 55.1) but seed 2 collapsed: training reward 0.58 by step 13, then "
        "~0.1 after step 22 with gradient norms up to 10, held-out 41.0 -> 4.0 %; at 5e-5 (factor 0.5) "
        "the same seeds stayed stable (max gradient norm 1.5) and reached 56.6, 58.4, 60.1 (200 "
        "held-out puzzles, docs/comparison.md). With no published settings, the unified ratio is DARE's "
        "choice, not the authors'.",
        ("lazy-sudoku-llada-sft",), "docs/comparison.md")
    config_class = BGPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal", "encoder_decoder")

    @property
    def mc_samples(self) -> int:
        return self.config.num_mc

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        n = self.config.num_mc
        masked, counts = stratified_masks(ctx, batch, iteration, n, low=1)
        B, Lc = masked.shape[1:]
        # (1/L) * 1/(x/L) = 1/x: the length-normalised ELBO term is the mean log-prob of the masked tokens.
        return [elbo_view(ctx, batch, masked[j], (1.0 / counts[j].clamp_min(1).float())[:, None].expand(B, Lc), j,
                          {"count": counts[j], "noise_key": (iteration, j)}) for j in range(n)]

    def log_likelihood(self, ctx: StepContext, model, batch: RLBatch, views: list[View], *, with_entropy: bool = False) -> LogLik:
        """Per-MC-sample length-normalised ELBO terms ``[B, num_mc]``."""
        return sequence_loglik(ctx, model, views, self.config.num_mc)

    def _mc_loss(self, ctx: StepContext, batch: RLBatch, l: torch.Tensor, old: torch.Tensor, ref: Optional[torch.Tensor]):
        cfg = self.config
        return bgpo_loss(l, old, batch.advantages.values.to(l.device).float(), batch.active.float().to(l.device),
                         num_mc=cfg.num_mc, seqs=ctx.norms["seqs"], clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                         dual_clip=cfg.dual_clip, ref=ref, beta=cfg.beta, kl_estimator=cfg.kl_estimator)

    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int):
        old, ref = self.old_and_ref(batch, current, iteration)
        return self._mc_loss(ctx, batch, current.value, old, ref)

    def backward(self, ctx: StepContext, model, batch: RLBatch, iteration: int, loss_scale: float = 1.0) -> dict:
        if not self.config.per_sample_backward:
            return super().backward(ctx, model, batch, iteration, loss_scale)
        old_all = batch.old_logp[iteration] if self.needs_old_logp else None
        ref_all = None
        if self.config.beta > 0:
            ref_all = old_all if self.config.kl_target == "old" else batch.ref_logp[iteration]

        def sample_loss(_, v):  # one MC sample's graph at a time
            j = int(v.info["slot"][0])
            l = view_sequence_logp(ctx, model, v)[:, None]
            old = old_all[:, j:j + 1] if old_all is not None else l.detach()
            ref = ref_all[:, j:j + 1] if ref_all is not None else None
            return self._mc_loss(ctx, batch, l, old, ref)
        return backward_each_view(batch.views[iteration], sample_loss, loss_scale, skip_constant=True,
                                  runner=ctx.services.run_unit)
