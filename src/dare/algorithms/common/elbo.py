"""The sequence-ELBO family's shared machinery (ESPO, BGPO, EBPO): stratified mask counts, ELBO views, per-sequence
estimates, the exact two-pass gradient and the sequence-ratio base class.

``two_pass_backward`` is an exact memory-saving gradient: score every view without a graph, differentiate the loss
with respect to the per-sequence ELBO values, then backpropagate one view at a time with that coefficient (the ELBO
is linear in the views), so memory is O(1) in the number of MC samples. It needs a deterministic forward (no
dropout), like VRPO's two-pass gradient.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..batch import LogLik, View
from ..grpo import GRPOAlgorithm
from ..losses import sequence_ratio_loss
from .scoring import score_view
from .views import layout_kwargs, prompt_completion_view


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


def stratified_masks(ctx, batch, iteration: int, n: int, low: int):
    """(masked ``[n, B, Lc]`` bool, counts ``[n, B]`` long): MC sample j of row i masks ``counts[j, i]`` random valid
    completion positions, the counts stratified over the n samples (``stratified_counts``; ESPO ``low=0``, BGPO
    ``low=1``), all drawn from ``ctx.generator(iteration, uid, 0)``."""
    valid = batch.completion_mask.bool().cpu()
    B, Lc = valid.shape
    masked = torch.zeros(n, B, Lc, dtype=torch.bool)
    counts = torch.zeros(n, B, dtype=torch.long)
    for i, uid in enumerate(batch.uid.tolist()):
        g = ctx.generator(iteration, uid, 0)
        pos = torch.nonzero(valid[i]).flatten()
        counts[:, i] = stratified_counts(g, pos.numel(), n, low=low)
        for j in range(n):
            masked[j, i, random_subset(pos, int(counts[j, i]), g)] = True
    dev = batch.completion_ids.device
    return masked.to(dev), counts.to(dev)


def elbo_view(ctx, batch, masked: torch.Tensor, weight: torch.Tensor, slot: int,
              info: Optional[dict] = None) -> View:
    """One ELBO forward of an RL batch: completion positions ``masked`` (and every post-EOS position) corrupted (the
    mask token; uniform random tokens for uniform-noise families, keyed by ``(iteration, slot, view)`` of ``info``),
    scored where corrupted and up to the first EOS with per-token ``weight``; ``slot`` is the column of the
    estimator's ``[B, K]`` value this view adds to. Block-causal models get the ``[x_t ; x_0]`` layout, encoder-decoder
    models the ``[prompt ; clean blocks ; canvas]`` one."""
    comp, valid = batch.completion_ids, batch.completion_mask.bool()
    targets = masked & valid
    info = dict(info or {})
    key = info.pop("noise_key", (slot,))
    noisy = ctx.corrupt(comp, masked | ~valid, batch.uid, "elbo", *key)
    info["slot"] = torch.full((comp.shape[0],), slot, dtype=torch.long, device=comp.device)
    # Block diffusion: the [x_t ; x_0] input, so one forward scores every block given its clean prefix.
    return prompt_completion_view(batch.prompt_ids, batch.prompt_mask, comp, noisy, targets, weight=weight * targets,
                                  info=info, **layout_kwargs(ctx.adapter))


def view_sequence_logp(ctx, model, view: View) -> torch.Tensor:
    """``sum_k weight_k logp_k`` of one view per sequence (``[B]``, fp32)."""
    lp, _ = score_view(model, view, ctx.chunk_size)
    return (lp * view.weight).sum(-1)


def sequence_loglik(ctx, model, views: list[View], slots: int) -> LogLik:
    """Per-sequence estimates ``[B, slots]``: every view adds its weighted log-prob sum to its slot."""
    total = None
    for v in views:
        s = view_sequence_logp(ctx, model, v)
        contrib = torch.zeros(s.shape[0], slots, dtype=s.dtype, device=s.device)
        contrib = contrib.scatter(1, v.info["slot"].to(s.device)[:, None], s[:, None])
        total = contrib if total is None else total + contrib
    return LogLik(total)


def two_pass_backward(algo, ctx, model, batch, iteration: int, loss_scale: float) -> dict:
    """Exact gradient of ``algo.loss`` with one view's graph alive at a time (see module docstring)."""
    views = batch.views[iteration]
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


def completion_lengths(batch) -> torch.Tensor:
    return batch.completion_mask.float().sum(-1).clamp_min(1.0)


class SequenceRatioAlgorithm(GRPOAlgorithm):
    """Sequence-level clipped ratio on a length-normalised ELBO, KL on the raw ELBO / L (ESPO, EBPO; the math:
    ``losses.sequence_ratio_loss``); a config with ``two_pass_backward`` differentiates one view at a time."""

    def loss(self, ctx, batch, current: LogLik, iteration: int):
        cfg = self.config
        elbo = current.value[:, 0]
        old, ref = self.old_and_ref(batch, current, iteration)
        return sequence_ratio_loss(
            elbo, old[:, 0], batch.advantages.values.to(elbo.device).float(), completion_lengths(batch).to(elbo.device),
            batch.active.float().to(elbo.device), seqs=ctx.norms["seqs"], clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            dual_clip=cfg.dual_clip, logratio_clamp=cfg.logratio_clamp, ref_elbo=None if ref is None else ref[:, 0],
            beta=cfg.beta, kl_estimator=cfg.kl_estimator)

    def backward(self, ctx, model, batch, iteration: int, loss_scale: float = 1.0) -> dict:
        if self.config.two_pass_backward:
            return two_pass_backward(self, ctx, model, batch, iteration, loss_scale)
        return super().backward(ctx, model, batch, iteration, loss_scale)

    def log_likelihood(self, ctx, model, batch, views: list[View], *, with_entropy: bool = False) -> LogLik:
        return sequence_loglik(ctx, model, views, 1)
