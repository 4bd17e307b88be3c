"""The trajectory-replay machinery shared by TraceRL (``tracerl.py``), CJ-GRPO (``cj_grpo.py``) and DiRL (``dirl.py``).

The rollout's ``step_map [B, Lc]`` records the denoising step that wrote every completion token (-1: never written,
e.g. blocks skipped after an early stop). Replaying it gives the sampler's own intermediate states instead of random
masks:

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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ...collectives import agree_max
from ..base import StepContext
from ..batch import LogLik, RLBatch, View
from ..grpo import GRPOAlgorithm, GRPOConfig
from ..losses import weighted_policy_loss
from .scoring import backward_each_view
from .views import completion_view

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
    s; -1 for non-targets). A replay method's ``batch.state``.
    """
    group: torch.Tensor
    round: torch.Tensor
    threshold: torch.Tensor
    transition: torch.Tensor
    transitions: int = 0  # transition indices any rank has (``ReplayAlgorithm.prepare`` agrees on it)

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


def completion_block_ids(batch, block_size: int) -> torch.Tensor:
    """Attention block of every completion token: absolute position (real prompt length + k) // block size."""
    p_len = batch.prompt_mask.long().sum(1)
    Lc = batch.completion_ids.shape[1]
    pos = p_len[:, None] + torch.arange(Lc, device=p_len.device)[None]
    return pos // block_size


