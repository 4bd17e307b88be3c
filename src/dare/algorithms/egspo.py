"""EGSPO and EGSPO-SA (Kunde et al. 2026, arXiv 2603.12554; reference ``vishnutez/egspo-dllm-rl``).

The denoising run is an MDP: state ``s_t`` = the completion before step t, action ``a_t`` = the tokens step t
commits (``U_t``, read from the rollout's ``step_map``), deterministic transitions, reward at the end. The policy
gradient is exact per step, so the likelihood is the step's own

    log pi(a_t | s_t) = sum_{i in U_t} log softmax(f(s_t))_i[x^i]      (``step_logp: sum``; ``mean``: the mean)

from one forward on the replayed state (never-written tokens stay masked; block models use the ``[x_t ; x_0]``
layout, which gives a block's step exactly its sampler state). Only K = ``sample_train_steps`` steps per completion
are trained: the K with the highest mean predictive entropy over ``U_t`` (the rollout records it at commit
time: EGSPO's ``record``), in descending order; slot k of every sample is its k-th highest-entropy step.

* ``egspo``: every trained step of a sample gets the group-centred terminal reward ``A = R - mean_group R``.
* ``egspo_sa`` (stepwise advantages): ``r_k = R(x0_hat(s_{t_k}))``, the reward of the one-step greedy denoise of
  the state (argmax at every masked position, committed tokens kept), ``G_k = (R + lambda (R - r_k)) / (1 + lambda)``,
  ``A_k = G_k - mean_group G_k`` per slot. x0_hat is recomputed before the update with one no-grad forward per
  trained state (``score_frozen`` with the pre-update policy; the reference keeps it from the rollout forward, T x L tokens per sample).

Loss per inner iteration j (one optimizer update; it trains slots ``[j m, (j+1) m)``, m = K / mu):
``sum_{b, k} [-min(rho A, clip(rho, 1 - lo, 1 + hi) A) + beta k3(logpi, logpi_ref)] / (n * N_j)`` with ``rho`` the
step-level ratio, ``n`` the rollout's mean tokens per step (``step_logp: sum``; the reference's
``max_completion_length // diffusion_steps``) and ``N_j`` the iteration's (sample, step) pairs over the whole batch.
Defaults follow ``egspo/train.sh`` and ``egspo/egspo_config.py`` at a7d618b (docs/algorithms/egspo.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import torch

from ..models import LogitsRequest
from ..rollout.config import Record
from .advantages import group_advantages, zero_variance_groups
from .base import StepContext, cost
from .batch import Advantages, LogLik, RLBatch, View
from .common.scoring import backward_each_view, score_view
from .common.views import completion_view
from .grpo import GRPOAlgorithm, GRPOConfig
from .losses import clipped_surrogate, kl_penalty
from .paper import LrDeparture, PaperSettings
from .registry import register_algorithm

StepSelection = Literal["entropy", "uniform", "random"]


@dataclass
class EGSPOConfig(GRPOConfig):
    name: str = "egspo"
    sample_train_steps: int = cost(8, "trained_steps")  # K: trained steps per completion (logps_eval_num_steps)
    # mu: optimizer updates per rollout; each trains K / mu of the selected steps (the reference: one step per
    # micro-step with gradient_accumulation_steps = 2, so K = 8 steps make 4 updates)
    inner_iterations: int = cost(4, "iterations")
    clip_low: float = 0.2  # epsilon
    clip_high: Optional[float] = 0.5  # epsilon_high
    beta: float = 0.04  # k3 on the step-level log-prob, to the frozen starting model
    step_selection: StepSelection = "entropy"  # "uniform" / "random": the reference's ablations (+ the last step)
    step_logp: Literal["sum", "mean"] = "sum"  # logps_aggregation_mode

    def __post_init__(self):
        super().__post_init__()
        if self.sample_train_steps < 1:
            raise ValueError(f"sample_train_steps must be >= 1, got {self.sample_train_steps}")
        if self.sample_train_steps % self.inner_iterations:
            raise ValueError(f"sample_train_steps={self.sample_train_steps} must be divisible by inner_iterations="
                             f"{self.inner_iterations} (each update trains the same number of selected steps)")
        if self.step_selection not in ("entropy", "uniform", "random"):
            raise ValueError(f"step_selection must be entropy, uniform or random, got {self.step_selection!r}")
        if self.step_logp not in ("sum", "mean"):
            raise ValueError(f"step_logp must be sum or mean, got {self.step_logp!r}")


@dataclass
class EGSPOSAConfig(EGSPOConfig):
    name: str = "egspo_sa"
    lambda1: float = 0.5  # weight of the stepwise advantage R - r(x0_hat(s_t)) (train.sh LAMBDA1)
    normalize_returns: bool = True  # divide the return by 1 + lambda1 (train.sh NORMALIZE_RETURNS)
    # True: centre the stepwise return in the group (the reference's default); False: its standard_grpo_returns,
    # A = ((R - mean R) + lambda (R - r)) / (1 + lambda)
    centre_stepwise: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.lambda1 < 0:
            raise ValueError(f"lambda1 must be >= 0, got {self.lambda1}")


# ----------------------------------------------------------------------------------------------------------
# Pure functions (tested directly)
# ----------------------------------------------------------------------------------------------------------


def step_entropies(step_map: torch.Tensor, entropy_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy [B, S], valid [B, S])``: each denoising step's mean predictive entropy over the tokens it committed
    (S = the batch's most steps; a step that committed nothing, or a row's missing steps, is not valid)."""
    B = step_map.shape[0]
    written = step_map >= 0
    S = int(step_map.max()) + 1 if bool(written.any()) else 0
    idx = step_map.clamp_min(0).long()
    sums = torch.zeros(B, S, dtype=torch.float64, device=step_map.device)
    counts = torch.zeros(B, S, dtype=torch.float64, device=step_map.device)
    sums.scatter_add_(1, idx, torch.where(written, entropy_map.double(), torch.zeros_like(sums[:, :1].expand_as(idx))))
    counts.scatter_add_(1, idx, written.double())
    valid = counts > 0
    return torch.where(valid, sums / counts.clamp_min(1), torch.zeros_like(sums)).float(), valid


