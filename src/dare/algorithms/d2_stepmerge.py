"""d2-StepMerge (Wang et al. 2025, arXiv 2509.21474; kuleshov-group/d2 ``diffu-grpo/diffu_grpo_trainer.py``
``d2StepMergeTrainer``): the trajectory likelihood of a masked-diffusion rollout, with its T denoising steps merged
into N segments.

The exact trajectory likelihood scores every token in the state just before the step that decoded it (one forward
per step). StepMerge cuts the rollout's global step count into N contiguous segments -- segment boundaries at
``int(k T / N)``, k = 1 .. N-1, as the authors' ``generate`` -- and scores every token committed in segment j in the
canvas at the *start* of segment j (their ``trajectory[j]`` snapshot): N forwards, exact at N = T, d1's one-step
estimate at N = 1. Only token values are scored (which positions the sampler unmasked is not). As in d1, each real
prompt token is masked with probability ``p_mask_prompt`` (one draw per inner iteration, shared by its segments and by
the old / reference / current policies), so even N = T is approximate unless ``p_mask_prompt = 0``.

Loss: d1's token-level clipped objective with k3 KL to the reference, ``A = r - mean`` (no std), the token mean over
the completion (up to the first EOS) of the whole step. (The authors spread a rollout's N segments over N
gradient-accumulation micro-steps and multiply each by N, which sums to the same token mean; here each segment is one
forward + backward of the same micro-batch.)

dare runs it on the trajectory-replay machinery (``common/replay.py``): the rollout's ``step_map`` mapped to segments
(``segment_map``), one view per segment. Block-diffusion models (an extension: the authors train LLaDA only) replay
each block's state at the segment start given the *clean* earlier blocks, the block factorisation that their sampler
follows (a block model never conditions a block on a partly decoded earlier one); with segments inside blocks --
every released configuration -- this is the canvas at the segment start.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .base import StepContext, cost
from .batch import RLBatch
from .common.replay import ReplayAlgorithm, ReplayConfig, completion_block_ids
from .common.views import prompt_masks
from .grpo import AdvantageMode
from .paper import GridAdjust, PaperSettings
from .registry import register_algorithm


@dataclass
class D2StepMergeConfig(ReplayConfig):
    name: str = "d2_stepmerge"
    segments: int = 8  # N (gsm8k_d2stepmerge.sh --N 8: one segment per 32-token block of its 128-step rollout)
    # T, the rollout's global step count the segments split; None = the recipe's sampler schedule
    total_steps: Optional[int] = None
    inner_iterations: int = cost(12, "iterations")
    clip_low: float = 0.5
    beta: float = 0.04
    p_mask_prompt: float = 0.15
    advantage: AdvantageMode = "mean"
    ref_sync_every: int = 64
    ref_sync_alpha: float = 0.6

    def __post_init__(self):
        super().__post_init__()
        if self.segments < 1:
            raise ValueError(f"segments must be >= 1, got {self.segments}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1 or null, got {self.total_steps}")
        if not 0.0 <= self.p_mask_prompt <= 1.0:
            raise ValueError(f"p_mask_prompt must be in [0, 1], got {self.p_mask_prompt}")
        if self.shrink != 1:
            raise ValueError("d2_stepmerge groups steps by algorithm.segments; leave shrink at 1")


def segment_map(step_map: torch.Tensor, total_steps: torch.Tensor, segments: int) -> torch.Tensor:
    """``[B, Lc]`` segment of every token: step s (0-based, global over blocks) is in segment
    ``#{k in 1..N-1 : int(k T / N) <= s}`` = ``min(N - 1, ceil((s + 1) N / T) - 1)``; -1 stays -1 (never written).

    ``total_steps [B]`` is each row's T. With N <= T this is the authors' ``segments`` list; N > T leaves some
    segments empty (every step its own segment, the exact likelihood)."""
    T = total_steps.long().to(step_map.device)[:, None].clamp_min(1)
    s = step_map.long()
    seg = (((s + 1) * segments + T - 1) // T - 1).clamp(0, segments - 1)
    return torch.where(s >= 0, seg, torch.full_like(s, -1))


def schedule_steps(ctx: StepContext, batch: RLBatch, total_steps: Optional[int]) -> torch.Tensor:
    """``[B]`` T of every row: ``total_steps``, else the recipe sampler's steps (masked models: the sum over its
    blocks; block models: steps per block x the completion's attention blocks, which depend on the prompt length)."""
    B = batch.size
    dev = batch.completion_ids.device
    if total_steps is not None:
        return torch.full((B,), total_steps, dtype=torch.long, device=dev)
    sampler = ctx.services.rollout_sampler
    if sampler is None:
        raise ValueError("d2_stepmerge splits the rollout's step count T into segments; without the recipe's sampler "
                         "(ctx.services.rollout_sampler) set algorithm.total_steps")
    if ctx.adapter.is_block_causal:
        from ..rollout.block import block_schedule
        blocks = completion_block_ids(batch, ctx.adapter.block_size)
        per_block = int(block_schedule(sampler).numel())
        return (blocks.max(1).values - blocks.min(1).values + 1) * per_block
    from ..rollout.masked import masked_blocks
    return torch.full((B,), sum(b.steps for b in masked_blocks(sampler)), dtype=torch.long, device=dev)


