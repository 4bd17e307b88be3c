"""d1 / diffu-GRPO (Zhao et al. 2025; algorithms.md section 2): the reference RL plug-in.

Likelihood: a one-step mean-field estimate. Every completion position is masked; each real prompt token is
masked independently with probability ``p_mask_prompt``; one forward; ``logp_k`` read at every completion
position (no 1/t weight). The prompt mask is drawn from ``ctx.generator(iteration, uid)``, so old, reference and
current policies see the same input at iteration j and different iterations see different prompt masks (d1's
regulariser across ``mu``). Loss: token-level clipped GRPO with KL3 to the reference and ``A = r - mean``.

Block-diffusion models (SDAR, SDAR-MoE, LLaDA2): the same one-step estimate of the block factorisation
``log p(y) = sum_b log p(y^b | y^{<b}, x)`` -- every completion position is masked in x_t and block b is scored given
the *clean* blocks before it, in one forward over the ``[x_t ; x_0]`` layout (algorithms.md 0.4).

Uniform-noise encoder-decoder models (DiffusionGemma): the one-step *fully noised* estimate -- every completion position
replaced by a uniform random token (t = 1), canvas block b scored given the prompt and the clean blocks before it (the
encoder reads them); real prompt tokens are replaced by random tokens with ``p_mask_prompt`` (docs/algorithms/uniform_noise.md). A plain block-causal
input of the all-masked completion would condition every block on masked earlier blocks, a state the block sampler
never visits. The (masked) prompt is the condition of every block, so it fills both halves of the layout.

Defaults follow d1's ``train.yaml`` (mu 12, eps 0.5, beta 0.04, p_mask_prompt 0.15, reference sync every 64 steps
with alpha 0.6). One deliberate difference: the token mean is over the whole step's batch (all micro-batches and
ranks) rather than per micro-batch, so the loss does not depend on how the batch is split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import StepContext, cost
from .batch import RLBatch, View
from .common.views import one_step_view
from .grpo import GRPOAlgorithm, GRPOConfig
from .paper import PaperSettings
from .registry import register_algorithm


@dataclass
class D1Config(GRPOConfig):
    name: str = "d1"
    inner_iterations: int = cost(12, "iterations")
    clip_low: float = 0.5
    beta: float = 0.04
    p_mask_prompt: float = 0.15
    ref_sync_every: int = 64
    ref_sync_alpha: float = 0.6

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.p_mask_prompt <= 1.0:
            raise ValueError(f"p_mask_prompt must be in [0, 1], got {self.p_mask_prompt}")


@register_algorithm
class D1(GRPOAlgorithm):
    """One-step mean-field estimate: the whole completion masked (prompt masked with p), logp per token, no 1/t."""
    name = "d1"
    paper = PaperSettings(
        lr=3e-6, grad_clip=0.2, temperature=0.9, lora={"r": 128, "alpha": 64},
        published_code=True,
        source="dllm-reasoning/d1 diffu-grpo/slurm_scripts/train.yaml (lr, max_grad_norm, use_peft), diffu_grpo_config.py (temperature 0.9); sudoku_base.sbatch (NUM_ITER=8, --temperature 0.3)",
        per_task={"sudoku": {"temperature": 0.3, "algorithm": {"inner_iterations": 8}}})
    config_class = D1Config
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal", "encoder_decoder")

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        return [one_step_view(ctx, batch, iteration, self.config.p_mask_prompt)]
