"""MDPO: masked diffusion policy optimisation on the sampler's own states (He et al. 2025; algorithms.md section 5).

The rollout records its trajectory (MDPO's ``record``: ``Record(trajectory=True)``): for every denoising step s the
input state ``x^(s)`` and the step's prediction ``x0^(s)`` (every masked position filled by the sampler's pick, the
rest kept) with per-token confidences ``c^(s)`` (the running confidence with RCR).

* Rewards on every intermediate prediction: ``r_s = R(x0^(s))`` (``ctx.services.score_completions``).
* Step advantages ``a_s = (r_s - r_{s-1}) + 1 + mean_{u>s} r_u`` (``r_{-1} = 0``; the last step uses ``r_{T-1}``),
  z-scored per step across each group: ``(a - mean) / (std + 1e-4)`` with the unbiased std, as the reference.
* The ``sample_train_steps`` (16) steps with the largest ``sum_batch |A_s|`` are trained, the same for the batch.
* At a selected step the targets are the positions masked in ``x^(s)``, the labels ``x0^(s)``, scored under
  ``pi(. | x^(s))`` with logits divided by ``temperature`` (the rollout temperature, 0.1). Per step
  ``L_s = sum_{b,k} [-min(rho A_s, clip(rho) A_s) lambda_{b,s} + beta KL2] c_k / N_s`` with
  ``lambda_{b,s} = L / (#masked_{b,s} + 1e-4)`` (the 1/t weight), ``N_s`` the masked tokens of step slot s over the
  step's batch, and ``L = sum_s L_s`` (the reference backpropagates each step's loss separately and accumulates).

Defaults follow ``recipes/LLaDA-Instruct/mdpo/config_demo.yaml`` (G 4, beta 0, eps 0.2, mu 1, temperature 0.1,
128 steps, gen = block = 512, 16 train steps; RCR is an inference flag of the sampler, ``rollout.sampler.rcr``).
Deviations: ``N_s`` is global over the step's batch instead of per micro-batch; with several data-parallel ranks each
rank selects its own top steps (slot j pools every rank's j-th step). Dream's shifted logits are handled by the
shared log-prob code.

ICFW curation (``icfw: true``, the reference's ``incremental_training`` / ``_incremental_data_selection``): before the
first step and again after every pass over the chosen prompts, each training prompt gets one rollout with the
recipe's sampler at ``icfw_temperature`` (greedy) recording its trajectory; its final answer and every intermediate
prediction ``x0^(s)`` are rewarded, and training uses only the prompts that were correct (reward >= ``icfw_correct``)
at some step but are wrong at the end ("answer backslide"). No such prompt: all prompts until the next selection.

Masked-diffusion models only, with single-block rollouts (``block_length = gen_length``). MDPO's learning signal is
the reward of every intermediate *whole-answer* prediction ``x0^(s)``; a step that decodes one block predicts only
that block, so ``R(x0^(s))`` is undefined until the last block. That is why a masked model needs single-block
rollouts, and it is why block-diffusion models (SDAR, LLaDA2) are not supported: their sampler's steps always decode
one block of the model's fixed block size (the recorded trajectory holds the mask id, confidence 0, at every later
block), and a block model cannot predict later blocks from a partly masked current block without leaving its
training distribution (the block NELBO always conditions on a clean prefix).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..collectives import agree_max
from ..diffusion.logprob import score_targets
from ..rollout.config import Record
from .advantages import group_zscore_unbiased
from .base import StepContext, cost
from .batch import Advantages, LogLik, RLBatch, View
from .common.scoring import backward_each_view
from .common.views import prompt_completion_view
from .grpo import AdvantageMode, GRPOAlgorithm, GRPOConfig
from .losses import clipped_surrogate, kl_penalty
from .paper import GridAdjust, LrDeparture, PaperSettings
from .registry import register_algorithm


@dataclass
class MDPOConfig(GRPOConfig):
    name: str = "mdpo"
    clip_low: float = 0.2
    beta: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k2"
    advantage: AdvantageMode = "mean_std"  # per step, with advantage_eps and the unbiased std
    advantage_eps: float = 1e-4
    sample_train_steps: int = cost(16, "trained_steps")
    temperature: float = 0.1  # logits / temperature when scoring (the reference reuses the rollout temperature)
    confidence_weight: bool = True  # weight each token by the sampler's confidence c_k
    # ICFW curation ("incremental_training"): train only on prompts whose greedy rollout was correct at an
    # intermediate step but is wrong at the end (answer backslide), re-selected after every pass over them.
    icfw: bool = False
    icfw_correct: float = 1.0  # a reward >= this is "correct" (the reference's verify_fn is a boolean)
    icfw_temperature: float = 0.0  # _incremental_data_selection decodes greedily (0.1 for Dream)

    def __post_init__(self):
        super().__post_init__()
        if self.icfw_temperature < 0:
            raise ValueError(f"icfw_temperature must be >= 0, got {self.icfw_temperature}")
        if self.sample_train_steps < 1:
            raise ValueError(f"sample_train_steps must be >= 1, got {self.sample_train_steps}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (logits are divided by it), got {self.temperature}")


# ----------------------------------------------------------------------------------------------------------
# Pure functions (tested directly)
# ----------------------------------------------------------------------------------------------------------


def step_advantages_raw(rewards: torch.Tensor) -> torch.Tensor:
    """``a_s = (r_s - r_{s-1}) + 1 + mean_{u>s} r_u`` for rewards ``[B, T]`` (last step: ``+ r_{T-1}``)."""
    r = rewards.double()
    B, T = r.shape
    prev = torch.cat([torch.zeros(B, 1, dtype=r.dtype, device=r.device), r[:, :-1]], dim=1)
    suffix = r.flip(1).cumsum(1).flip(1)  # sum_{u >= s} r_u
    counts = torch.arange(T - 1, 0, -1, dtype=r.dtype, device=r.device)  # T-1-s future steps
    future = torch.cat([(suffix[:, 1:] / counts), r[:, -1:]], dim=1)
    return (r - prev + 1.0 + future).float()


def top_steps(advantages: torch.Tensor, valid: torch.Tensor, k: int) -> list[int]:
    """The k step indices with the largest ``sum_batch |A_s|`` (steps no row took count 0), in that order."""
    score = (advantages.abs() * valid.float()).sum(0)
    return torch.topk(score, k=min(k, score.numel())).indices.tolist()


def answer_backslide(step_correct: torch.Tensor, valid: torch.Tensor, final_correct: torch.Tensor) -> torch.Tensor:
    """Bool ``[N]``: correct at some recorded step (``step_correct``/``valid`` ``[N, S]``) but wrong at the end --
    the ICFW samples (``_incremental_data_selection``: some intermediate answer verifies, the last one does not)."""
    return (step_correct.bool() & valid.bool()).any(1) & ~final_correct.bool()


def trajectory_fields(batch: RLBatch):
    """(states, x0, confidence, valid) of the batch's recorded trajectory."""
    t = batch.trajectory
    if t is None:
        raise ValueError("MDPO trains on the sampler's intermediate states, but the batch carries no recorded "
                         "trajectory (its rollout must record one: Record(trajectory=True), MDPO's record)")
    return t.states, t.x0, t.confidence, t.valid.bool()


