"""CJ-GRPO: consistency-trajectory GRPO (Yang et al. 2025; algorithms.md section 6).

Likelihood: the rollout's own decoding trajectory, replayed from its ``step_map``. With ``x^(s)`` the state before
step s (tokens written at steps < s revealed) and ``U_s`` the tokens written at step s,
``logp^(s)_k = log pi(x^(s+1)_k | x^(s))`` for k in U_s -- no random masks, no 1/t. Masked models run one forward
per step (``cj_grpo_trainer_eoser_ass.py: reversed_process / _get_per_token_logps``); block models replay every
block's local step j in one ``[x_t ; x_0]`` forward (as DARE's block-parallel replay), which gives the same
conditionals because later blocks are invisible under block-causal attention (see ``common/replay.py``).

Loss: ``L = (1/S) sum_s [ sum_{batch, k in U_s} (clipped surrogate + beta KL3) / |U_s| ]`` -- a token mean per step,
then the mean over the S steps; ``A = r - mean`` (no std). Like the reference, U_s holds *every* token written at
step s, EOS padding after the answer included (``post_tokens: null``). ``|U_s|`` and S are global over the step's
batch (all micro-batches and ranks) rather than per micro-batch, so the loss does not depend on how the batch is
split; the step index s is the rank of the step in its row (identical to the step number when every step writes a
token, as with the ASS schedule).

``shrink`` (DARE's ``step_merge``) merges k consecutive steps into one transition to bound the cost: S/k forwards.
With ``shrink = steps per block`` on a semi-autoregressive rollout every block is one transition.

Decoding (rollout config of the recipe, implemented by ``dare.rollout``): EOSER (``eoser: true``: the confidence of
a predicted EOS is scaled by gamma rising from ``eoser_gamma_min = 0.01`` to 1) and ASS (``schedule: ass``:
floor(log2 L) steps committing 1, 2, 4, ... tokens), temperature 1.0, one block. Defaults follow
``cj-grpo/slurm_scripts/train.yaml`` (all settings as d1: mu 12, eps 0.5, beta 0.04, reference sync every 64 steps
with alpha 0.6). ``p_mask_prompt`` is unused by CJ-GRPO and omitted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .base import StepContext, cost
from .batch import RLBatch
from .common.replay import ReplayAlgorithm, ReplayConfig
from .grpo import AdvantageMode
from .paper import GridAdjust, PaperSettings
from .registry import register_algorithm


@dataclass
class CJGRPOConfig(ReplayConfig):
    name: str = "cj_grpo"
    inner_iterations: int = cost(12, "iterations")
    clip_low: float = 0.5
    beta: float = 0.04
    advantage: AdvantageMode = "mean"
    ref_sync_every: int = 64
    ref_sync_alpha: float = 0.6
    post_tokens: Optional[int] = None  # U_s = every token written at step s (the reference's unmask positions)


def transition_key(j: int) -> str:
    return f"cj_transition_{j}"


@register_algorithm
class CJGRPO(ReplayAlgorithm):
    """Consistency trajectory: logp of each step's newly decoded tokens given the sampler's state before it."""
    name = "cj_grpo"
    paper = PaperSettings(
        lr=3e-6, grad_clip=0.2, temperature=1.0, lora={"r": 128, "alpha": 64},
        published_code=True,
        sampler={"schedule": "ass", "eoser": True},
        source="yjyddq/EOSER-ASS-RL cj-grpo/slurm_scripts/train.yaml (lr, max_grad_norm, temperature, use_peft, lora_r, "
               "lora_alpha); cj-grpo/slurm_scripts/sudoku_run.sh (NUM_ITER=8, --decoding eoser-ass)",
        per_task={"sudoku": {"algorithm": {"inner_iterations": 8}}})
    grid = GridAdjust("CJ-GRPO replays every decoding step; on masked models (256 steps) they are merged to one "
                      "transition per block (DARE's step_merge: #blocks forwards), block models replay every step "
                      "(their blocks replay in parallel: steps-per-block forwards); EOSER/ASS off as in DARE's port "
                      "(the unified decoding)", merge_blocks_on=("bidirectional",),
                      per_kind={"block_causal": {"shrink": 1}})
    config_class = CJGRPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal")

    def normalizers(self, batch: RLBatch) -> dict[str, float]:
        out = super().normalizers(batch)
        tgt = self.targets(batch)
        trans = batch.state.transition
        # One count per transition index, for every index any rank has (the key set must match across ranks).
        n = int(batch.state.transitions)
        counts = torch.bincount(trans[tgt].flatten().cpu(), minlength=n) if n else torch.zeros(0)
        out.update({transition_key(j): float(counts[j]) for j in range(n)})
        return out

    def token_weights(self, ctx: StepContext, batch: RLBatch):
        tgt = self.targets(batch)
        n = int(batch.state.transitions)
        counts = torch.tensor([ctx.norms.get(transition_key(j), 0.0) for j in range(n)], dtype=torch.float32)
        steps = max(int((counts > 0).sum()), 1)  # S: transitions with at least one token in the whole batch
        trans = batch.state.transition.clamp_min(0).cpu()
        per_tok = counts.clamp_min(1.0)[trans] if n else torch.ones(trans.shape)
        w = tgt.float() / (steps * per_tok.to(tgt.device))
        return w, w
