"""d-TreeRPO: tree-structured rollouts with bottom-up advantages (Pan et al. 2025, arXiv 2512.09675; code:
THU-BPM/d-TreeRPO ``dtreerpo_trainer.py``; the DARE port is yjyddq/DARE PR 16, ``dtreerpo_algos.py``).

**Rollout** (``collect``, ``dare.rollout.generate_tree``). Per prompt, ``trunks`` independent decodes run to the
first cut; every node then branches into ``branch_factor`` continuations at each later cut; the cuts split the
sampler's T denoising steps into ``levels`` equal segments (steps ``k T / levels``; the reference's contraction
factor s). Each level is one batched call of the rollout engine, so a tree's shared prefixes are decoded once.

**Advantages.** Leaf value = reward of the completed leaf; a node's value is the mean of its children's; a node's
local advantage is its value minus the mean value of its siblings (the other children of its parent, the other trunks
for level-0 nodes; 0 when it has none, so the advantage is the value itself, as the reference).

**Transitions.** Every node except the root gives one training row (a *segment*): its parent's partial state is the
input, the targets are the tokens the node committed in its segment (written by it -- ``step_map`` -- and masked in
the parent) up to the node's first stop token. One forward of the parent state scores them all (the paper's
single-forward estimate of the transition probability; block models use the ``[x_t ; x_0]`` layout with the parent's
state as x_t and the node's as x_0, so a block is scored from its segment-start state and the finished blocks before
it, with the sampler's block length). Loss per segment: the clipped surrogate averaged over its targets (eps 0.4), plus beta 0.01 k3 KL to the
reference; the mean over all segments of the step (the reference averages per micro-batch).

**Self-distillation** (time-scheduled, on by default as in the reference recipes): for the children of one parent
with a positive local advantage, weights ``softmax(A / tau(t))``; at each completion position the weighted children's
committed tokens form a target distribution q; the loss is ``lambda(t) * mean_(parent, position) KL(q || p(.|parent))``
with ``lambda(t) = lambda_max (e^(gamma t/T) - 1) / (e^gamma - 1)`` and ``tau(t) = tau_max (1 - t/T)^beta``. Since
every child of a parent is scored from the same parent state, ``log p(u | parent)`` is the children's own transition
log-prob of u: the term needs no extra forward. The mean is over the whole step's (parent, position) pairs.

Defaults follow ``dtreerpo/slurm_scripts/dtreerpo.yaml`` (T=4 branches, s=2, 4 trees per prompt, mu 12, eps 0.4,
beta 0.01, lr 3e-5 with LoRA r 128, reference sync every 64 steps with alpha 0.6, gen 256, block 32, 128 steps,
temperature 0.9).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .advantages import group_mean_std
from .base import StepContext, cost
from .batch import Advantages, LogLik, RLBatch, View, batch_field
from .common.views import completion_view, with_attention_blocks
from .grpo import Aggregation, GRPOAlgorithm, GRPOConfig
from .paper import GridAdjust, LrDeparture, PaperSettings
from .registry import register_algorithm


@dataclass
class DTreeRPOConfig(GRPOConfig):
    name: str = "dtreerpo"
    inner_iterations: int = cost(12, "iterations")  # num_iterations: 12
    clip_low: float = 0.4  # epsilon: 0.4
    beta: float = 0.01  # beta: 0.01 (k3 to the reference)
    aggregation: Aggregation = "seq_mean_token_mean"  # per segment: mean over its committed tokens; mean of segments
    ref_sync_every: int = 64  # sync_ref_model: True, ref_model_sync_steps: 64
    ref_sync_alpha: float = 0.6  # ref_model_mixup_alpha default
    trunks: int = 4  # num_tree_samples: children of the root (independent decodes of a prompt)
    branch_factor: int = 4  # tree_branch_factor (T): children of every other inner node
    levels: int = 2  # tree_contraction_factor (s): segments per path, cut at k * steps / s
    self_distillation: bool = True  # enable_self_distillation_loss: true
    sd_lambda_max: float = 3e-3
    sd_gamma: float = 2.0
    sd_tau_max: float = 2.0
    sd_beta: float = 0.7
    sd_horizon: int = 30000  # max_steps: the T of the lambda / tau schedules

    def __post_init__(self):
        super().__post_init__()
        for name in ("trunks", "branch_factor", "levels", "sd_horizon"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sd_tau_max <= 0 or self.sd_lambda_max < 0:
            raise ValueError("sd_tau_max must be > 0 and sd_lambda_max >= 0")

    @property
    def branching(self) -> list[int]:
        return [self.trunks] + [self.branch_factor] * (self.levels - 1)


# ----------------------------------------------------------------------------------------------------------
# Tree math (pure functions; tested on hand-made trees)
# ----------------------------------------------------------------------------------------------------------


def node_values(leaf_values: torch.Tensor, parents: list[torch.Tensor]) -> list[torch.Tensor]:
    """Values of every level's nodes, bottom-up: leaves keep their reward, a node takes its children's mean."""
    values = [None] * len(parents)
    values[-1] = leaf_values.double()
    for k in range(len(parents) - 1, 0, -1):
        mean, _, _ = group_mean_std(values[k], parents[k])  # per child: its parent's children mean
        parent_of = parents[k].to(mean.device)
        values[k - 1] = torch.zeros(int(parents[k - 1].numel()), dtype=mean.dtype, device=mean.device)
        values[k - 1][parent_of] = mean
    return values


def local_advantages(values: list[torch.Tensor], parents: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per level: node value minus the mean value of its siblings (same parent). An only child's sibling mean counts
    as 0 (its advantage is its value), as the reference."""
    out = []
    for v, p in zip(values, parents):
        mean, _, n = group_mean_std(v, p)
        others = torch.where(n > 1, (mean * n - v) / (n - 1).clamp_min(1.0), torch.zeros_like(v))
        out.append((v - others).float())
    return out


