"""TraceRL (Wang et al. 2025; algorithms.md section 10) and the trajectory-replay machinery it shares with
CJ-GRPO (``cj_grpo.py``) and DiRL (``dirl.py``).

**Trajectory replay.** The rollout's ``step_map [B, Lc]`` records the denoising step that wrote every completion
token (-1: never written, e.g. blocks skipped after an early stop). Replaying it gives the sampler's own
intermediate states instead of random masks:

* *full attention* (LLaDA, LLaDA-MoE, Dream; TraceRL ``train/rl_llada.py``): the distinct step values of a row
  are grouped ``shrink`` at a time (trajectory shrinkage, ``collapse_k_unique``). One forward per group g: the
  input is the response with every token of group >= g masked (the state before the group's first step), the
  targets are the tokens of group g. With ``shrink = k`` a row needs ``ceil(#unique steps / k)`` forwards.
* *block attention* (SDAR, SDAR-MoE, LLaDA2; ``train/rl_sdar.py``): steps are grouped ``shrink`` at a time inside
  every block, and one forward ("round") handles every block at once: in round r each block's r-th group is the
  target and the block's tokens of group >= r are masked. The input is the one-pass ``[x_t ; x_0]`` layout, so a
  noisy block sees the clean blocks before it and itself -- exactly its state during decoding, because later blocks
  are invisible under block-causal attention. Blocks are the model's attention blocks (``adapter.block_size``):
  the rollout must use ``block_length`` equal to it (the recipes do).

Rounds without any target are dropped; rows with fewer rounds than the batch get padded views without targets
(DiRL's "dummy rounds"), which contribute nothing. Never-written tokens stay masked in every state. Every token is
a target exactly once, so the per-token log-probs of all views add up to one ``[B, Lc]`` estimate (no 1/t weight).
The update runs one forward + backward per view (``backward``), so memory does not grow with the number of rounds;
the gradient equals that of the summed loss because the loss is a sum over tokens.

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

from ..collectives import agree_max
from .base import Batch, Companion, LogLik, StepContext, View, concat_rows, register_algorithm
from .grpo import AdvantageMode, GRPOAlgorithm, GRPOConfig, clipped_surrogate, kl_penalty, rl_view
from .paper import PaperSettings
from .value import ValueModel, clipped_value_loss, trace_returns_advantages, view_values

INF_STEP = 2 ** 62  # group index of never-written tokens: masked in every replayed state


# ----------------------------------------------------------------------------------------------------------
# Replay planning (pure functions on step maps; tested directly)
# ----------------------------------------------------------------------------------------------------------


def step_groups(step_map: torch.Tensor, shrink: int, block_ids: Optional[torch.Tensor] = None):
    """Group every written token's step with the ``shrink`` - 1 following distinct steps of its row (or block).

    Returns ``(group [B, Lc], first_step [B, Lc])``: the group index (rank of the step among the row's distinct
    steps -- within the token's block when ``block_ids`` is given -- divided by ``shrink``; ``INF_STEP`` for
    never-written tokens) and the first step value of the token's group (the group's place in time).
    """
    if shrink < 1:
        raise ValueError(f"shrink must be >= 1, got {shrink}")
    steps = step_map.long().cpu()
    B, Lc = steps.shape
    group = torch.full((B, Lc), INF_STEP, dtype=torch.long)
    first = torch.full((B, Lc), INF_STEP, dtype=torch.long)
    blocks = None if block_ids is None else block_ids.long().cpu()
    for i in range(B):
        written = steps[i] >= 0
        if not bool(written.any()):
            continue
        s = steps[i, written]
        blk = blocks[i, written] if blocks is not None else torch.zeros_like(s)
        span = int(s.max()) + 1
        uniq, inv = torch.unique(blk * span + s, sorted=True, return_inverse=True)
        block_start = torch.searchsorted(uniq, (uniq // span) * span)  # index of each block's first key
        grp = (torch.arange(uniq.numel()) - block_start) // shrink
        group[i, written] = grp[inv]
        first[i, written] = (uniq[block_start + grp * shrink] % span)[inv]
    return group.to(step_map.device), first.to(step_map.device)


@dataclass
class ReplayPlan:
    """Which view scores each token, and the state of each view.

    ``round [B, Lc]``: the view in which the token is a target (-1: never a target); ``threshold [B, R]``: in view r
    row i masks its tokens with ``group >= threshold[i, r]`` (``INF_STEP`` for padded views: nothing but
    never-written tokens); ``transition [B, Lc]``: time rank of the target's group in its row (CJ-GRPO's step index
    s; -1 for non-targets).
    """
    group: torch.Tensor
    round: torch.Tensor
    threshold: torch.Tensor
    transition: torch.Tensor

    @property
    def num_rounds(self) -> int:
        return self.threshold.shape[1]

    @property
    def num_transitions(self) -> int:
        return int(self.transition.max().item()) + 1 if self.transition.numel() else 0

    def masked(self, r: int) -> torch.Tensor:
        return self.group >= self.threshold[:, r:r + 1]


def plan_replay(step_map: torch.Tensor, eligible: torch.Tensor, shrink: int,
                block_ids: Optional[torch.Tensor] = None, min_rounds: int = 0) -> ReplayPlan:
    """The replay of ``step_map`` (see module docstring). ``eligible [B, Lc]``: tokens that may be targets;
    groups without an eligible token are no round of their own (but stay masked in earlier states)."""
    group, first = step_groups(step_map, shrink, block_ids)
    group_c, first_c = group.cpu(), first.cpu()
    ok = eligible.bool().cpu() & (group_c < INF_STEP)
    B, Lc = group_c.shape
    rnd = torch.full((B, Lc), -1, dtype=torch.long)
    trans = torch.full((B, Lc), -1, dtype=torch.long)
    per_row = []
    for i in range(B):
        g = group_c[i, ok[i]]
        rho = torch.unique(g, sorted=True)
        per_row.append(rho)
        rnd[i, ok[i]] = torch.searchsorted(rho, g)
        f = first_c[i, ok[i]]
        trans[i, ok[i]] = torch.searchsorted(torch.unique(f, sorted=True), f)
    R = max([min_rounds] + [int(r.numel()) for r in per_row])
    thr = torch.full((B, R), INF_STEP, dtype=torch.long)
    for i, rho in enumerate(per_row):
        thr[i, :rho.numel()] = rho
    dev = step_map.device
    return ReplayPlan(group, rnd.to(dev), thr.to(dev), trans.to(dev))


def completion_block_ids(batch: Batch, block_size: int) -> torch.Tensor:
    """Attention block of every completion token: absolute position (real prompt length + k) // block size."""
    p_len = batch["prompt_mask"].long().sum(1)
    Lc = batch["completion_ids"].shape[1]
    pos = p_len[:, None] + torch.arange(Lc, device=p_len.device)[None]
    return pos // block_size