def select_steps(entropy: torch.Tensor, valid: torch.Tensor, k: int, mode: str = "entropy",
                 generators: Optional[list] = None) -> torch.Tensor:
    """``[B, k]`` long: each row's trained steps, -1 where the row has fewer than k valid steps.

    ``entropy``: the k highest-entropy valid steps in descending order (ties: the earlier step first).
    ``uniform`` / ``random`` (the reference's ablations over a row's n valid steps, in time order): k - 1 steps at
    ``linspace(0, n - 2, k - 1)`` / drawn uniformly from the first n - 1 (``generators``: one per row), plus the last."""
    B = entropy.shape[0]
    out = torch.full((B, k), -1, dtype=torch.long, device=entropy.device)
    for b in range(B):
        steps = valid[b].nonzero().flatten()
        n = steps.numel()
        if n == 0:
            continue
        if mode == "entropy":
            order = torch.argsort(entropy[b, steps], descending=True, stable=True)[:k]
            chosen = steps[order]
        else:
            if k == 1:
                picks = torch.empty(0, dtype=torch.long)
            elif mode == "uniform":
                picks = torch.linspace(0, max(n - 2, 0), k - 1).long()
            else:
                picks = torch.randint(0, max(n - 1, 1), (k - 1,), generator=generators[b])
            chosen = steps[torch.cat([picks.to(steps.device), torch.tensor([n - 1], device=steps.device)])]
        out[b, :chosen.numel()] = chosen
    return out


def stepwise_advantages(final: torch.Tensor, step_rewards: Optional[torch.Tensor], groups: torch.Tensor, k: int,
                        lambda1: float = 0.0, normalize: bool = True, centre_stepwise: bool = True,
                        mode: str = "mean", eps: float = 0.0) -> torch.Tensor:
    """``[B, k]`` advantages of the trained slots from the final rewards ``[B]`` and the one-step-denoise rewards
    ``[B, k]`` of the slots' states (None or lambda1 = 0: EGSPO, the group-centred final reward in every slot)."""
    if step_rewards is None or lambda1 == 0:
        return group_advantages(final, groups, mode, eps)[:, None].expand(-1, k).contiguous()
    R = final.double()[:, None]
    sa = R - step_rewards.double()  # the stepwise advantage R - r(x0_hat(s_t))
    scale = 1.0 + lambda1 if normalize else 1.0
    if centre_stepwise:
        return group_advantages(((R + lambda1 * sa) / scale).float(), groups, mode, eps)
    return ((group_advantages(final, groups, mode, eps).double()[:, None] + lambda1 * sa) / scale).float()


def replay_state(completion: torch.Tensor, step_map: torch.Tensor, steps: torch.Tensor, mask_id: int):
    """``(state [B, Lc], targets [B, Lc])`` of each row's step ``steps [B]``: the completion with every token written
    at that step or later -- and every never-written one -- masked, and the tokens written at that step (none for
    -1)."""
    t = steps[:, None]
    masked = (step_map < 0) | (step_map >= t)
    return torch.where(masked, torch.full_like(completion, mask_id), completion), (step_map == t) & (t >= 0)


