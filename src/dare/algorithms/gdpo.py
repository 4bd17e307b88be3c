"""GDPO: Group Diffusion Policy Optimization (Rojas et al., ICLR 2026, arXiv 2510.08554; KevinRojas1499/GDPO).

GRPO for masked diffusion models whose likelihood is a sequence ELBO integrated over the noise level with a fixed
quadrature instead of a random ``t`` ("semi-deterministic Monte Carlo"): the paper finds most of the double-MC
ELBO's variance comes from sampling ``t``.

Likelihood (the authors' ``NumericalIntegrationEstimator``): with Gauss-Legendre nodes ``t_n = (x_n + 1)/2`` and
weights ``w_n/2`` on [0, 1] (they sum to 1),

    B(y) = sum_n w_n (1/t_n) (1/K) sum_k sum_{i in M_nk} log p(y_i | y with M_nk masked, x)

where ``M_nk`` is exactly ``floor(t_n L)`` completion positions chosen uniformly without replacement (not
Bernoulli), drawn afresh per node and MC draw k. One forward per (node, draw): gauss-3, K = 1 is 3 forwards.

Loss: the sequence-level ratio ``exp((B_theta - B_old)/L)`` clipped at 0.5 on both sides, ``-min(rho A, clip A)``
averaged over sequences (``common.elbo.SequenceRatioAlgorithm``), no KL; advantages are rewards minus the group mean
(no std). Defaults: the authors' ``train.yaml`` / ``countdown_base.sbatch`` (gauss-3, mu 12, eps 0.5, beta 0,
G 6, lr 3e-7, LoRA r 128 / alpha 64, max grad norm 0.2).

Where dare departs from the authors' code (docs/algorithms/gdpo.md): L is the completion up to and including its
first EOS (dare's convention; the authors mask and score the whole padded canvas, so their L is the generation
length), and the masks are keyed by (iteration, sample, node, draw), so old and current policies score the same
masks (the authors draw the old and current ELBOs' masks from different seeds; NVIDIA's NeMo-RL port shares them as
we do). On completions without padding both coincide, which the loss-parity case checks.

Block-diffusion models: each node's view is one ``[x_t ; x_0]`` forward of the block NELBO with the node's count of
masked tokens spread over the whole completion (the same estimator of the block ELBO: a uniformly random set of
``floor(t L)`` positions, weight 1/t).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from .base import StepContext, cost
from .batch import RLBatch, View
from .common.elbo import SequenceRatioAlgorithm, elbo_view, random_subset
from .grpo import AdvantageMode, GRPOConfig
from .paper import PaperSettings
from .registry import register_algorithm

Quadrature = Literal["gauss-1", "gauss-2", "gauss-3", "gauss-4", "gauss-5", "simpson"]


def quadrature_rule(name: str) -> tuple[list[float], list[float]]:
    """(nodes t_n in (0, 1], weights summing to 1) of ``name``: Gauss-Legendre of order 1..5 mapped from [-1, 1], or
    the authors' "simpson" (t = 0.1, 0.5, 1 with 1/6, 4/6, 1/6: the left node moved off the 1/t singularity)."""
    if name == "simpson":
        return [0.1, 0.5, 1.0], [1 / 6, 4 / 6, 1 / 6]
    if not name.startswith("gauss-") or not name[6:].isdigit() or not 1 <= int(name[6:]) <= 5:
        raise ValueError(f"unknown quadrature {name!r}; use gauss-1 .. gauss-5 or simpson")
    x, w = _legendre(int(name[6:]))
    return [(xi + 1) / 2 for xi in x], [wi / 2 for wi in w]


