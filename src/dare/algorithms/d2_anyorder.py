"""d2-AnyOrder (Wang et al. 2025, arXiv 2509.21474; kuleshov-group/d2 ``diffu-grpo-ao/diffu_grpo_trainer_ao.py``
``d2AnyOrderTrainer``): the exact likelihood of a sampled decoding trajectory in one forward, for a masked-diffusion
model fine-tuned any-order.

An any-order model (the authors' ``SFT_AO``) predicts a masked position from the prompt and the tokens decoded
before it only -- masks never see each other -- so the rollout decodes with that attention (``rollout.sampler.
any_order: true``, ``dare.diffusion.anyorder``) and every token was drawn from
``pi(y_j | prompt, tokens decoded at earlier steps)``. One forward over ``[prompt ; completion ; Lc [MASK] queries]``
gives all of them: query j sits at token j's position and sees the prompt, the tokens decoded at steps before j's
and itself; the completion tokens attend causally in decoding order. The decoding order comes from the rollout's
``step_map`` (tokens of one step ordered by position), so any number of tokens per step works; the authors' sampler
decodes two per step (``steps = gen_length / 2``), where this is their pair mask. The value is the exact
``log pi(y | order)`` of the token values -- which positions were unmasked is not scored.

Loss: the token-level clipped objective with k3 KL to the reference (as d1), advantages
``(r - mean) / (std + 1e-6)`` with the unbiased std (``torch.std``), the token mean over the completion (up to the
first EOS) of the whole step. The views draw nothing, so old and reference log-probs are scored once per rollout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..diffusion.anyorder import anyorder_inputs
from .base import StepContext, cost
from .batch import RLBatch, View
from .grpo import AdvantageMode, GRPOAlgorithm, GRPOConfig
from .paper import GridAdjust, PaperSettings
from .registry import register_algorithm


@dataclass
class D2AnyOrderConfig(GRPOConfig):
    name: str = "d2_anyorder"
    inner_iterations: int = cost(2, "iterations")
    clip_low: float = 0.5
    beta: float = 0.04
    advantage: AdvantageMode = "mean_std_unbiased"
    advantage_eps: float = 1e-6
    ref_sync_every: int = 64
    ref_sync_alpha: float = 0.6


def anyorder_view(ctx: StepContext, batch: RLBatch) -> View:
    """The one-pass view: ``[prompt ; completion ; Lc queries]`` (plus one unused column on a shifted-logit model,
    whose query j is read at the next column), scoring every written completion token up to the first EOS at its
    query; ``score_index`` maps the queries to the completion's Lc slots."""
    comp, steps = batch.completion_ids, batch.step_map
    B, Lc = comp.shape
    P = batch.prompt_ids.shape[1]
    shift = 1 if ctx.adapter.shift_logits else 0
    cols = torch.arange(Lc, device=comp.device).expand(B, Lc)
    ids, pos, mask = anyorder_inputs(batch.prompt_ids, batch.prompt_mask, comp, steps, cols, steps,
                                     ctx.adapter.mask_token_id, shift, extra=shift)
    start = P + Lc + shift  # the column whose prediction is query 0's
    targets = torch.zeros(ids.shape, dtype=torch.bool, device=comp.device)
    targets[:, start:start + Lc] = batch.completion_mask.bool() & (steps >= 0)
    labels = torch.zeros_like(ids)
    labels[:, start:start + Lc] = comp
    index = (start + cols).contiguous()
    return View(ids, targets, labels, attention_mask=mask, position_ids=pos, score_index=index)


@register_algorithm
class D2AnyOrder(GRPOAlgorithm):
    """Exact trajectory likelihood of an any-order rollout in one forward: each token given the tokens decoded before it."""
    name = "d2_anyorder"
    paper = PaperSettings(
        lr=1e-6, grad_clip=0.2, temperature=0.9, lora={"r": 128, "alpha": 64},
        published_code=True,
        sampler={"any_order": True},
        source="kuleshov-group/d2 diffu-grpo-ao/bash_scripts/anyorder_gsm8k_d2anyorder.sh (learning_rate 1e-6, "
               "NUM_ITER 2, num_generations 8), train.yaml (max_grad_norm, lora_r, lora_alpha), diffu_grpo_config.py "
               "(temperature 0.9); the only released task is GSM8K")
    grid = GridAdjust("d2-AnyOrder scores the any-order sampler's own conditionals: rollout.sampler.any_order "
                      "(masks see only decoded tokens; 2 tokens per step at the unified steps = gen_length / 2, as "
                      "the authors). It needs a checkpoint fine-tuned any-order (the authors': "
                      "GuanghanWang/d2_anyorder_causal_llada_intellectsft_gsm8k); docs/algorithms/d2_anyorder.md",
                      sampler={"any_order": True})
    config_class = D2AnyOrderConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional",)
    undefined: ClassVar[dict[str, str]] = {
        "block_causal": "the any-order form replaces the model's attention by the decoding-order mask (a masked "
                        "position sees only the tokens decoded before it), which a block model's block-causal "
                        "attention and block sampler (the masks of a block see each other) do not have; a block model "
                        "fine-tuned any-order would decode with the masked-diffusion any-order sampler instead",
        "encoder_decoder": "uniform noise has no [MASK] token to hold the queries, and the canvas sampler writes no "
                           "token at a step (every pass re-noises what it does not accept): there is no decoding order "
                           "to condition on"}
    deterministic_views: ClassVar[bool] = True  # one view from the step map: nothing is drawn

    def check_rollout(self, sampler, adapter) -> None:
        if not sampler.any_order:
            raise ValueError("d2_anyorder scores the rollout's own conditionals, which only the any-order sampler "
                             "draws from: set rollout.sampler.any_order: true (docs/algorithms/d2_anyorder.md)")

    def prepare(self, ctx: StepContext, batch: RLBatch):
        if batch.step_map is None or batch.step_map.shape != batch.completion_ids.shape:
            raise ValueError("d2_anyorder reads the decoding order from the rollout's step_map [B, Lc]; the batch has "
                             + ("none" if batch.step_map is None else f"shape {tuple(batch.step_map.shape)}"))
        return None

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        return [anyorder_view(ctx, batch)]