@torch.no_grad()
def greedy_denoise(model, view: View, completion_length: int, mask_id: int) -> torch.Tensor:
    """``x0_hat [B, Lc]``: the one-step greedy completion of a bidirectional ``[prompt ; state]`` view -- argmax of
    its logits at every masked position of the state (never the mask id), committed tokens kept."""
    Lc = completion_length
    P = view.input_ids.shape[1] - Lc
    state = view.input_ids[:, P:]
    shift = 1 if model.adapter.shift_logits else 0
    logits = model(view.input_ids, attention_mask=view.attention_mask, position_ids=view.position_ids,
                   request=LogitsRequest(rows=slice(P - shift, P + Lc - shift))).logits
    logits = logits.float().index_fill(-1, torch.tensor([mask_id], device=logits.device), float("-inf"))
    return torch.where(state == mask_id, logits.argmax(-1), state)


@dataclass
class EGSPOState:
    """``batch.state``: the trained steps ``[B, K]`` (-1: none), their rollout entropies ``[B, K]`` and each row's
    number of denoising steps ``[B]``."""
    steps: torch.Tensor
    entropy: torch.Tensor
    num_steps: torch.Tensor


@dataclass
class StepRewards:
    """EGSPO-SA's ``batch.frozen``: the reward ``rewards [B, K]`` of the greedy one-step denoise of every trained state
    (the terminal reward in untrained slots)."""
    rewards: torch.Tensor


def pairs_key(iteration: int) -> str:
    return f"egspo_pairs_{iteration}"


# ----------------------------------------------------------------------------------------------------------