def _legendre(n: int) -> tuple[list[float], list[float]]:
    """Gauss-Legendre nodes and weights on [-1, 1] (Newton on P_n from the Chebyshev guesses; exact to ~1e-15)."""
    nodes, weights = [], []
    for i in range(n):
        x = math.cos(math.pi * (i + 0.75) / (n + 0.5))
        for _ in range(100):
            p0, p1 = 1.0, x
            for k in range(2, n + 1):
                p0, p1 = p1, ((2 * k - 1) * x * p1 - (k - 1) * p0) / k
            dp = n * (x * p1 - p0) / (x * x - 1) if n > 1 else 1.0
            step = p1 / dp
            x -= step
            if abs(step) < 1e-16:
                break
        p0, p1 = 1.0, x
        for k in range(2, n + 1):
            p0, p1 = p1, ((2 * k - 1) * x * p1 - (k - 1) * p0) / k
        dp = n * (x * p1 - p0) / (x * x - 1) if n > 1 else 1.0
        nodes.append(x)
        weights.append(2 / ((1 - x * x) * dp * dp))
    order = sorted(range(n), key=nodes.__getitem__)
    return [nodes[i] for i in order], [weights[i] for i in order]


def quadrature_masks(ctx, batch, iteration: int, nodes: list[float], draws: int) -> torch.Tensor:
    """``[N * K, B, Lc]`` bool: view ``n * K + k`` masks exactly ``floor(t_n L_i)`` of row i's ``L_i`` valid completion
    positions, uniformly without replacement, from ``ctx.generator(iteration, uid, n, k)``."""
    valid = batch.completion_mask.bool().cpu()
    B, Lc = valid.shape
    masked = torch.zeros(len(nodes) * draws, B, Lc, dtype=torch.bool)
    for i, uid in enumerate(batch.uid.tolist()):
        pos = torch.nonzero(valid[i]).flatten()
        for n, t in enumerate(nodes):
            for k in range(draws):
                # the float product, floored, as the authors' int(t * L): t = 0.5 must give exactly L/2
                count = int(t * pos.numel())
                masked[n * draws + k, i, random_subset(pos, count, ctx.generator(iteration, uid, n, k))] = True
    return masked.to(batch.completion_ids.device)


@dataclass
class GDPOConfig(GRPOConfig):
    name: str = "gdpo"
    inner_iterations: int = cost(12, "iterations")
    clip_low: float = 0.5
    beta: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # sequence-level, on the ELBO / L (only when beta > 0)
    advantage: AdvantageMode = "mean"
    quadrature: Quadrature = "gauss-3"
    mc_per_node: int = 1  # K: mask draws per node (forwards = nodes x K)
    two_pass_backward: bool = True  # memory O(1) in the number of forwards; needs a deterministic forward

    def __post_init__(self):
        super().__post_init__()
        quadrature_rule(self.quadrature)
        if self.mc_per_node < 1:
            raise ValueError(f"mc_per_node must be >= 1, got {self.mc_per_node}")


@register_algorithm
class GDPO(SequenceRatioAlgorithm):
    """Quadrature (semi-deterministic MC) sequence ELBO; sequence-level ratio exp(dB/L) clipped at 0.5; no KL."""
    name = "gdpo"
    paper = PaperSettings(
        lr=3e-7, grad_clip=0.2, temperature=0.9, lora={"r": 128, "alpha": 64}, published_code=True,
        source="KevinRojas1499/GDPO gdpo/train.yaml (learning_rate, max_grad_norm, num_iterations 12, epsilon 0.5, "
               "beta 0, num_generations 6, LoRA r/alpha), gdpo/gdpo_config.py (temperature 0.9), "
               "gdpo/slurm_scripts/countdown_base.sbatch (ESTIMATOR gauss-3)")
    config_class = GDPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal", "encoder_decoder")

    @property
    def mc_samples(self) -> int:
        return len(quadrature_rule(self.config.quadrature)[0]) * self.config.mc_per_node

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        cfg = self.config
        nodes, weights = quadrature_rule(cfg.quadrature)
        K = cfg.mc_per_node
        masks = quadrature_masks(ctx, batch, iteration, nodes, K)
        B, Lc = batch.completion_mask.shape
        views = []
        for n, (t, w) in enumerate(zip(nodes, weights)):
            for k in range(K):
                weight = torch.full((B, Lc), w / t / K, dtype=torch.float32, device=masks.device)
                views.append(elbo_view(ctx, batch, masks[n * K + k], weight, 0,
                                       {"t": torch.full((B,), t), "noise_key": (iteration, len(views))}))
        return views