@dataclass
class MDPOState:
    """MDPO's ``batch.state``: each step's reward ``[B, S]`` and advantage ``[B, S]``, and the trained steps (the
    ``sample_train_steps`` largest by ``sum |A_s|``, padded with -1 to the count every rank runs)."""
    step_rewards: torch.Tensor
    step_advantages: torch.Tensor
    steps: list


# ----------------------------------------------------------------------------------------------------------


@register_algorithm
class MDPO(GRPOAlgorithm):
    """The sampler's own intermediate states: logp of each step's prediction at its masked positions, 1/t-weighted."""
    name = "mdpo"
    paper = PaperSettings(
        lr=1e-5, grad_clip=1.0, temperature=0.1,
        published_code=True,
        source="autonomousvision/mdpo recipes/LLaDA-Instruct/mdpo/config_demo.yaml (learning_rate, temperature; no max_grad_norm: the HF Trainer default 1.0); no Sudoku script")
    grid = GridAdjust("MDPO rewards every step's whole-answer prediction: single-block rollouts with the trajectory recorded "
                      "(docs/algorithms/mdpo.md); its logit temperature = the rollout temperature (reference)",
                      single_block=True, sampler={"block_stop": False}, rollout_micro_batch=1)
    departure = LrDeparture(
        0.1,
        "at its paper ratio (10x Coupled-GRPO's lr, 1e-3 on the tiny LLaDA) the training reward oscillated "
        "between 0.0 and 0.67 with gradient norms near 27, and the held-out score fell 40.6 -> 36.5 %; at 1e-4 "
        "(factor 0.1) it rose 40.6 -> 58.2 (seed 0, 100 held-out puzzles, docs/comparison.md).",
        ("lazy-sudoku-llada-sft",), "docs/comparison.md")
    config_class = MDPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional",)
    undefined: ClassVar[dict[str, str]] = {
        "encoder_decoder": "MDPO replays the masked sampler's intermediate states (which tokens are still masked at each "
                           "step) and rewards each step's prediction; the uniform-noise canvas sampler has no absorbing "
                           "states (every pass re-noises what it does not accept) and its running-confidence remasking "
                           "has no uniform-noise analogue"}

    @property
    def mc_samples(self) -> int:
        return self.config.sample_train_steps

    @property
    def record(self) -> Record:  # MDPO trains on the rollout's intermediate states
        return Record(trajectory=True)

    # --- ICFW curation (``incremental_training``) ----------------------------------------------------------
    @property
    def curates_prompts(self) -> bool:
        return self.config.icfw

    def select_prompts(self, ctx: StepContext, model, prompts: list, uids: list[int]) -> list[int]:
        """One rollout per prompt with the recipe's sampler at ``icfw_temperature``, recording its trajectory; every
        intermediate prediction ``x0^(s)`` and the final completion are rewarded; keep the answer backslides."""
        from ..diffusion.noise import STREAM_ROLLOUT, derive_seed
        cfg = self.config
        if not prompts:
            return []
        sampler = dataclasses.replace(ctx.services.rollout_sampler, temperature=cfg.icfw_temperature)
        score = ctx.services.score_ids
        seeds = [derive_seed(ctx.seed, STREAM_ROLLOUT, "icfw", ctx.step, u) for u in uids]
        ro = ctx.services.generate(model, [p.input_ids for p in prompts], sampler, n=1, seeds=seeds, record=self.record)
        examples = [p.example for p in prompts]
        final = score(ro.completion_ids, examples, ro.stop_token_ids)
        x0, valid = ro.trajectory.x0, ro.trajectory.valid.bool()
        rows, steps = valid.nonzero(as_tuple=True)
        step_scores = torch.zeros(valid.shape, device=final.device)
        step_scores[rows, steps] = score(x0[rows, steps], [examples[int(r)] for r in rows], ro.stop_token_ids).to(final.device)
        keep = answer_backslide(step_scores >= cfg.icfw_correct, valid, final >= cfg.icfw_correct)
        return keep.nonzero().flatten().tolist()

    # --- per-step rewards and advantages (computed once, before the views) -----------------------------
    deterministic_views = True  # the views replay the recorded states of the selected steps

    def step_rewards(self, ctx: StepContext, batch: RLBatch) -> torch.Tensor:
        _, x0, _, valid = trajectory_fields(batch)
        score = ctx.services.score_completions
        if score is None:
            raise ValueError("MDPO scores every intermediate prediction: the trainer must provide "
                             "ctx.services.score_completions(batch, completion_ids [N, Lc], sample_index [N])")
        B, S, Lc = x0.shape
        rows, steps = valid.nonzero(as_tuple=True)
        values = torch.as_tensor(score(batch, x0[rows, steps], rows), dtype=torch.float32).to(x0.device)
        rewards = torch.zeros(B, S, device=x0.device)
        rewards[rows, steps] = values
        # A row that finished early keeps its final prediction: repeat its last reward over the padded steps.
        last = (valid.long().sum(1) - 1).clamp_min(0)
        idx = torch.minimum(torch.arange(S, device=x0.device)[None].expand(B, S), last[:, None])
        return rewards.gather(1, idx)

    def prepare(self, ctx: StepContext, batch: RLBatch) -> MDPOState:
        states, x0, _, valid = trajectory_fields(batch)
        rewards = self.step_rewards(ctx, batch)
        adv = group_zscore_unbiased(step_advantages_raw(rewards), batch.group, self.config.advantage_eps)
        steps = top_steps(adv, valid, self.config.sample_train_steps)
        (k,) = agree_max([len(steps)], states.device)  # every rank runs the same number of forwards
        return MDPOState(rewards, adv, steps + [-1] * (k - len(steps)))  # -1: a padding slot without targets

    def advantages(self, ctx: StepContext, batch: RLBatch) -> Advantages:
        adv = batch.state.step_advantages
        cols = [adv[:, s] if s >= 0 else torch.zeros_like(adv[:, 0]) for s in batch.state.steps]
        # [B, k]: the advantage of each trained step slot
        return Advantages(torch.stack(cols, dim=1), torch.ones(batch.size, device=adv.device))

    # --- views: one per selected step --------------------------------------------------------------------
    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        states, x0, conf, valid = trajectory_fields(batch)
        mask_id = ctx.adapter.mask_token_id
        views = []
        for s in batch.state.steps:
            if s < 0:
                state, pred, c, targets = batch.completion_ids, batch.completion_ids, None, None
            else:
                state, pred, c = states[:, s], x0[:, s], conf[:, s]
                targets = (state == mask_id) & valid[:, s:s + 1]
                # A masked position the step made no prediction for (confidence 0: outside the sampler's block);
                # the mask id *predicted* by the model (confidence > 0) is a legitimate label.
                if bool(((pred == mask_id) & (c <= 0))[targets].any()):
                    raise ValueError("MDPO needs a prediction for every masked position at every step: use single-"
                                     "block rollouts (rollout.sampler.block_length = gen_length)")
            if targets is None:
                targets = torch.zeros_like(state, dtype=torch.bool)
            # labels = the step's prediction x0^(s)
            view = prompt_completion_view(batch.prompt_ids, batch.prompt_mask, pred, state, targets)
            if c is not None:
                view.info["confidence"] = c.float()
            views.append(view)
        return views

    # --- likelihood: one [B, Lc] block of slots per selected step ------------------------------------------
    def log_likelihood(self, ctx: StepContext, model, batch: RLBatch, views: list[View], *, with_entropy: bool = False) -> LogLik:
        values, ents = [], []
        for v in views:
            logp, ent = score_targets(model, v.input_ids, v.targets, v.labels, attention_mask=v.attention_mask,
                                      chunk_size=ctx.chunk_size, temperature=self.config.temperature,
                                      with_entropy=with_entropy)
            values.append(logp.gather(1, v.score_index))
            if ent is not None:
                ents.append(ent.gather(1, v.score_index))
        return LogLik(torch.cat(values, dim=1), torch.cat(ents, dim=1) if ents else None)

    # --- loss ----------------------------------------------------------------------------------------------
    def _slot_tensors(self, batch: RLBatch, views: list[View]):
        """Per slot (selected step): targets [B, k*Lc], lambda [B, k*Lc], confidence [B, k*Lc] and the sample's masked
        count of the step n [B, k*Lc]."""
        Lc = batch.completion_ids.shape[1]
        tgts, lams, confs, counts = [], [], [], []
        for v in views:
            t = v.targets.gather(1, v.score_index)
            n = t.float().sum(1, keepdim=True)
            tgts.append(t)
            lams.append((Lc / (n + 1e-4)).expand_as(t))
            counts.append(n.expand_as(t))
            c = v.info.get("confidence")
            confs.append(c if (c is not None and self.config.confidence_weight) else torch.ones_like(t, dtype=torch.float32))
        return torch.cat(tgts, 1), torch.cat(lams, 1), torch.cat(confs, 1), torch.cat(counts, 1)

    def normalizers(self, batch: RLBatch) -> dict[str, float]:
        active = batch.active.float()[:, None] > 0
        out = {"seqs": float(active.sum()), "samples": float(batch.size), "targets": 0.0}
        for v in batch.views[0]:
            out["targets"] += float((v.targets.gather(1, v.score_index) & active).sum())
        return out

    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int, slots=None):
        """``(1/S) sum_i sum_s sum_k lambda c (surrogate + beta KL) / (n_is + 1e-4)``: each sample's step token sum
        divided by that sample's masked count at the step (the reference's ``compute_loss`` of one sample), summed
        over the trained steps, then the mean over the step's S active samples (the reference's mean over devices).
        The per-sample sums are local and S is global, so the value does not depend on micro-batches or ranks."""
        cfg = self.config
        views = batch.views[iteration]
        Lc = batch.completion_ids.shape[1]
        k = len(views)
        tgt, lam, conf, count = self._slot_tensors(batch, views)
        tgt = tgt & (batch.active.float()[:, None] > 0)
        if slots is not None:  # restrict to some slots (per-view backward)
            keep = torch.zeros(k, dtype=torch.bool)
            keep[list(slots)] = True
            tgt = tgt & keep.repeat_interleave(Lc).to(tgt.device)[None]
        logp = current.value
        old, ref = self.old_and_ref(batch, current, iteration)
        logp_s = torch.where(tgt, logp, old.detach())  # placeholders outside the targets give ratio 1
        adv = batch.advantages.values.to(logp.device).repeat_interleave(Lc, dim=1)
        per_tok, ratio, clipped = clipped_surrogate(logp_s, old, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
                                                    cfg.logratio_clamp)
        per_tok = per_tok * lam
        metrics = {}
        n_all = max(ctx.norms.get("targets", 0.0), 1.0)
        if ref is not None:
            kl = kl_penalty(logp_s, torch.where(tgt, ref, logp_s.detach()), cfg.kl_estimator)
            per_tok = per_tok + cfg.beta * kl
            metrics["kl"] = float((kl.detach() * tgt).sum()) / n_all
        loss = (per_tok * conf * tgt / (count.to(per_tok.device) + 1e-4)).sum() / max(ctx.norms["seqs"], 1.0)
        metrics["clip_frac"] = float((clipped.float() * tgt).sum()) / n_all
        metrics["ratio_mean"] = float((ratio.detach() * tgt).sum()) / n_all
        if current.entropy is not None:
            metrics["entropy"] = float((current.entropy * tgt).sum()) / n_all
        return loss, metrics

    def backward(self, ctx: StepContext, model, batch: RLBatch, iteration: int, loss_scale: float = 1.0) -> dict[str, float]:
        """One forward + backward per selected step (as the reference), so only one step's graph is alive."""
        views = batch.views[iteration]
        Lc = batch.completion_ids.shape[1]

        def step_loss(j, view):
            part = self.log_likelihood(ctx, model, batch, [view], with_entropy=ctx.want_entropy)
            # Place this step's slots in the full [B, k*Lc] layout; the others hold the old log-probs (ratio 1).
            full = torch.zeros(part.value.shape[0], len(views) * Lc, device=part.value.device)
            full = torch.cat([full[:, :j * Lc], part.value, full[:, (j + 1) * Lc:]], dim=1)
            ent = None
            if part.entropy is not None:
                ent = torch.zeros_like(full)
                ent[:, j * Lc:(j + 1) * Lc] = part.entropy
            return self.loss(ctx, batch, LogLik(full, ent), iteration, slots=[j])
        return backward_each_view(views, step_loss, loss_scale, runner=ctx.services.run_unit)
