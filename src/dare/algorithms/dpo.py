"""DPO and VRPO for diffusion LMs (LLaDA 1.5, Zhu et al. 2025; algorithms.md section 4).

The sequence log-likelihood is replaced by an ELBO estimate with budget ``n`` (``mc_samples``), one mask per
timestep (``n_t = n``, ``n_m = 1``)::

    B(y|x) = 1/n sum_j  w_j sum_{i masked in y_t^(j)} log pi(y_i | y_t^(j), x)      (prompt clean)

with ``estimator: inv_t`` (each response token masked with probability t_j, ``w_j = 1/t_j``) or ``count`` (LLaDA's
low-variance form: exactly ``l_j ~ U{1..L}`` tokens masked, ``w_j = L/l_j``); ``stratified`` spreads the n timesteps
(or counts) over strata. ``antithetic`` scores the policy and the reference on the *same* (t_j, mask_j) (the chosen and
rejected responses each draw their own); off, the reference draws independent noise. The loss is
``-log sigmoid(beta [(B_theta(y_w) - B_ref(y_w)) - (B_theta(y_l) - B_ref(y_l))])``.

``two_pass`` computes VRPO's exact memory-saving gradient: s under no_grad, then each MC view is backpropagated on
its own with coefficient ``-/+ beta sigma(-s) / n`` (one graph alive at a time; needs a deterministic forward).
``dpo`` and ``vrpo`` are the same estimator with different defaults (n = 1 with independent noise, versus n = 8,
antithetic, stratified, two-pass). Block models score the ELBO with the ``[x_t ; x_0]`` layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..diffusion.noise import sample_time, stratified_times
from .base import Algorithm, AlgorithmConfig, StepContext
from .batch import Batch, LogLik, View
from .common.views import layout_kwargs, prompt_completion_view
from .losses import dpo_loss
from .registry import register_algorithm

RESPONSES = ("chosen", "rejected")


@dataclass
class DPOConfig(AlgorithmConfig):
    name: str = "dpo"
    beta: float = 0.1
    mc_samples: int = 1  # n = n_t, with n_m = 1 (one mask per timestep)
    estimator: Literal["inv_t", "count"] = "inv_t"
    stratified: bool = False
    antithetic: bool = False  # share (t, mask) between policy and reference
    two_pass: bool = False  # VRPO's exact memory-saving gradient
    length_normalize: bool = False  # divide each ELBO by the response length (DARE's VRPO)
    eps: float = 1e-3  # t in [eps, 1]

    def __post_init__(self):
        if self.mc_samples < 1:
            raise ValueError(f"mc_samples must be >= 1, got {self.mc_samples}")
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")


@dataclass
class VRPOConfig(DPOConfig):
    name: str = "vrpo"
    mc_samples: int = 8
    stratified: bool = True
    antithetic: bool = True
    two_pass: bool = True


def _mask_draws(gen_t: torch.Generator, gen_for, n_real: int, cfg) -> list[tuple[torch.Tensor, float]]:
    """(mask over the real response tokens, weight) for each of the n MC samples."""
    n = cfg.mc_samples
    out = []
    if cfg.estimator == "inv_t":
        ts = stratified_times(gen_t, n, eps=cfg.eps).tolist() if cfg.stratified else [sample_time(gen_t, eps=cfg.eps) for _ in range(n)]
        for j, t in enumerate(ts):
            out.append((torch.rand(n_real, generator=gen_for(j)) < t, 1.0 / t))
    else:
        L = max(n_real, 1)
        if cfg.stratified:
            k = int(torch.randint(0, L, (1,), generator=gen_t))
            counts = [(k + (j * L) // n) % L + 1 for j in range(n)]  # one count per stratum of {1..L}
        else:
            counts = [int(torch.randint(1, L + 1, (1,), generator=gen_t)) for _ in range(n)]
        for j, c in enumerate(counts):
            m = torch.zeros(n_real, dtype=torch.bool)
            m[torch.randperm(n_real, generator=gen_for(j))[:c]] = True
            out.append((m, L / c))
    return out


@register_algorithm
class DPO(Algorithm):
    """ELBO-based DPO: n-sample ELBO of chosen and rejected responses against the reference (n = 1 by default)."""
    name = "dpo"
    config_class = DPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal", "encoder_decoder")
    data_kind = "preference"

    @property
    def needs_reference(self) -> bool:
        return True

    @property
    def mc_samples(self) -> int:
        return self.config.mc_samples

    def _views(self, ctx: StepContext, batch: Batch, iteration: int, salt: tuple) -> list[View]:
        cfg = self.config
        n = cfg.mc_samples
        views = []
        uids = batch["uid"].tolist()
        for r, name in enumerate(RESPONSES):
            ids, valid = batch[f"{name}_ids"], batch[f"{name}_mask"].bool()
            B, L = ids.shape
            masked = torch.zeros(n, B, L, dtype=torch.bool)
            weight = torch.zeros(n, B, L)
            for b, uid in enumerate(uids):
                real = valid[b].cpu()
                n_real = int(real.sum())
                if n_real == 0:
                    continue
                draws = _mask_draws(ctx.generator(*salt, iteration, uid, r, "t"), lambda j: ctx.generator(*salt, iteration, uid, r, j),
                                    n_real, cfg)
                norm = n * (n_real if cfg.length_normalize else 1)
                for j, (m, w) in enumerate(draws):
                    masked[j, b, real] = m
                    weight[j, b, real] = m.float() * (w / norm)
            for j in range(n):
                mj, wj = masked[j].to(ids.device), weight[j].to(ids.device)
                noisy = ctx.corrupt(ids, mj, batch["uid"], *salt, iteration, r, j, valid=valid)
                view = prompt_completion_view(batch["prompt_ids"], batch["prompt_mask"], ids, noisy, mj, completion_valid=valid,
                                              weight=wj, info={"slot": torch.full((B,), r, dtype=torch.long, device=ids.device)},
                                              **layout_kwargs(ctx.adapter))
                views.append(view)
        return views

    def corrupt(self, ctx: StepContext, batch: Batch, iteration: int) -> list[View]:
        return self._views(ctx, batch, iteration, ())

    def reference_views(self, ctx: StepContext, batch: Batch, iteration: int) -> list[View]:
        # Antithetic: the reference scores exactly the policy's corrupted inputs; otherwise its own noise.
        if self.config.antithetic:
            return batch.views[iteration]
        return self._views(ctx, batch, iteration, ("reference",))

    def view_value(self, ctx: StepContext, model, view: View) -> torch.Tensor:
        """This view's contribution to the ``[B, 2]`` ELBO estimates."""
        value = super().log_likelihood(ctx, model, None, [view]).value.sum(-1)
        return torch.zeros(value.shape[0], 2, dtype=value.dtype, device=value.device).scatter(
            1, view.info["slot"].to(value.device)[:, None], value[:, None])

    def log_likelihood(self, ctx: StepContext, model, batch: Batch, views: list[View], *, with_entropy: bool = False) -> LogLik:
        total = None
        for v in views:
            c = self.view_value(ctx, model, v)
            total = c if total is None else total + c
        return LogLik(total)

    def normalizers(self, batch: Batch) -> dict[str, float]:
        return {"pairs": float(batch["pair_weight"].sum()), "samples": float(batch.size)}

    def margin(self, batch: Batch, policy: torch.Tensor, iteration: int) -> torch.Tensor:
        ref = batch.ref_logp[iteration].to(policy.device)
        return self.config.beta * ((policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1]))

    def loss(self, ctx: StepContext, batch: Batch, current: LogLik, iteration: int):
        s = self.margin(batch, current.value, iteration)
        return dpo_loss(s, batch["pair_weight"].to(s.device).float(), pairs=ctx.norms["pairs"], beta=self.config.beta)

    def backward(self, ctx: StepContext, model, batch: Batch, iteration: int, loss_scale: float = 1.0) -> dict:
        if not self.config.two_pass:
            return super().backward(ctx, model, batch, iteration, loss_scale)
        views = batch.views[iteration]
        with torch.no_grad():  # pass 1: the margin s without any graph
            current = self.log_likelihood(ctx, model, batch, views)
        loss, metrics = self.loss(ctx, batch, current, iteration)
        s = self.margin(batch, current.value, iteration)
        w = batch["pair_weight"].to(s.device).float()
        # dL/dB_w = -beta sigma(-s) w / pairs and dL/dB_l = +beta sigma(-s) w / pairs; the ELBO is linear in the views.
        coef = -self.config.beta * torch.sigmoid(-s) * w / max(ctx.norms["pairs"], 1.0)
        sign = torch.tensor([1.0, -1.0], device=s.device)
        for v in views:  # pass 2: one view's graph at a time (every rank runs the same backwards: FSDP-safe)
            c = coef[:, None] * sign[None, :]
            ((self.view_value(ctx, model, v) * c).sum() * loss_scale).backward()
        out = {"loss": float(loss)}
        out.update({k: float(x) for k, x in metrics.items()})
        return out


@register_algorithm
class VRPO(DPO):
    """DPO with VRPO's ELBO: budget 8, one mask per timestep, stratified, antithetic, exact two-pass gradient."""
    name = "vrpo"
    config_class = VRPOConfig
