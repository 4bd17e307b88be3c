"""ESPO: ELBO-based sequence-level policy optimisation (Ou et al. 2025, ML-GSAI/ESPO; algorithms.md 8(e), dare_repo.md 4).

Likelihood: a sequence ELBO ``B`` of the completion (positions up to the first EOS; post-EOS positions are always
masked, i.e. marginalised, and never scored). Per MC sample j the number of masked tokens is stratified over the
``num_mc`` samples of a sequence: ``k ~ U{0..L}``, ``x_j = round(k + j (L+1)/n) mod (L+1)``, ``p_j = x_j/(L+1)``; the
main view masks x_j random positions (weight ``1/p_j``) and, with ``antithetic``, a complement view masks exactly
the remaining ``L - x_j`` positions (weight ``1/((L - x_j)/(L+1))``); the two estimates are averaged. So every
completion token is scored once per MC sample. ``B = mean_j`` of those sums (one forward per view).

Loss: sequence-level ratio ``rho = exp((B_theta - B_old)/L)`` with PPO clipping of the whole sequence,
``-min(rho A, clip(rho) A)`` averaged over sequences, plus ``beta`` times a KL estimate on the raw ELBO divided by L
(k2 = ``(B - B_ref)^2 / 2L``, ESPO's choice). Leave-one-out advantages without std (the reference's default).
Noise is keyed by (iteration, uid), so old, reference and current policies score identical masks (the antithetic
/ VRPO principle). Defaults: ESPO ``recipes/train.yaml`` + ``run_*_llada.sh`` (mu 8, num_mc 2, eps 0.2, beta 1e-3).

Block-diffusion models: ``B`` is the block NELBO ``sum_b E_t[(1/t) sum_{masked i in b} log p(y_i | y_t^b, y^{<b}, x)]``
with one t shared by the blocks (SDAR's convention), scored in one forward per view over the ``[x_t ; x_0]`` layout.
The same masks and weights apply unchanged: with ``t ~ U(0,1)`` and tokens masked i.i.d., the number masked is
uniform on {0..L}, the masked set is uniform given its size, and ``E[1/t | x masked] = (L+1)/x`` -- an identity about
the mask set alone, so it holds for the block conditional as for the bidirectional one.

This module also holds the helpers of the sequence-ELBO family (BGPO, EBPO): ``stratified_counts``, ``elbo_view``
(which builds the block-diffusion ``[x_t ; x_0]`` input for block-causal models) and ``two_pass_backward``, an exact
memory-saving gradient: score every view without a graph, differentiate the loss with respect to the per-sequence
ELBO values, then backpropagate one view at a time with that coefficient (the ELBO is linear in the views), so memory
is O(1) in the number of MC samples. It needs a deterministic forward (no dropout), like VRPO's two-pass gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import torch

from ..diffusion.logprob import score_targets
from .base import Batch, LogLik, StepContext, View, register_algorithm
from .grpo import AdvantageMode, GRPOAlgorithm, GRPOConfig, clipped_surrogate, kl_penalty
from .paper import PaperSettings
from .views import layout_kwargs, prompt_completion_view


# ----------------------------------------------------------------------------------------------------------
# Shared helpers of the sequence-ELBO methods (ESPO, BGPO, EBPO)
# ----------------------------------------------------------------------------------------------------------


def stratified_counts(gen: torch.Generator, length: int, n: int, low: int) -> torch.Tensor:
    """``n`` mask counts in ``{low..length}`` spread evenly around the cycle from a uniform start (long ``[n]``).

    ``x_j = low + (k - low + floor(j span / n)) mod span`` with ``k ~ U{low..length}`` and ``span = length + 1 - low``:
    ESPO's counts in {0..L} (``low=0``), LLaDA / BGPO's in {1..L} (``low=1``). Every count is exactly uniform and
    the n counts cover the range evenly (stratified sampling across the MC samples of one sequence). The references
    write ``round(linspace(k, k + (n-1) span/n))``; round-half-to-even makes some offsets depend on the parity of
    k, which biases the marginal (e.g. L = 10, n = 4: the third count is always even), so the offset is floored.
    """
    if length < low:
        return torch.zeros(n, dtype=torch.long)
    span = length + 1 - low
    k = int(torch.randint(low, length + 1, (1,), generator=gen))
    offsets = torch.div(torch.arange(n) * span, n, rounding_mode="floor")
    return (k - low + offsets) % span + low


def random_subset(positions: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` of ``positions`` chosen uniformly without replacement."""
    return positions[torch.randperm(positions.numel(), generator=gen)[:count]]