@register_algorithm
class EGSPO(GRPOAlgorithm):
    """Exact per-step policy gradient on the K highest-entropy denoising steps; group-centred terminal reward."""
    name = "egspo"
    iterations_split_work = True  # iteration j trains slots [j K/mu, (j+1) K/mu)
    paper = PaperSettings(
        lr=3e-5, grad_clip=0.2, temperature=0.9, lora={"r": 128, "alpha": 64}, published_code=True,
        source="vishnutez/egspo-dllm-rl egspo/train.sh (LEARNING_RATE, TEMPERATURE, LAMBDA1=0 for EGSPO), "
               "egspo/slurm_scripts/train.yaml (max_grad_norm, lora_r, lora_alpha); gsm8k only")
    departure = LrDeparture(
        0.5,
        "at its paper ratio (30x Coupled-GRPO's lr: 3e-3 with LoRA r 128) the tiny LLaDA learned (held-out "
        "54.2 +/- 2.2 %) but the tiny SDAR collapsed in the last update on two of three seeds: training reward ~0.78 "
        "for ten steps, then 0.43 and 0.09 with a loss spike to 17.8, held-out 78.1 / 0.0 / 2.2 % from "
        "79.1 -- the failure d-TreeRPO had on SDAR at the same lr; at 1.5e-3 (factor 0.5) the same SDAR seeds "
        "gained (83.9 / 85.4 / 84.9) and the LLaDA seeds gained more (57.1 / 57.7 / 59.1; 200 held-out puzzles, "
        "docs/comparison.md).",
        ("lazy-sudoku-llada-sft", "lazy-sudoku-sdar-sft"), "docs/comparison.md")
    config_class = EGSPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal")
    undefined: ClassVar[dict[str, str]] = {
        "encoder_decoder": "its action is the set of tokens a denoising step commits; the uniform-noise canvas sampler "
                           "commits none -- every pass re-noises what it does not accept and a canvas's tokens are its "
                           "last pass's argmax -- so there is no step state or action to replay"}

    @property
    def record(self) -> Record:  # the entropy each token was committed from ranks the steps (and is logged)
        return Record(entropy=True)

    # --- the trained steps (once per batch) ----------------------------------------------------------
    def prepare(self, ctx: StepContext, batch: RLBatch) -> EGSPOState:
        cfg = self.config
        if batch.step_map is None:
            raise ValueError(f"{self.name} replays the rollout's step_map, but the batch has none")
        if cfg.step_selection == "entropy" and batch.entropy_map is None:
            raise ValueError(f"{self.name} picks its training steps by the rollout's predictive entropy, but the batch "
                             f"carries no entropy map (its rollout must record one: Record(entropy=True), its record)")
        ent_map = batch.entropy_map if batch.entropy_map is not None else torch.zeros(batch.step_map.shape)
        entropy, valid = step_entropies(batch.step_map, ent_map.to(batch.step_map.device))
        gens = [ctx.generator("egspo_steps", int(u)) for u in batch.uid.tolist()] if cfg.step_selection == "random" else None
        steps = select_steps(entropy, valid, cfg.sample_train_steps, cfg.step_selection, gens)
        chosen = entropy.gather(1, steps.clamp_min(0)) * (steps >= 0) if entropy.numel() else torch.zeros(steps.shape)
        return EGSPOState(steps, chosen, valid.sum(1))

    def slots(self, iteration: int) -> range:
        m = self.config.sample_train_steps // self.config.inner_iterations
        return range(iteration * m, (iteration + 1) * m)

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        """One view per slot of the iteration: each sample's own trained step, replayed."""
        views = []
        for k in self.slots(iteration):
            state, targets = replay_state(batch.completion_ids, batch.step_map, batch.state.steps[:, k],
                                          ctx.adapter.mask_token_id)
            views.append(completion_view(ctx, batch, state, targets))
        return views

    # --- likelihood: one slot per view ---------------------------------------------------------------
    def log_likelihood(self, ctx: StepContext, model, batch: RLBatch, views: list[View], *,
                       with_entropy: bool = False) -> LogLik:
        values, ents = [], []
        for v in views:
            logp, ent = score_view(model, v, ctx.chunk_size, with_entropy)
            tgt = v.targets.gather(1, v.score_index).float()
            n = tgt.sum(1)
            step = (logp.gather(1, v.score_index) * tgt).sum(1)
            values.append(step / n.clamp_min(1) if self.config.step_logp == "mean" else step)
            if ent is not None:
                ents.append((ent.gather(1, v.score_index) * tgt).sum(1) / n.clamp_min(1))
        return LogLik(torch.stack(values, 1), torch.stack(ents, 1) if ents else None)

    # --- advantages ----------------------------------------------------------------------------------
    def advantages(self, ctx: StepContext, batch: RLBatch) -> Advantages:
        cfg = self.config
        step_rewards = batch.frozen.rewards if batch.frozen is not None else None
        # egspo's config has no stepwise keys (and no step rewards): the terminal advantage in every slot
        adv = stepwise_advantages(batch.rewards.float(), step_rewards, batch.group, cfg.sample_train_steps,
                                  getattr(cfg, "lambda1", 0.0), getattr(cfg, "normalize_returns", True),
                                  getattr(cfg, "centre_stepwise", True), cfg.advantage, cfg.advantage_eps)
        active = torch.ones(batch.size, device=adv.device)
        if cfg.filter_zero_variance:
            active = (~zero_variance_groups(batch.rewards, batch.group)).float().to(adv.device)
        return Advantages(adv, active)

    # --- normalisers and loss ------------------------------------------------------------------------
    def trained(self, batch: RLBatch) -> torch.Tensor:
        """Bool ``[B, K]``: slots with a step to train, in active samples."""
        return (batch.state.steps >= 0) & (batch.active.float()[:, None] > 0)

    def normalizers(self, batch: RLBatch) -> dict[str, float]:
        trained = self.trained(batch)
        out = {"seqs": float(batch.active.float().sum()), "samples": float(batch.size),
               # the rollout's tokens per denoising step (the loss's per-token scale, step_logp: sum)
               "committed_tokens": float((batch.step_map >= 0).sum()), "denoise_steps": float(batch.state.num_steps.sum())}
        for it in range(self.config.inner_iterations):
            out[pairs_key(it)] = float(trained[:, list(self.slots(it))].sum())
        return out

    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int, slots=None):
        """The iteration's share ``sum over (sample, slot) of (surrogate + beta k3) / (n N_j)``; ``slots``: only these
        positions of the iteration's slots (one view's backward)."""
        cfg = self.config
        cols = list(self.slots(iteration))
        sel = self.trained(batch)[:, cols]
        if slots is not None:
            keep = torch.zeros(len(cols), dtype=torch.bool, device=sel.device)
            keep[list(slots)] = True
            sel = sel & keep[None]
        logp = current.value
        old, ref = self.old_and_ref(batch, current, iteration)
        logp_s = torch.where(sel, logp, old.detach())  # untrained slots: ratio 1, no gradient
        adv = batch.advantages.values[:, cols].to(logp.device)
        per, ratio, clipped = clipped_surrogate(logp_s, old, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                                                cfg.logratio_clamp)
        pairs = max(ctx.norms.get(pairs_key(iteration), 0.0), 1.0)
        metrics = {"clip_frac": float((clipped.float() * sel).sum()) / pairs,
                   "ratio_mean": float((ratio.detach() * sel).sum()) / pairs,
                   "step_entropy_rollout": float((batch.state.entropy[:, cols] * sel).sum()) / pairs}
        if batch.frozen is not None:
            metrics["step_reward"] = float((batch.frozen.rewards[:, cols].to(sel.device) * sel).sum()) / pairs
        if ref is not None:
            kl = kl_penalty(logp_s, torch.where(sel, ref, logp_s.detach()), cfg.kl_estimator)
            per = per + cfg.beta * kl
            metrics["kl"] = float((kl.detach() * sel).sum()) / pairs
        if current.entropy is not None:
            metrics["entropy"] = float((current.entropy * sel).sum()) / pairs
        n = 1.0
        if cfg.step_logp == "sum":
            n = max(ctx.norms.get("committed_tokens", 1.0), 1.0) / max(ctx.norms.get("denoise_steps", 1.0), 1.0)
        return (per * sel).sum() / (n * pairs), metrics

    def backward(self, ctx: StepContext, model, batch: RLBatch, iteration: int, loss_scale: float = 1.0) -> dict[str, float]:
        """One forward + backward per slot: only one step's graph is alive (the loss is a sum over slots)."""
        views = batch.views[iteration]

        def slot_loss(j, view):
            part = self.log_likelihood(ctx, model, batch, [view], with_entropy=ctx.want_entropy)
            # this slot's column holds the forward; the others are placeholders (``slots`` leaves them out)
            pad = torch.zeros(batch.size, len(views), device=part.value.device)
            full = torch.cat([pad[:, :j], part.value, pad[:, j + 1:]], dim=1)
            ent = None
            if part.entropy is not None:
                ent = torch.zeros_like(full)
                ent[:, j:j + 1] = part.entropy
            return self.loss(ctx, batch, LogLik(full, ent), iteration, slots=[j])
        return backward_each_view(views, slot_loss, loss_scale, runner=ctx.services.run_unit)