def segment_targets(child_step_map: torch.Tensor, parent_step_map: torch.Tensor, child_mask: torch.Tensor) -> torch.Tensor:
    """Tokens a node committed in its segment: written by it, not yet by its parent, up to its first stop token."""
    return (child_step_map >= 0) & (parent_step_map < 0) & child_mask.bool()


def sd_schedule(step: int, cfg: DTreeRPOConfig) -> tuple[float, float]:
    """(lambda(t), tau(t)) of the self-distillation loss at optimisation step t."""
    progress = min(1.0, max(0.0, step / cfg.sd_horizon))
    lam = cfg.sd_lambda_max * (math.exp(cfg.sd_gamma * progress) - 1.0) / (math.exp(cfg.sd_gamma) - 1.0)
    tau = max(cfg.sd_tau_max * max(0.0, 1.0 - progress) ** cfg.sd_beta, 1e-6)
    return lam, tau


def distillation_targets(tokens: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor, groups: torch.Tensor,
                         tau: float):
    """Self-distillation per token: ``(weight [B, L], log_q [B, L], pairs)``.

    Within each sibling group, children with A > 0 get ``softmax(A / tau)``; at position j the target distribution
    over tokens is q = the weights of the active children, renormalised. Child c's term at j is
    ``weight * (log_q - logp)`` with ``weight = w_c / W_j``, so the sum over a (group, j) pair is KL(q || p).
    ``pairs`` counts the (group, position) pairs with an active positive child.
    """
    B, L = tokens.shape
    weight = torch.zeros(B, L, dtype=torch.float64)
    log_q = torch.zeros(B, L, dtype=torch.float64)
    pairs = 0
    adv, tgt, tok = advantages.double().cpu(), targets.bool().cpu(), tokens.cpu()
    for g in torch.unique(groups.cpu()).tolist():
        idx = ((groups.cpu() == g) & (adv > 0)).nonzero().flatten()
        if idx.numel() == 0 or int((groups.cpu() == g).sum()) <= 1:
            continue
        w = torch.softmax(adv[idx] / tau, 0)
        active = tgt[idx]  # [K, L]
        W = (w[:, None] * active).sum(0)  # [L]
        pairs += int((W > 0).sum())
        share = torch.where(active, w[:, None] / W.clamp_min(1e-300)[None], torch.zeros_like(active, dtype=torch.float64))
        same = (tok[idx][:, None, :] == tok[idx][None, :, :]) & active[None] & active[:, None]  # [K, K, L]
        q = (share[None] * same).sum(1)  # q of each child's own token at each position
        weight[idx] = share
        log_q[idx] = torch.where(active, torch.log(q.clamp_min(1e-300)), torch.zeros_like(q))
    dev = tokens.device
    return weight.float().to(dev), log_q.float().to(dev), pairs