def stratified_masks(ctx: StepContext, batch: Batch, iteration: int, n: int, low: int):
    """(masked ``[n, B, Lc]`` bool, counts ``[n, B]`` long): MC sample j of row i masks ``counts[j, i]`` random valid
    completion positions, the counts stratified over the n samples (``stratified_counts``; ESPO ``low=0``, BGPO
    ``low=1``), all drawn from ``ctx.generator(iteration, uid, 0)``."""
    valid = batch["completion_mask"].bool().cpu()
    B, Lc = valid.shape
    masked = torch.zeros(n, B, Lc, dtype=torch.bool)
    counts = torch.zeros(n, B, dtype=torch.long)
    for i, uid in enumerate(batch["uid"].tolist()):
        g = ctx.generator(iteration, uid, 0)
        pos = torch.nonzero(valid[i]).flatten()
        counts[:, i] = stratified_counts(g, pos.numel(), n, low=low)
        for j in range(n):
            masked[j, i, random_subset(pos, int(counts[j, i]), g)] = True
    dev = batch["completion_ids"].device
    return masked.to(dev), counts.to(dev)


def elbo_view(ctx: StepContext, batch: Batch, masked: torch.Tensor, weight: torch.Tensor, slot: int,
              info: Optional[dict] = None) -> View:
    """One ELBO forward of an RL batch: completion positions ``masked`` (and every post-EOS position) corrupted (the
    mask token; uniform random tokens for uniform-noise families, keyed by ``(iteration, slot, view)`` of ``info``),
    scored where corrupted and up to the first EOS with per-token ``weight``; ``slot`` is the column of the
    estimator's ``[B, K]`` value this view adds to. Block-causal models get the ``[x_t ; x_0]`` layout, encoder-decoder
    models the ``[prompt ; clean blocks ; canvas]`` one."""
    comp, valid = batch["completion_ids"], batch["completion_mask"].bool()
    targets = masked & valid
    info = dict(info or {})
    key = info.pop("noise_key", (slot,))
    noisy = ctx.corrupt(comp, masked | ~valid, batch["uid"], "elbo", *key)
    info["slot"] = torch.full((comp.shape[0],), slot, dtype=torch.long, device=comp.device)
    # Block diffusion: the [x_t ; x_0] input, so one forward scores every block given its clean prefix.
    return prompt_completion_view(batch["prompt_ids"], batch["prompt_mask"], comp, noisy, targets, weight=weight * targets,
                                  info=info, **layout_kwargs(ctx.adapter))


def view_sequence_logp(ctx: StepContext, model, view: View) -> torch.Tensor:
    """``sum_k weight_k logp_k`` of one view per sequence (``[B]``, fp32)."""
    lp, _ = score_targets(model, view.input_ids, view.targets, view.labels, attention_mask=view.attention_mask,
                          position_ids=view.position_ids, layout=view.layout, chunk_size=ctx.chunk_size)
    return (lp * view.weight).sum(-1)


def sequence_loglik(ctx: StepContext, model, views: list[View], slots: int) -> LogLik:
    """Per-sequence estimates ``[B, slots]``: every view adds its weighted log-prob sum to its slot."""
    total = None
    for v in views:
        s = view_sequence_logp(ctx, model, v)
        contrib = torch.zeros(s.shape[0], slots, dtype=s.dtype, device=s.device)
        contrib = contrib.scatter(1, v.info["slot"].to(s.device)[:, None], s[:, None])
        total = contrib if total is None else total + contrib
    return LogLik(total)


def two_pass_backward(algo, ctx: StepContext, model, batch: Batch, iteration: int, loss_scale: float) -> dict:
    """Exact gradient of ``algo.loss`` with one view's graph alive at a time (see module docstring)."""
    views = batch["views"][iteration]
    with torch.no_grad():
        value = algo.log_likelihood(ctx, model, batch, views).value
    proxy = value.detach().requires_grad_(True)
    loss, metrics = algo.loss(ctx, batch, LogLik(proxy), iteration)
    coef = torch.zeros_like(proxy)
    if loss.requires_grad:
        (grad,) = torch.autograd.grad(loss * loss_scale, proxy, allow_unused=True)
        coef = grad if grad is not None else coef
    for v in views:
        c = coef.gather(1, v.info["slot"].to(coef.device)[:, None]).squeeze(1)
        # Always run the backward, even with c = 0: under FSDP every rank must issue the same collectives.
        (view_sequence_logp(ctx, model, v) * c).sum().backward()
    out = {"loss": float(loss.detach())}
    out.update({k: float(x) for k, x in metrics.items()})
    return out


def completion_lengths(batch: Batch) -> torch.Tensor:
    return batch["completion_mask"].float().sum(-1).clamp_min(1.0)