def per_round_counts(plan: ReplayPlan, targets: torch.Tensor) -> torch.Tensor:
    """Number of targets of the token's own (sample, round) row, per token."""
    rnd = plan.round.clamp_min(0)
    width = int(rnd.max().item()) + 1 if rnd.numel() else 1
    counts = torch.zeros(rnd.shape[0], width, device=rnd.device).scatter_add_(1, rnd, targets.float())
    return counts.gather(1, rnd)


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

    deterministic_views: ClassVar[bool] = True  # the replay draws nothing: every inner iteration scores the same views

    # --- what the loop prepares ---------------------------------------------------------------------
    @property
    def needs_old_logp(self) -> bool:
        # With mu = 1 the rollout policy *is* the current one: old := logp.detach() gives ratio 1 and a KL-to-old
        # of exactly 0 with zero gradient, which is what a separate old pass would give, minus the pass.
        return self.config.inner_iterations > 1

    def eligible(self, batch: RLBatch) -> torch.Tensor:
        """Completion positions that may be targets: the completion mask plus ``post_tokens`` positions."""
        cm = batch.completion_mask.bool()
        post = self.config.post_tokens
        if post is None:
            return torch.ones_like(cm)
        Lc = cm.shape[1]
        return torch.arange(Lc, device=cm.device)[None] < (cm.long().sum(1, keepdim=True) + post)

    def replay_steps(self, ctx: StepContext, batch: RLBatch) -> torch.Tensor:
        """``[B, Lc]`` the time of every token that the replay groups (-1: never written): the rollout's step map;
        d2-StepMerge maps it to its trajectory segments."""
        return batch.step_map

    def block_ids(self, ctx: StepContext, batch: RLBatch) -> Optional[torch.Tensor]:
        return completion_block_ids(batch, ctx.adapter.block_size) if ctx.adapter.is_block_causal else None

    # --- corruption: the replay of the rollout's step map ---------------------------------------------------
    def prepare(self, ctx: StepContext, batch: RLBatch) -> ReplayPlan:
        if batch.step_map is None:
            raise ValueError(f"algorithm {self.name!r} replays the rollout's step_map, but the batch has none "
                             f"(the rollout engine records it for every sampler)")
        if batch.step_map.shape != batch.completion_ids.shape:
            raise ValueError(f"step_map has shape {tuple(batch.step_map.shape)}, completion_ids "
                             f"{tuple(batch.completion_ids.shape)}")
        step_map = self.replay_steps(ctx, batch)
        plan = plan_replay(step_map, self.eligible(batch), self.config.shrink, self.block_ids(ctx, batch))
        rounds, transitions = agree_max([plan.num_rounds, plan.num_transitions], step_map.device)
        if rounds > plan.num_rounds:  # another rank has more rounds: pad with empty views
            pad = torch.full((plan.threshold.shape[0], rounds - plan.num_rounds), INF_STEP, dtype=torch.long,
                             device=plan.threshold.device)
            plan.threshold = torch.cat([plan.threshold, pad], dim=1)
        plan.transitions = transitions
        return plan

    def replay_prompt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> Optional[torch.Tensor]:
        """The prompt every view of ``iteration`` conditions on: None = the clean prompt (d2-StepMerge masks it like
        d1)."""
        return None

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        plan, comp, mask_id = batch.state, batch.completion_ids, ctx.adapter.mask_token_id
        prompt = self.replay_prompt(ctx, batch, iteration)
        views = []
        for r in range(plan.num_rounds):
            state = torch.where(plan.masked(r), torch.full_like(comp, mask_id), comp)
            # Block models: the one-pass [x_t ; x_0] layout (noisy block b sees clean blocks < b and itself).
            views.append(completion_view(ctx, batch, state, plan.round == r, prompt_input=prompt))
        return views

    # --- advantages -----------------------------------------------------------------------------------
    def advantage_rewards(self, ctx: StepContext, batch: RLBatch) -> torch.Tensor:
        cfg = self.config
        if cfg.truncated_reward is None:
            return batch.rewards
        comp, cm = batch.completion_ids, batch.completion_mask.bool()
        stops = torch.tensor(ctx.adapter.all_stop_ids, dtype=comp.dtype, device=comp.device)
        last = (cm.long().sum(1) - 1).clamp_min(0)
        ended = torch.isin(comp.gather(1, last[:, None]).squeeze(1), stops) & cm.any(1)
        return torch.where(ended, batch.rewards.float(), torch.full_like(batch.rewards.float(), cfg.truncated_reward))

    # --- normalisers and loss --------------------------------------------------------------------------
    def targets(self, batch: RLBatch, active: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Bool ``[B, Lc]``: every token some view scores, in active samples (``active``: default the batch's)."""
        active = batch.active if active is None else active
        return (batch.state.round >= 0) & (active.float()[:, None] > 0)

    def normalizers(self, batch: RLBatch) -> dict[str, float]:
        tgt = self.targets(batch)
        rnd = torch.where(tgt, batch.state.round, torch.full_like(batch.state.round, -1))
        rounds = sum(int(torch.unique(r[r >= 0]).numel()) for r in rnd.cpu())
        return {"targets": float(tgt.sum()), "rounds": float(rounds), "seqs": float(batch.active.float().sum()),
                "samples": float(batch.size)}

    def token_weights(self, ctx: StepContext, batch: RLBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(surrogate weight, KL weight) per completion token; zero outside this micro-batch's targets."""
        raise NotImplementedError

    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int, select: Optional[torch.Tensor] = None):
        """The loss share of ``batch`` (restricted to the ``select`` tokens when given: one view's targets)."""
        cfg = self.config
        logp = current.value
        old, ref = self.old_and_ref(batch, current, iteration)
        w_pg, w_kl = self.token_weights(ctx, batch)
        sel = self.targets(batch) if select is None else self.targets(batch) & select
        return weighted_policy_loss(
            logp, old, batch.advantages.values, sel, w_pg, w_kl, target_count=ctx.norms.get("targets", 0.0),
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, logratio_clamp=cfg.logratio_clamp,
            ref_logp=ref, beta=cfg.beta, kl_estimator=cfg.kl_estimator, entropy=current.entropy)

    def backward(self, ctx: StepContext, model, batch: RLBatch, iteration: int, loss_scale: float = 1.0) -> dict[str, float]:
        """One forward + backward per view: the loss is a sum over tokens and each token is scored by exactly one
        view, so the accumulated gradient equals that of the whole loss while only one view's graph is alive."""
        def view_loss(r, view):  # view r scores the tokens of round r
            current = self.log_likelihood(ctx, model, batch, [view], with_entropy=ctx.want_entropy)
            return self.loss(ctx, batch, current, iteration, select=batch.state.round == r)
        return backward_each_view(batch.views[iteration], view_loss, loss_scale, runner=ctx.services.run_unit)