# ----------------------------------------------------------------------------------------------------------
# Shared base: replay corruption, per-view backward, weighted clipped loss
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ReplayConfig(GRPOConfig):
    """Options shared by the trajectory-replay methods (TraceRL, DiRL, CJ-GRPO)."""
    shrink: int = 1  # group this many consecutive distinct steps into one forward (trajectory shrinkage)
    # Tokens after the completion mask (after the first EOS) that may still be targets; None: all written ones.
    post_tokens: Optional[int] = 0
    # Rewards of completions without a stop token are replaced by this value before the advantage (None: keep).
    truncated_reward: Optional[float] = None

    def __post_init__(self):
        super().__post_init__()
        if self.shrink < 1:
            raise ValueError(f"shrink must be >= 1, got {self.shrink}")
        if self.post_tokens is not None and self.post_tokens < 0:
            raise ValueError(f"post_tokens must be >= 0 or null, got {self.post_tokens}")


class ReplayAlgorithm(GRPOAlgorithm):
    """Corruption = replay of the rollout's step map; loss = sum over targets of ``w_pg * surrogate + beta * w_kl *
    KL`` with per-method token weights (``token_weights``). Subclasses set ``supports`` and the weights."""
    config_class = ReplayConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal")
    undefined: ClassVar[dict[str, str]] = {
        "encoder_decoder": "it replays the rollout's trace (each token scored at the step that decoded it); the canvas "
                           "sampler (uniform noise) writes no token at a step: every pass re-noises the positions it "
                           "does not accept and a canvas's tokens are its last pass's argmax"}

    # --- what the loop prepares ---------------------------------------------------------------------
    @property
    def needs_old_logp(self) -> bool:
        # With mu = 1 the rollout policy *is* the current one: old := logp.detach() gives ratio 1 and a KL-to-old
        # of exactly 0 with zero gradient, which is what a separate old pass would give, minus the pass.
        return self.config.inner_iterations > 1

    def eligible(self, batch: Batch) -> torch.Tensor:
        """Completion positions that may be targets: the completion mask plus ``post_tokens`` positions."""
        cm = batch["completion_mask"].bool()
        post = self.config.post_tokens
        if post is None:
            return torch.ones_like(cm)
        Lc = cm.shape[1]
        return torch.arange(Lc, device=cm.device)[None] < (cm.long().sum(1, keepdim=True) + post)

    def block_ids(self, ctx: StepContext, batch: Batch) -> Optional[torch.Tensor]:
        return completion_block_ids(batch, ctx.adapter.block_size) if ctx.adapter.is_block_causal else None

    # --- corruption -----------------------------------------------------------------------------------
    def plan(self, ctx: StepContext, batch: Batch) -> ReplayPlan:
        if "step_map" not in batch:
            raise ValueError(f"algorithm {self.name!r} replays the rollout's step_map, but the batch has none "
                             f"(the rollout engine records it for every sampler)")
        step_map = batch["step_map"]
        if step_map.shape != batch["completion_ids"].shape:
            raise ValueError(f"step_map has shape {tuple(step_map.shape)}, completion_ids {tuple(batch['completion_ids'].shape)}")
        plan = plan_replay(step_map, self.eligible(batch), self.config.shrink, self.block_ids(ctx, batch))
        rounds, transitions = agree_max([plan.num_rounds, plan.num_transitions], step_map.device)
        if rounds > plan.num_rounds:  # another rank has more rounds: pad with empty views
            pad = torch.full((plan.threshold.shape[0], rounds - plan.num_rounds), INF_STEP, dtype=torch.long,
                             device=plan.threshold.device)
            plan.threshold = torch.cat([plan.threshold, pad], dim=1)
        batch.meta["replay_transitions"] = transitions
        return plan

    def corrupt(self, ctx: StepContext, batch: Batch, iteration: int) -> list[View]:
        self.check_model(ctx.adapter)
        # The replay is deterministic: every inner iteration reuses the views (the same list) of the first.
        if iteration > 0 and "replay_views" in batch.meta:
            return batch.meta["replay_views"]
        plan = self.plan(ctx, batch)
        batch["replay_round"] = plan.round
        batch["replay_transition"] = plan.transition
        comp, mask_id = batch["completion_ids"], ctx.adapter.mask_token_id
        views = []
        for r in range(plan.num_rounds):
            state = torch.where(plan.masked(r), torch.full_like(comp, mask_id), comp)
            targets = plan.round == r
            # Block models: the one-pass [x_t ; x_0] layout (noisy block b sees clean blocks < b and itself).
            views.append(rl_view(ctx, batch, state, targets, block_layout=ctx.adapter.is_block_causal))
        batch.meta["replay_views"] = views
        return views

    # --- advantages -----------------------------------------------------------------------------------
    def advantages(self, ctx: StepContext, batch: Batch) -> torch.Tensor:
        cfg = self.config
        if cfg.truncated_reward is not None:
            comp, cm = batch["completion_ids"], batch["completion_mask"].bool()
            stops = torch.tensor(ctx.adapter.all_stop_ids, dtype=comp.dtype, device=comp.device)
            last = (cm.long().sum(1) - 1).clamp_min(0)
            ended = torch.isin(comp.gather(1, last[:, None]).squeeze(1), stops) & cm.any(1)
            batch["rewards"] = torch.where(ended, batch["rewards"].float(),
                                           torch.full_like(batch["rewards"].float(), cfg.truncated_reward))
        return super().advantages(ctx, batch)

    # --- normalisers and loss --------------------------------------------------------------------------
    def targets(self, batch: Batch) -> torch.Tensor:
        return (batch["replay_round"] >= 0) & (batch["active"].float()[:, None] > 0)

    def normalizers(self, batch: Batch) -> dict[str, float]:
        tgt = self.targets(batch)
        rnd = torch.where(tgt, batch["replay_round"], torch.full_like(batch["replay_round"], -1))
        rounds = sum(int(torch.unique(r[r >= 0]).numel()) for r in rnd.cpu())
        return {"targets": float(tgt.sum()), "rounds": float(rounds), "seqs": float(batch["active"].float().sum()),
                "samples": float(batch.size)}

    def token_weights(self, ctx: StepContext, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(surrogate weight, KL weight) per completion token; zero outside this micro-batch's targets."""
        raise NotImplementedError

    def loss(self, ctx: StepContext, batch: Batch, current: LogLik, iteration: int, select: Optional[torch.Tensor] = None):
        """The loss share of ``batch`` (restricted to the ``select`` tokens when given: one view's targets)."""
        cfg = self.config
        logp = current.value
        old, ref = self.old_and_ref(batch, current, iteration)
        w_pg, w_kl = self.token_weights(ctx, batch)
        sel = self.targets(batch) if select is None else self.targets(batch) & select
        w_pg, w_kl = w_pg * sel, w_kl * sel
        # Outside the selection the log-probs are placeholders (0 or another view's): neutralise them so that
        # exp(logp - old) cannot overflow into inf * 0.
        old = old.to(logp.device)
        logp_s = torch.where(sel, logp, old.detach())
        per_tok, ratio, clipped = clipped_surrogate(logp_s, old, batch["advantages"].to(logp.device), cfg.clip_low,
                                                    cfg.clip_high, cfg.dual_clip, cfg.logratio_clamp)
        loss = (per_tok * w_pg).sum()
        n = max(ctx.norms.get("targets", 0.0), 1.0)
        selected = sel.float()
        metrics = {"clip_frac": float((clipped.float() * selected).sum()) / n,
                   "ratio_mean": float((ratio.detach() * selected).sum()) / n}
        if ref is not None:
            ref_s = torch.where(sel, ref.to(logp.device), logp_s.detach())
            kl = kl_penalty(logp_s, ref_s, cfg.kl_estimator)
            loss = loss + cfg.beta * (kl * w_kl).sum()
            metrics["kl"] = float((kl.detach() * selected).sum()) / n
        if current.entropy is not None:
            metrics["entropy"] = float((current.entropy * selected).sum()) / n
        return loss, metrics

    def backward(self, ctx: StepContext, model, batch: Batch, iteration: int, loss_scale: float = 1.0) -> dict[str, float]:
        """One forward + backward per view: the loss is a sum over tokens and each token is scored by exactly one
        view, so the accumulated gradient equals that of the whole loss while only one view's graph is alive."""
        totals: dict[str, float] = {"loss": 0.0}
        for r, view in enumerate(batch["views"][iteration]):  # view r scores the tokens of round r
            current = self.log_likelihood(ctx, model, batch, [view], with_entropy=ctx.want_entropy)
            loss, metrics = self.loss(ctx, batch, current, iteration, select=batch["replay_round"] == r)
            (loss * loss_scale).backward()
            totals["loss"] += float(loss.detach())
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v
        return totals


def per_round_counts(batch: Batch, targets: torch.Tensor) -> torch.Tensor:
    """Number of targets of the token's own (sample, round) row, per token."""
    rnd = batch["replay_round"].clamp_min(0)
    width = int(rnd.max().item()) + 1 if rnd.numel() else 1
    counts = torch.zeros(rnd.shape[0], width, device=rnd.device).scatter_add_(1, rnd, targets.float())
    return counts.gather(1, rnd)


# ----------------------------------------------------------------------------------------------------------
# TraceRL
# ----------------------------------------------------------------------------------------------------------


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
        per_attention={"bidirectional": {"algorithm": {"shrink": 8}}, "block_causal": {"algorithm": {"shrink": 1}}},
        source="Gen-Verse/dLLM-RL configs/rl_sdar.yaml (learning_rate, max_grad_norm, temperature, shrink 1); "
               "configs/rl_llada.yaml (shrink 8); no Sudoku script")
    config_class = TraceRLConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal")

    def token_weights(self, ctx: StepContext, batch: Batch):
        tgt = self.targets(batch).float()
        rows = max(ctx.norms.get("rounds", 0.0), 1.0)
        mode = self.config.normalize
        if mode == "auto":
            mode = "round_length" if ctx.adapter.is_block_causal else "round_mean"
        if mode == "round_length":
            w = tgt / (batch["completion_ids"].shape[1] * rows)
            return w, w
        return tgt / (per_round_counts(batch, tgt).clamp_min(1.0) * rows), tgt / rows

    # --- the optional value model (value.py) ----------------------------------------------------------------
    def companions(self) -> list[Companion]:
        cfg = self.config
        return [Companion("value", ValueModel.from_policy, cfg.value_lr)] if cfg.value_model else []

    def _value_model(self, ctx: StepContext):
        if "value" not in ctx.companions:
            raise ValueError("algorithm.value_model: true needs the trainer's value model (ctx.companions['value'])")
        return ctx.companions["value"]

    @torch.no_grad()
    def score_companions(self, ctx: StepContext, batch: Batch, micro_batch_size: int) -> None:
        """Old values ``[B, Lc]``: each target's value in its own replay view, before any update."""
        if not self.config.value_model:
            return
        vm, parts = self._value_model(ctx), []
        for mb in batch.split(micro_batch_size):
            values = torch.zeros(mb["completion_ids"].shape, device=mb["completion_ids"].device)
            for r, view in enumerate(mb["views"][0]):
                own = mb["replay_round"] == r
                values = torch.where(own, view_values(vm, view).to(values.device), values)
            parts.append(values)
        batch["old_values"] = concat_rows(parts)

    def advantages(self, ctx: StepContext, batch: Batch) -> torch.Tensor:
        scores = super().advantages(ctx, batch)  # the group z-scored (outcome) rewards
        cfg = self.config
        if not cfg.value_model:
            return scores
        steps = torch.where(self.targets(batch), batch["replay_transition"], torch.full_like(batch["replay_transition"], -1))
        returns, adv = trace_returns_advantages(scores, batch["old_values"], steps, cfg.value_gamma, cfg.value_lambda)
        batch["value_returns"] = returns
        return adv

    def backward(self, ctx: StepContext, model, batch: Batch, iteration: int, loss_scale: float = 1.0) -> dict[str, float]:
        out = super().backward(ctx, model, batch, iteration, loss_scale)
        if self.config.value_model:
            out.update(self.value_backward(ctx, batch, loss_scale))
        return out

    def value_loss(self, ctx: StepContext, batch: Batch, values: torch.Tensor, select: Optional[torch.Tensor] = None):
        """The value loss share of ``batch`` for current ``values [B, Lc]`` (restricted to ``select``: one view's
        targets): the clipped value loss of every target, weighted like the surrogate."""
        weight, _ = self.token_weights(ctx, batch)
        sel = self.targets(batch) if select is None else self.targets(batch) & select
        old = batch["old_values"].to(values.device)
        per_tok, clipped = clipped_value_loss(torch.where(sel, values, old), old, batch["value_returns"].to(values.device),
                                              self.config.value_clip)
        n = max(ctx.norms.get("targets", 0.0), 1.0)
        metrics = {"value_clip_frac": float((clipped & sel).sum()) / n,
                   "value_mean": float((values.detach() * sel).sum()) / n}
        return (per_tok * weight * sel).sum(), metrics

    def value_backward(self, ctx: StepContext, batch: Batch, loss_scale: float) -> dict[str, float]:
        """The value model's loss, one forward + backward per replay view (the loss is a sum over tokens)."""
        vm = self._value_model(ctx)
        out = {"value_loss": 0.0, "value_clip_frac": 0.0, "value_mean": 0.0}
        for r, view in enumerate(batch["views"][0]):
            loss, metrics = self.value_loss(ctx, batch, view_values(vm, view), select=batch["replay_round"] == r)
            (loss * loss_scale).backward()
            out["value_loss"] += float(loss.detach())
            for k, v in metrics.items():
                out[k] += v
        return out