@register_algorithm
class D2StepMerge(ReplayAlgorithm):
    """Trajectory likelihood with the rollout's steps merged into N segments: tokens scored in their segment's start state."""
    name = "d2_stepmerge"
    paper = PaperSettings(
        lr=3e-6, grad_clip=0.2, temperature=0.9, lora={"r": 128, "alpha": 64},
        published_code=True,
        source="kuleshov-group/d2 diffu-grpo/bash_scripts/train.yaml (learning_rate, max_grad_norm, lora_r, lora_alpha), "
               "diffu_grpo_config.py (temperature 0.9); gsm8k_d2stepmerge.sh (N 8, NUM_ITER 12), "
               "countdown_d2stepmerge.sh (N 16, NUM_ITER 8), sudoku_d2stepmerge_N8.sh (N 8, NUM_ITER 8, temperature 0.3), "
               "math500_d2stepmerge.sh (N 16)",
        per_task={"sudoku": {"temperature": 0.3, "algorithm": {"inner_iterations": 8, "segments": 8}},
                  "countdown": {"algorithm": {"inner_iterations": 8, "segments": 16}},
                  "math": {"algorithm": {"segments": 16}}})
    grid = GridAdjust("d2-StepMerge segments N = gen_length / 32: one segment per 32-token block, as the authors' "
                      "GSM8K and MATH scripts (N = steps / steps per block)",
                      per_task={"math": {"segments": 16}, "code": {"segments": 16}, "countdown": {"segments": 8},
                                "sudoku": {"segments": 8}})
    config_class = D2StepMergeConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal")

    @property
    def deterministic_views(self) -> bool:
        # the prompt mask is drawn per inner iteration; without it every iteration replays the same views
        return self.config.p_mask_prompt == 0

    @property
    def mc_samples(self) -> int:
        return self.config.segments

    def replay_steps(self, ctx: StepContext, batch: RLBatch) -> torch.Tensor:
        cfg = self.config
        return segment_map(batch.step_map, schedule_steps(ctx, batch, cfg.total_steps), cfg.segments)

    def replay_prompt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> Optional[torch.Tensor]:
        p = self.config.p_mask_prompt
        if p == 0:
            return None
        # d1's prompt mask, drawn from the same keys as d1's one-step view (N = 1 is exactly d1's estimate)
        masked = prompt_masks(ctx, batch, iteration, p)
        return ctx.corrupt(batch.prompt_ids, masked, batch.uid, iteration, "prompt", valid=batch.prompt_mask)

    def token_weights(self, ctx: StepContext, batch: RLBatch):
        # the token mean over the step's completion tokens (every token is the target of exactly one segment)
        w = self.targets(batch).float() / max(ctx.norms.get("targets", 0.0), 1.0)
        return w, w
