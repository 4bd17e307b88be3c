"""DiRL / DiPO (Zhu et al. 2025; algorithms.md section 11): TraceRL-style trajectory RL for block diffusion (SDAR).

Likelihood: the block rounds of ``tracerl.py`` (``train/grpo.py: generate_training_samples_for_one``): in round r
every block's r-th denoising step is the target (``p_mask``) and the block's tokens of steps >= it are masked
(``masked_indices``, so ``p_mask`` is a subset of it), scored in one ``[x_t ; x_0]`` forward. DiRL pads short samples
with ``is_real=False`` dummy rounds so that every sample has ``block_size`` rounds; here a batch's views are padded to
its largest round count (and to the largest over data-parallel ranks) with views that have no target, which is the
same thing: dummy rounds contribute exactly 0.

Loss (``SDARForCausalLM.forward(compute_rl_loss=True)``): the token mean over all real targets of the step of
``-min(rho A, clip(rho, 1 - 0.2, 1 + 0.28) A)`` (asymmetric "clip-higher"), log-ratio clamped to +-10, plus
``beta = 0.1`` times the token mean of k3 KL to the *reference* model; A is the group z-score of the rewards
(population std, 0 for constant groups) and groups whose rewards are all equal are dropped (DAPO filter).

Defaults follow ``configs/rl.yaml`` (SDAR-8B-Chat; 128 tasks x 8 responses; temperature 1.0, top_k 50; block 4,
4 denoising steps per block, dynamic threshold 0.9; lr 1e-6; mu 1; shrink 1; post_num 0). Deviations: DiRL's
``shrink != 1`` collapses each whole block into one round; here ``shrink = k`` groups k consecutive steps of a block
(``shrink >= steps per block`` is DiRL's collapse). The optional "cosine" speed reward is a reward function, not part
of the algorithm. Block-diffusion models only, as the reference (its rounds are defined by the block layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from .base import StepContext
from .batch import RLBatch
from .common.replay import ReplayAlgorithm, ReplayConfig
from .grpo import AdvantageMode
from .paper import PaperSettings
from .registry import register_algorithm


@dataclass
class DiRLConfig(ReplayConfig):
    name: str = "dirl"
    clip_low: float = 0.2
    clip_high: Optional[float] = 0.28
    logratio_clamp: Optional[float] = 10.0
    beta: float = 0.1
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_target: Literal["reference", "old"] = "reference"
    advantage: AdvantageMode = "mean_std"
    filter_zero_variance: bool = True


@register_algorithm
class DiRL(ReplayAlgorithm):
    """TraceRL's block rounds in one [x_t ; x_0] forward each; clip-higher, KL3 to the reference, DAPO filter."""
    name = "dirl"
    paper = PaperSettings(
        lr=1e-6, grad_clip=1.0, temperature=1.0,
        published_code=True,
        source="OpenMOSS/DiRL configs/rl.yaml (learning_rate, max_grad_norm, temperature); no Sudoku script")
    config_class = DiRLConfig
    supports: ClassVar[tuple[str, ...]] = ("block_causal",)

    def token_weights(self, ctx: StepContext, batch: RLBatch):
        w = self.targets(batch).float() / max(ctx.norms.get("targets", 0.0), 1.0)
        return w, w
