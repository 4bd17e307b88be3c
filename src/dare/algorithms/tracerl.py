"""TraceRL (Wang et al. 2025; algorithms.md section 10): trajectory replay with KL to the rollout policy and an
optional value model.

The replay (``common/replay.py``) scores every token in the state just before the step that decoded it.

**TraceRL loss** (clip 0.2, log-ratio clamped to +-10, k3 KL with beta 0.01 to the *rollout (old)* policy,
advantages the group z-score of the rewards with the population std and 0 for constant groups, truncated
responses scored as wrong): each (sample, round) pair is one training row; ``round_mean`` (full attention,
``rl_llada.py``) averages the surrogate over the row's targets and sums its KL over them, ``round_length`` (block
models, ``rl_sdar.py``) divides both by the response length Lc; then the mean over all rows of the step. Defaults
follow ``configs/rl_sdar.yaml`` / ``rl_llada.yaml`` (shrink 1 and 8, post_num 0, lr 1e-6).

**Value model** (``value_model: true``, ``configs/*_with_value.yaml``; ``value.py``): a companion value network
scores every target in its replay state before the update; the advantages become token-wise ``A_j = R_j - V_j``
(step-level GAE, gamma = lambda = 1) and the value model is trained with the clipped value loss in the same
per-view backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import torch

from .base import Companion, StepContext
from .batch import Advantages, RLBatch, concat_rows
from .common.replay import ReplayAlgorithm, ReplayConfig, per_round_counts
from .common.scoring import backward_each_view
from .grpo import AdvantageMode
from .losses import clipped_value_loss
from .paper import GridAdjust, PaperSettings
from .registry import register_algorithm
from .value import ValueModel, trace_returns_advantages, view_values


@dataclass
class OldValues:
    """``batch.frozen`` with the value model: its values ``values [B, Lc]`` of every target before any update, each
    read in the target's own replay view (``score_frozen``)."""
    values: torch.Tensor


@dataclass
class ValueAdvantages(Advantages):
    """Token-wise advantages ``A_j = R_j - V_j`` ``[B, Lc]`` and the returns ``R_j`` the value loss regresses to."""
    returns: Optional[torch.Tensor] = None