class SequenceRatioAlgorithm(GRPOAlgorithm):
    """Sequence-level clipped ratio on a length-normalised ELBO, KL on the raw ELBO / L (ESPO, EBPO)."""

    def loss(self, ctx: StepContext, batch: Batch, current: LogLik, iteration: int):
        cfg = self.config
        elbo = current.value[:, 0]
        old, ref = self.old_and_ref(batch, current, iteration)
        old = old[:, 0]
        length = completion_lengths(batch).to(elbo.device)
        active = batch["active"].float().to(elbo.device)
        adv = batch["advantages"].to(elbo.device).float()
        per_seq, ratio, clipped = clipped_surrogate(elbo / length, old / length, adv, cfg.clip_low, cfg.clip_high,
                                                    cfg.dual_clip, cfg.logratio_clamp)
        seqs = max(ctx.norms["seqs"], 1.0)
        metrics = {"ratio_mean": float((ratio.detach() * active).sum()) / seqs,
                   "clip_frac": float((clipped.float() * active).sum()) / seqs,
                   "elbo_per_token": float((elbo.detach() / length * active).sum()) / seqs}
        if ref is not None:
            kl = kl_penalty(elbo, ref[:, 0], cfg.kl_estimator) / length
            per_seq = per_seq + cfg.beta * kl
            metrics["kl"] = float((kl.detach() * active).sum()) / seqs
        return (per_seq * active).sum() / seqs, metrics

    def backward(self, ctx: StepContext, model, batch: Batch, iteration: int, loss_scale: float = 1.0) -> dict:
        if self.config.two_pass_backward:
            return two_pass_backward(self, ctx, model, batch, iteration, loss_scale)
        return super().backward(ctx, model, batch, iteration, loss_scale)

    def log_likelihood(self, ctx: StepContext, model, batch: Batch, views: list[View], *, with_entropy: bool = False) -> LogLik:
        return sequence_loglik(ctx, model, views, 1)


# ----------------------------------------------------------------------------------------------------------
# ESPO
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ESPOConfig(GRPOConfig):
    name: str = "espo"
    inner_iterations: int = 8
    clip_low: float = 0.2
    beta: float = 1e-3
    kl_estimator: Literal["k1", "k2", "k3"] = "k2"
    advantage: AdvantageMode = "loo"
    ref_sync_every: int = 64
    ref_sync_alpha: float = 0.6
    num_mc: int = 2  # MC samples of the sequence ELBO (DARE's unified setting: 16)
    antithetic: bool = True  # the complement pass (ESPO's reduce_var)
    two_pass_backward: bool = True  # memory O(1) in num_mc; needs a deterministic forward (no dropout)

    def __post_init__(self):
        super().__post_init__()
        if self.num_mc < 1:
            raise ValueError(f"num_mc must be >= 1, got {self.num_mc}")


@register_algorithm
class ESPO(SequenceRatioAlgorithm):
    """Sequence ELBO (block NELBO on block models), stratified counts + complement pass; sequence-level ratio exp(dB/L)."""
    name = "espo"
    paper = PaperSettings(
        lr=1e-6, grad_clip=0.2, temperature=1.0, lora={"r": 128, "alpha": 64},
        source="ML-GSAI/ESPO recipes/train.yaml (lr, max_grad_norm, generation_temperature); recipes/run_sudoku_llada.sh (--learning_rate 3e-6, NUM_ITER=8, --beta 1e-2, --max_grad_norm 0.2, --use_peft true)",
        per_task={"sudoku": {"lr": 3e-6, "algorithm": {"inner_iterations": 8, "beta": 1e-2}}})
    config_class = ESPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal", "encoder_decoder")

    @property
    def mc_samples(self) -> int:
        return self.config.num_mc * (2 if self.config.antithetic else 1)

    def corrupt(self, ctx: StepContext, batch: Batch, iteration: int) -> list[View]:
        self.check_model(ctx.adapter)
        cfg = self.config
        n = cfg.num_mc
        main, counts = stratified_masks(ctx, batch, iteration, n, low=0)
        valid = batch["completion_mask"].bool().to(main.device)
        B, Lc = valid.shape
        lengths = valid.sum(-1)
        half = 0.5 if cfg.antithetic else 1.0
        views = []
        for j in range(n):
            # p = x/(L+1) for the main pass, (L - x)/(L+1) for its complement (ESPO's discrete-time weights).
            for masked, count in ((main[j], counts[j]), (valid & ~main[j], lengths - counts[j]))[:2 if cfg.antithetic else 1]:
                p = count.double() / (lengths + 1).double()
                w = (half / n / p.clamp_min(1e-12)).float()[:, None].expand(B, Lc)
                views.append(elbo_view(ctx, batch, masked, w, 0, {"p": p.float(), "noise_key": (iteration, len(views))}))
        return views