# ----------------------------------------------------------------------------------------------------------
# The method
# ----------------------------------------------------------------------------------------------------------


@dataclass
class TreeState:
    """d-TreeRPO's ``batch.tree`` (its ``collect``'s record of the rollout trees), one row per non-root tree node: its parent's state ``parent_ids [B, Lc]`` (all
    masked for level-0 nodes) and step map, the tokens the node committed in its segment ``segment_targets [B, Lc]``,
    its local advantage ``tree_advantages [B]`` and ``tree_level [B]``; the sampler's ``block_length``."""
    parent_ids: torch.Tensor
    parent_step_map: torch.Tensor
    segment_targets: torch.Tensor
    tree_advantages: torch.Tensor
    tree_level: torch.Tensor
    block_length: Optional[int] = None


@dataclass
class TreeAdvantages(Advantages):
    """The tree's local advantages with the self-distillation targets: per token ``sd_weight`` / ``sd_log_q``
    ``[B, L]`` (None without self-distillation), the step's (group, position) pairs and lambda(t)."""
    sd_weight: Optional[torch.Tensor] = None
    sd_log_q: Optional[torch.Tensor] = None
    sd_pairs: float = batch_field(0.0)
    sd_lambda: float = batch_field(0.0)


def segments_batch(tree, rewards: torch.Tensor, prompt_uids: torch.Tensor, mask_id: int, block_length=None) -> RLBatch:
    """One row per non-root node of ``tree``: the prompt, the node's state (``completion_ids``), its step map and
    value (``rewards``), and its ``TreeState`` (the parent's state and step map, the segment's targets, the node's
    local advantage).

    Ids are global: with S = nodes per tree + 1, node j of prompt u (level order) has ``uid = u S + 1 + j`` and the
    tree's root ``u S``; ``group`` = the parent's uid, so siblings share a group on every rank and in every chunk."""
    dev = tree.leaves.completion_ids.device
    values = node_values(rewards.to(dev), tree.parents)
    adv = local_advantages(values, tree.parents)
    per_prompt = [math.prod(tree.branching[:k + 1]) for k in range(len(tree.branching))]  # nodes per tree, by level
    S = sum(per_prompt) + 1
    parts: dict[str, list] = {k: [] for k in ("prompt_ids", "prompt_mask", "ids", "mask", "steps", "parent_ids",
                                              "parent_steps", "uid", "group", "level")}
    uids = []
    for k, level in enumerate(tree.levels):
        rows = torch.arange(level.completion_ids.shape[0], device=dev)
        base = prompt_uids.to(dev)[level.prompt_index.to(dev)] * S
        uid = base + 1 + sum(per_prompt[:k]) + rows % per_prompt[k]
        if k == 0:
            parent_ids = torch.full_like(level.completion_ids, mask_id)
            parent_steps = torch.full_like(level.step_map, -1)
            group = base
        else:
            prev = tree.levels[k - 1]
            parent_ids, parent_steps = prev.completion_ids[tree.parents[k]], prev.step_map[tree.parents[k]]
            group = uids[k - 1][tree.parents[k].to(dev)]
        uids.append(uid)
        for name, value in (("prompt_ids", level.prompt_ids), ("prompt_mask", level.prompt_mask.bool()),
                            ("ids", level.completion_ids), ("mask", level.completion_mask.bool()),
                            ("steps", level.step_map), ("parent_ids", parent_ids), ("parent_steps", parent_steps),
                            ("uid", uid), ("group", group), ("level", torch.full_like(rows, k))):
            parts[name].append(value.to(dev))
    cat = {k: torch.cat(v) for k, v in parts.items()}
    state = TreeState(cat["parent_ids"], cat["parent_steps"], segment_targets(cat["steps"], cat["parent_steps"], cat["mask"]),
                      torch.cat(adv), cat["level"], block_length)
    return RLBatch(uid=cat["uid"].long(), group=cat["group"], prompt_ids=cat["prompt_ids"], prompt_mask=cat["prompt_mask"],
                   completion_ids=cat["ids"], completion_mask=cat["mask"], step_map=cat["steps"],
                   rewards=torch.cat(values).float(), tree=state)