@dataclass
class TraceRLConfig(ReplayConfig):
    name: str = "tracerl"
    clip_low: float = 0.2
    logratio_clamp: Optional[float] = 10.0
    beta: float = 0.01
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_target: Literal["reference", "old"] = "old"
    advantage: AdvantageMode = "mean_std"
    truncated_reward: Optional[float] = 0.0  # TraceRL scores truncated responses as wrong
    # round_mean: each (sample, round) row averages its targets (rl_llada.py); round_length: divides by the
    # response length Lc (rl_sdar.py); auto: round_length on block models, round_mean otherwise.
    normalize: Literal["auto", "round_mean", "round_length"] = "auto"
    # The optional diffusion value model (configs/*_with_value.yaml; see value.py): token-wise baselines.
    value_model: bool = False
    value_lr: float = 5e-6  # optimizer.params.value_learning_rate
    value_clip: Optional[float] = 0.2  # training.eps: the value loss is clipped like the policy ratio
    value_gamma: float = 1.0  # training.gam
    value_lambda: float = 1.0  # training.lam

    def __post_init__(self):
        super().__post_init__()
        for key in ("value_gamma", "value_lambda"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"{key} must be in [0, 1], got {getattr(self, key)}")
        if self.value_lr <= 0:
            raise ValueError(f"value_lr must be positive, got {self.value_lr}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"value_clip must be positive or null, got {self.value_clip}")


@register_algorithm
class TraceRL(ReplayAlgorithm):
    """Trajectory replay of the rollout's step map (shrink-grouped steps / block rounds), no 1/t; KL to the rollout."""
    name = "tracerl"
    paper = PaperSettings(
        lr=1e-6, grad_clip=1.0, temperature=1.0,
        published_code=True,
        per_attention={"bidirectional": {"algorithm": {"shrink": 8}}, "block_causal": {"algorithm": {"shrink": 1}}},
        source="Gen-Verse/dLLM-RL configs/rl_sdar.yaml (learning_rate, max_grad_norm, temperature, shrink 1); "
               "configs/rl_llada.yaml (shrink 8); no Sudoku script")
    grid = GridAdjust("TraceRL's trajectory shrinkage: 8 on full attention (rl_llada.yaml), 1 on block models "
                      "(rl_sdar.yaml)", per_kind={"bidirectional": {"shrink": 8}, "block_causal": {"shrink": 1}})
    config_class = TraceRLConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal")

    def token_weights(self, ctx: StepContext, batch: RLBatch):
        tgt = self.targets(batch).float()
        rows = max(ctx.norms.get("rounds", 0.0), 1.0)
        mode = self.config.normalize
        if mode == "auto":
            mode = "round_length" if ctx.adapter.is_block_causal else "round_mean"
        if mode == "round_length":
            w = tgt / (batch.completion_ids.shape[1] * rows)
            return w, w
        return tgt / (per_round_counts(batch.state, tgt).clamp_min(1.0) * rows), tgt / rows

    # --- the optional value model (value.py) ----------------------------------------------------------------
    def companions(self) -> list[Companion]:
        cfg = self.config
        return [Companion("value", ValueModel.from_policy, cfg.value_lr)] if cfg.value_model else []

    def _value_model(self, ctx: StepContext):
        if "value" not in ctx.companions:
            raise ValueError("algorithm.value_model: true needs the trainer's value model (ctx.companions['value'])")
        return ctx.companions["value"]

    @property
    def frozen_models(self) -> tuple[str, ...]:  # the value model's old values, before its update
        return ("value",) if self.config.value_model else ()

    def score_frozen(self, ctx: StepContext, batch: RLBatch, lend, micro_batch_size: int) -> OldValues:
        """Old values ``[B, Lc]``: each target's value in its own replay view, before any update."""
        parts = []
        with lend("value") as vm:
            for mb in batch.split(micro_batch_size):
                values = torch.zeros(mb.completion_ids.shape, device=mb.completion_ids.device)
                for r, view in enumerate(mb.views[0]):
                    own = mb.state.round == r
                    values = torch.where(own, view_values(vm, view).to(values.device), values)
                parts.append(values)
        return OldValues(concat_rows(parts))

    def advantages(self, ctx: StepContext, batch: RLBatch) -> Advantages:
        base = super().advantages(ctx, batch)  # the group z-scored (outcome) rewards
        cfg = self.config
        if not cfg.value_model:
            return base
        plan = batch.state
        steps = torch.where(self.targets(batch, base.active), plan.transition, torch.full_like(plan.transition, -1))
        returns, adv = trace_returns_advantages(base.values, batch.frozen.values, steps, cfg.value_gamma, cfg.value_lambda)
        return ValueAdvantages(adv, base.active, returns)

    def backward(self, ctx: StepContext, model, batch: RLBatch, iteration: int, loss_scale: float = 1.0) -> dict[str, float]:
        out = super().backward(ctx, model, batch, iteration, loss_scale)
        if self.config.value_model:
            out.update(self.value_backward(ctx, batch, loss_scale))
        return out

    def value_loss(self, ctx: StepContext, batch: RLBatch, values: torch.Tensor, select: Optional[torch.Tensor] = None):
        """The value loss share of ``batch`` for current ``values [B, Lc]`` (restricted to ``select``: one view's
        targets): the clipped value loss of every target, weighted like the surrogate."""
        weight, _ = self.token_weights(ctx, batch)
        sel = self.targets(batch) if select is None else self.targets(batch) & select
        old = batch.frozen.values.to(values.device)
        per_tok, clipped = clipped_value_loss(torch.where(sel, values, old), old,
                                              batch.advantages.returns.to(values.device), self.config.value_clip)
        n = max(ctx.norms.get("targets", 0.0), 1.0)
        metrics = {"value_clip_frac": float((clipped & sel).sum()) / n,
                   "value_mean": float((values.detach() * sel).sum()) / n}
        return (per_tok * weight * sel).sum(), metrics

    def value_backward(self, ctx: StepContext, batch: RLBatch, loss_scale: float) -> dict[str, float]:
        """The value model's loss, one forward + backward per replay view (the loss is a sum over tokens)."""
        vm = self._value_model(ctx)

        def view_loss(r, view):
            return self.value_loss(ctx, batch, view_values(vm, view), select=batch.state.round == r)
        return backward_each_view(batch.views[0], view_loss, loss_scale, loss_key="value_loss",
                                  totals={"value_loss": 0.0, "value_clip_frac": 0.0, "value_mean": 0.0},
                                  runner=ctx.services.run_unit)
