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

The sequence-ELBO machinery it shares with BGPO and EBPO (stratified counts, ELBO views, the exact two-pass gradient,
the sequence-ratio loss) is in ``common/elbo.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from .base import StepContext, cost
from .batch import RLBatch, View
from .common.elbo import SequenceRatioAlgorithm, elbo_view, stratified_masks
from .grpo import AdvantageMode, GRPOConfig
from .paper import PaperSettings
from .registry import register_algorithm


# ----------------------------------------------------------------------------------------------------------
# ESPO
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ESPOConfig(GRPOConfig):
    name: str = "espo"
    inner_iterations: int = cost(8, "iterations")
    clip_low: float = 0.2
    beta: float = 1e-3
    kl_estimator: Literal["k1", "k2", "k3"] = "k2"
    advantage: AdvantageMode = "loo"
    ref_sync_every: int = 64
    ref_sync_alpha: float = 0.6
    num_mc: int = cost(2, "mc_samples")  # MC samples of the sequence ELBO (DARE's unified setting: 16)
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
        published_code=True,
        source="ML-GSAI/ESPO recipes/train.yaml (lr, max_grad_norm, generation_temperature); recipes/run_sudoku_llada.sh (--learning_rate 3e-6, NUM_ITER=8, --beta 1e-2, --max_grad_norm 0.2, --use_peft true)",
        per_task={"sudoku": {"lr": 3e-6, "algorithm": {"inner_iterations": 8, "beta": 1e-2}}})
    config_class = ESPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal", "encoder_decoder")

    @property
    def mc_samples(self) -> int:
        return self.config.num_mc * (2 if self.config.antithetic else 1)

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        cfg = self.config
        n = cfg.num_mc
        main, counts = stratified_masks(ctx, batch, iteration, n, low=0)
        valid = batch.completion_mask.bool().to(main.device)
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