def _left_pad(t: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)


def concat_batches(parts: list[RLBatch], pad_id: int) -> RLBatch:
    """Row-wise concatenation of segment batches (prompts re-padded on the left to a common width)."""
    if len(parts) == 1:
        return parts[0]
    P = max(b.prompt_ids.shape[1] for b in parts)

    def cat(get):
        return torch.cat([get(b) for b in parts])
    state = TreeState(*(cat(lambda b, f=f: getattr(b.tree, f)) for f in
                        ("parent_ids", "parent_step_map", "segment_targets", "tree_advantages", "tree_level")),
                      block_length=parts[0].tree.block_length)
    return RLBatch(uid=cat(lambda b: b.uid), group=cat(lambda b: b.group),
                   prompt_ids=cat(lambda b: _left_pad(b.prompt_ids, P, pad_id)),
                   prompt_mask=cat(lambda b: _left_pad(b.prompt_mask, P, False)),
                   completion_ids=cat(lambda b: b.completion_ids), completion_mask=cat(lambda b: b.completion_mask),
                   step_map=cat(lambda b: b.step_map), rewards=cat(lambda b: b.rewards), tree=state)


@register_algorithm
class DTreeRPO(GRPOAlgorithm):
    """Tree rollouts; leaf rewards averaged up the tree; segment transitions scored from the parent's state."""
    name = "dtreerpo"
    config_class = DTreeRPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal")
    undefined: ClassVar[dict[str, str]] = {
        "encoder_decoder": "its segments are the tokens committed between a node and its child; the canvas sampler "
                           "(uniform noise) commits nothing at a step (every pass re-noises what it does not accept), "
                           "so a partial canvas is no node state to branch from"}
    paper = PaperSettings(
        lr=3e-5, grad_clip=0.2, temperature=0.9, lora={"r": 128, "alpha": 64},
        published_code=True,
        source="THU-BPM/d-TreeRPO dtreerpo/slurm_scripts/dtreerpo.yaml (learning_rate, max_grad_norm, use_peft, lora_r 128, lora_alpha 64; the "
               "same file for every task script), diffu_grpo_config.py (temperature 0.9)")
    grid = GridAdjust("d-TreeRPO's tree replaces the group: 2 trunks x 4 branches = 8 leaves per prompt, the unified "
                      "group size (the authors' 4 x 4 = 16; docs/algorithms/dtreerpo.md)",
                      algorithm={"trunks": 2, "branch_factor": 4})
    departure = LrDeparture(
        0.5,
        "at the unscaled ratio (3e-3 with LoRA r 128) the tiny LLaDA learned but the tiny SDAR did not: "
        "seeds 0 and 2 each had one update step with KL to the reference ~1 (0.99, 1.11; every other "
        "step <= 0.05) and a gradient-norm spike (0.13, 0.42), and seed 2 then stopped its greedy answers "
        "after `<` in 102 of 200 (held-out 80.3 / 84.5 / 36.8 % from 79.1); at 1.5e-3 (factor 0.5) the "
        "same SDAR seeds stayed within KL 0.063 and gained (87.0 / 85.8 / 85.5), and the LLaDA seeds "
        "gained about as at the full ratio (54.4 / 56.7 / 59.8 against 55.0 / 59.1 / 59.9 from "
        "41.0; 200 held-out puzzles, docs/comparison.md).",
        ("lazy-sudoku-llada-sft", "lazy-sudoku-sdar-sft"), "docs/algorithms/dtreerpo.md")

    def check_rollout(self, sampler, adapter) -> None:
        for key, bad in (("rcr", sampler.rcr), ("editing_threshold", sampler.editing_threshold is not None)):
            if bad:
                raise ValueError(f"dtreerpo branches paused rollouts; rollout.sampler.{key} cannot be paused")

    def cut_steps(self, model, sampler) -> list[int]:
        """Schedule steps where the tree branches: k * T / levels (the reference's branch points), T = total steps."""
        from ..rollout import steps_per_block
        total = steps_per_block(model, sampler) * -(-sampler.gen_length // sampler.block_length)
        s = self.config.levels
        cuts = sorted({int(k * total / s) for k in range(1, s)})
        if len(cuts) != s - 1 or (cuts and cuts[0] < 1):
            raise ValueError(f"dtreerpo: levels={s} segments need at least {s} denoising steps (the sampler has {total})")
        return cuts

    # --- (1) rollout, (2) reward -------------------------------------------------------------------------
    def collect(self, ctx: StepContext, prompts, model) -> tuple[RLBatch, dict]:
        services = ctx.services
        sampler, seeds, n = services.rollout_sampler, services.prompt_seeds(ctx, prompts), prompts.size
        chunk = services.rollout_micro_batch_size or n  # prompts per tree call
        cuts = self.cut_steps(model, sampler)
        parts, leaf_rewards, leaf_masks, nfe, t_roll, t_rew = [], [], [], 0, 0.0, 0.0
        for s in range(0, n, chunk):
            part = prompts.select(torch.arange(s, min(n, s + chunk)))
            t0 = time.perf_counter()
            tree = services.decode_tree(part["prompt_tokens"], seeds[s:s + chunk], model, sampler,
                                        self.config.branching, cuts)
            if tree is None:  # a planned step (dare.plan) decodes the trees of its first prompts only
                continue
            t1 = time.perf_counter()
            leaves = tree.leaves
            rewards = services.score_texts(leaves.texts(services.tokenizer),
                                           [part["examples"][int(i)] for i in leaves.prompt_index.cpu()])
            t_roll, t_rew = t_roll + t1 - t0, t_rew + time.perf_counter() - t1
            parts.append(segments_batch(tree, rewards, part["uid"], model.adapter.mask_token_id, sampler.block_length))
            leaf_rewards.append(rewards)
            leaf_masks.append(leaves.completion_mask.cpu())
            nfe += tree.nfe
        pad = model.adapter.pad_token_id if model.adapter.pad_token_id is not None else model.adapter.eos_token_id
        batch = concat_batches(parts, pad)
        batch.stop_token_ids, batch.nfe = leaves.stop_token_ids, nfe
        metrics = services.rollout_metrics(torch.cat(leaf_rewards), torch.cat(leaf_masks), nfe, t_roll, t_rew)
        metrics["segments"] = services.all_reduce_sums({"segments": float(batch.size)})["segments"]
        return batch, metrics

    # --- (3) corruption ----------------------------------------------------------------------------------
    deterministic_views = True  # the parent's state is the input: nothing is drawn

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        """The parent's state as input, the segment's committed tokens as targets."""
        tree = batch.tree
        view = completion_view(ctx, batch, tree.parent_ids, tree.segment_targets.bool())
        block = tree.block_length if tree.block_length is not None else ctx.adapter.block_size
        if ctx.adapter.is_block_causal and block != ctx.adapter.block_size:  # score the sampler's attention
            view = with_attention_blocks(view, block)
        return [view]

    # --- (4) advantages ----------------------------------------------------------------------------------
    def advantages(self, ctx: StepContext, batch: RLBatch) -> TreeAdvantages:
        tree = batch.tree
        adv = tree.tree_advantages.float()
        active = torch.ones(batch.size, device=adv.device)
        cfg = self.config
        if not cfg.self_distillation:
            return TreeAdvantages(adv, active)
        lam, tau = sd_schedule(ctx.step, cfg)
        w, log_q, pairs = distillation_targets(batch.completion_ids, tree.segment_targets, adv, batch.group, tau)
        return TreeAdvantages(adv, active, w, log_q, float(pairs), lam)

    # --- (5) loss ----------------------------------------------------------------------------------------
    def loss_mask(self, batch: RLBatch) -> torch.Tensor:
        return batch.tree.segment_targets.float() * batch.active.float()[:, None]

    def normalizers(self, batch: RLBatch) -> dict[str, float]:
        out = super().normalizers(batch)
        if self.config.self_distillation:
            out["sd_pairs"] = batch.advantages.sd_pairs
        return out

    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int):
        loss, metrics = super().loss(ctx, batch, current, iteration)
        adv = batch.advantages
        if self.config.self_distillation and adv.sd_weight is not None:
            pairs = max(ctx.norms.get("sd_pairs", 0.0), 1.0)
            w = adv.sd_weight.to(current.value.device)
            kl = (w * (adv.sd_log_q.to(w.device) - current.value)).sum() / pairs
            loss = loss + adv.sd_lambda * kl
            metrics["sd_kl"] = float(kl.detach())
        return loss, metrics