@register_algorithm
class EGSPOSA(EGSPO):
    """EGSPO with stepwise advantages: R - r(greedy one-step denoise of the trained state), group-centred."""
    name = "egspo_sa"
    paper = PaperSettings(
        lr=3e-5, grad_clip=0.2, temperature=0.9, lora={"r": 128, "alpha": 64}, published_code=True,
        source="vishnutez/egspo-dllm-rl egspo/train.sh (LEARNING_RATE, TEMPERATURE, LAMBDA1=0.5, NORMALIZE_RETURNS), "
               "egspo/slurm_scripts/train.yaml (max_grad_norm, lora_r, lora_alpha); gsm8k only")
    config_class = EGSPOSAConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional",)
    undefined: ClassVar[dict[str, str]] = {
        **EGSPO.undefined,
        "block_causal": "its value estimate r(x0_hat(s_t)) rewards the one-step greedy denoise of the *whole* answer; "
                        "a block model's step predicts only its current block, and predicting later blocks from a "
                        "partly masked one is a state the block factorisation never trains (its blocks condition on "
                        "a clean prefix), so x0_hat has no block-model form; plain egspo trains block models"}

    @property
    def frozen_models(self) -> tuple[str, ...]:  # the greedy one-step denoise is the pre-update policy's
        return ("policy",)

    def score_frozen(self, ctx: StepContext, batch: RLBatch, lend, micro_batch_size: int) -> StepRewards:
        """``StepRewards.rewards [B, K]``: the reward of the greedy one-step denoise of every trained state (one no-grad
        forward per slot and micro-batch, one reward call for all), before any update."""
        score = ctx.services.score_completions
        if score is None:
            raise ValueError("egspo_sa rewards the one-step denoise of its trained states: the trainer must provide "
                             "ctx.services.score_completions(batch, completion_ids [N, Lc], sample_index [N])")
        st, mask_id = batch.state, ctx.adapter.mask_token_id
        preds = []
        with lend("policy") as policy:
            for it in range(self.config.inner_iterations):
                for view in batch.views[it]:
                    Lc = batch.completion_ids.shape[1]
                    parts = [greedy_denoise(policy, view.select(idx), Lc, mask_id)
                             for idx in torch.arange(batch.size).split(max(1, micro_batch_size))]
                    preds.append(torch.cat(parts))
        x0 = torch.stack(preds, 1)  # [B, K, Lc]
        rows, slots = (st.steps >= 0).nonzero(as_tuple=True)
        rewards = batch.rewards.float()[:, None].repeat(1, st.steps.shape[1])  # untrained slots: r = R (no signal)
        if rows.numel():
            values = torch.as_tensor(score(batch, x0[rows, slots], rows), dtype=torch.float32)
            rewards[rows, slots] = values.to(rewards.device)
        return StepRewards(rewards)
