"""IGPO: Inpainting-Guided Policy Optimization (Zhao et al., ICLR 2026, arXiv 2509.10396; code:
facebookresearch/igpo ``trainer_igpo.py``, ``utils/generate.py``; docs/algorithms/igpo.md).

**Rollout** (``collect``). The group rollout and its rewards, then, for every group whose completions are all wrong
(reward below ``correct_reward``: zero reward variance, so every advantage would be 0), a second decode of the group
with inpainting hints: each of its G rollouts gets its own hint ratio ``~ U[hint_ratio_low, hint_ratio_high]`` and
chunks of the example's reference solution (its template's gold completion) fixed in its completion
(``common.hints``, ``dare.rollout.generate(hints=...)``). Up to ``max_replacements`` hinted rollouts that are
correct (a random subset when more are) replace the group's first rollouts; the group then has reward variance. The
step's reward metrics stay those of the policy's own first-round rollouts.

**Likelihood** (``corrupt``): d1's one-step estimate without prompt masking (the reference's ``d1_masking``): every
completion position that is not a hint is masked, the hints stay in the input as clean context, one forward, log-probs
read at the generated positions up to the first stop token. Hint tokens are never scored: the policy is trained on
what it generated, given the hints it saw. Nothing is drawn, so every inner iteration scores one view.

``score_hints: true`` is the reference's own treatment instead: hints masked and scored like generated tokens, with its
entropy filter keeping in the loss only the ``hint_entropy_keep`` highest-entropy hint positions of each sequence
(entropies of the rollout policy, computed once in ``collect``).

**Loss**: ``A = r - mean`` (no std); with ``sequence_ratio`` (the released ``use_gspo``) every token's ratio is the
sequence's ``exp(mean(logp) - mean(old))`` over its scored positions, else the token ratio; PPO clip 0.2 / 0.2,
per-token k3 KL (beta 0.01) to the reference, token mean over the step. Defaults: ``run_igpo.sh`` (docs).

Uniform-noise encoder-decoder models (DiffusionGemma) are not supported: their canvas sampler has no committed
positions to hold hints (``dare.rollout.generate`` refuses them there), so the hinted round has no rollout.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .base import StepContext, cost
from .batch import LogLik, RLBatch, View
from .common.hints import ChunkHints, chunk_hint_canvas, hint_ratios, reference_tokens
from .common.views import completion_view
from .grpo import GRPOAlgorithm, GRPOConfig
from .losses import sequence_ratio_token_loss
from .paper import PaperSettings
from .registry import register_algorithm


@dataclass
class IGPOConfig(GRPOConfig):
    name: str = "igpo"
    inner_iterations: int = cost(4, "iterations")  # run_igpo.sh l.5 num_iterations=4
    clip_low: float = 0.2  # run_igpo.sh l.143 --epsilon_low 0.2
    clip_high: Optional[float] = 0.2  # l.144 --epsilon_high 0.2
    beta: float = 0.01  # l.142 --beta 0.01 (per-token k3, trainer_igpo.py l.633-639)
    # l.5 use_gspo=true -> l.157: every token's ratio is exp(mean log-ratio) of its sequence, trainer_igpo.py l.651-666
    sequence_ratio: bool = True
    # A completion is correct when its reward is at least this (dare's task rewards give a correct answer 1; the
    # reference tests its correctness reward == 0 for "wrong", trainer_igpo.py l.1281-1286).
    correct_reward: float = 1.0
    max_replacements: int = 4  # l.5 max_replacement=4 -> l.156
    hint_ratio_low: float = 0.2  # l.5 inpaint_chunk_ratio_low=0.2 -> l.154
    hint_ratio_high: float = 0.6  # l.5 inpaint_chunk_high_initial_ratio=0.6 -> l.153 (constant: no decay is coded)
    hint_min_chunk: int = 5  # l.147 --min_chunk_size 5
    hint_max_chunk: int = 10  # l.148 --max_chunk_size 10
    hint_free_tail: int = 30  # utils/generate.py l.502: the last 30 completion slots never hold hints
    hint_max_spacing: int = 100  # utils/diffu_grpo_config.py l.483 (passed at trainer_igpo.py l.877)
    hint_max_stretch: float = 1.5  # utils/generate.py l.522-524: stretch clamp [1, 1.5]
    # The reference masks and scores hint tokens like generated ones and keeps the top 20 % entropy hint tokens in
    # the loss mask (trainer_igpo.py l.1764-1827, run_igpo.sh l.5 entropy_clipping_ratio_inpaint=0.2). dare's
    # default never scores hints (docs/algorithms/igpo.md, deviations).
    score_hints: bool = False
    hint_entropy_keep: float = 0.2

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.hint_ratio_low <= self.hint_ratio_high <= 1.0:
            raise ValueError(f"IGPO needs 0 <= hint_ratio_low <= hint_ratio_high <= 1, got {self.hint_ratio_low}, "
                             f"{self.hint_ratio_high}")
        if self.max_replacements < 0:
            raise ValueError(f"max_replacements must be >= 0, got {self.max_replacements}")
        if not 0.0 < self.hint_entropy_keep <= 1.0:
            raise ValueError(f"hint_entropy_keep must be in (0, 1], got {self.hint_entropy_keep}")
        self.chunks()  # validates the chunk settings

    def chunks(self) -> ChunkHints:
        return ChunkHints(self.hint_min_chunk, self.hint_max_chunk, self.hint_free_tail, self.hint_max_spacing,
                          self.hint_max_stretch)


@dataclass
class ScoredHints:
    """IGPO's ``batch.frozen`` with ``score_hints``: ``hints [B, Lc]`` the hint positions the loss keeps (the entropy
    filter's, by the rollout policy's entropies; ``score_frozen``). The hints themselves are the rollout's
    ``batch.hint_mask``."""
    hints: torch.Tensor


def hint_entropy_filter(candidates: torch.Tensor, entropy: torch.Tensor, keep: float) -> torch.Tensor:
    """Bool ``[B, L]``: per row, the ``max(1, int(n * keep))`` highest-entropy of its ``n`` candidate positions (the
    reference's top-k over the candidates in position order; rows without candidates keep none)."""
    out = torch.zeros_like(candidates, dtype=torch.bool)
    for b in range(candidates.shape[0]):
        pos = candidates[b].nonzero().flatten()
        if pos.numel():
            k = max(1, int(pos.numel() * keep))
            out[b, pos[torch.topk(entropy[b][pos], k, largest=True).indices]] = True
    return out


@register_algorithm
class IGPO(GRPOAlgorithm):
    """GRPO; all-wrong groups are decoded again with reference chunks fixed in the canvas, correct ones swapped in."""
    name = "igpo"
    config_class = IGPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal")
    undefined: ClassVar[dict[str, str]] = {
        "encoder_decoder": "the hinted rollouts need tokens fixed in the canvas; DiffusionGemma's uniform-noise canvas "
                           "sampler re-draws every position it does not accept by the whole canvas's entropy bound, so "
                           "it has no committed positions to hold hints (the likelihood alone would have a form)"}
    paper = PaperSettings(
        lr=5e-7, grad_clip=0.2, temperature=1.2, lora={"r": 128, "alpha": 64}, published_code=True,
        source="facebookresearch/igpo run_igpo.sh l.5 (lr=5e-7, temperature=1.2; --learning_rate/--temperature "
               "l.141/l.146), train.yaml l.24 (max_grad_norm 0.2), l.9-10 (lora_r 128, lora_alpha 64)")
    deterministic_views = True  # nothing is drawn: every non-hint completion position is masked

    # --- (1) rollout with the hinted round, (2) reward ---------------------------------------------------------
    def collect(self, ctx: StepContext, prompts, model) -> tuple[RLBatch, dict]:
        services = ctx.services
        batch, metrics = services.collect(ctx, prompts, model, record=self.record)
        if batch.hint_mask is None:  # no hints in the first round: the hinted rows bring theirs
            batch.hint_mask = torch.zeros_like(batch.completion_ids, dtype=torch.bool)
        t0 = time.perf_counter()
        counts = self._hinted_round(ctx, prompts, model, batch)
        metrics["rollout_time"] += time.perf_counter() - t0
        metrics["nfe"] += counts.pop("nfe")
        metrics.update(services.all_reduce_sums(counts))
        return batch, metrics

    def _hinted_round(self, ctx: StepContext, prompts, model, batch: RLBatch) -> dict:
        """Regenerate the all-wrong groups with hints and swap correct hinted rollouts in (``batch``, its hint mask
        included, is updated in place). Returns the step's counts of this rank."""
        from ..collectives import agree_max
        from ..diffusion.noise import derive_seed, keyed_generator
        from ..rewards.speed import rollout_info
        cfg, services = self.config, ctx.services
        sampler = services.rollout_sampler
        G = services.group_size
        uids = prompts["uid"].tolist()
        correct = (batch.rewards.float() >= cfg.correct_reward).cpu()
        group = batch.group.cpu()
        rows_of = {u: (group == u).nonzero().flatten() for u in uids}  # the group's rows, in sample order
        wrong = [j for j, u in enumerate(uids) if not bool(correct[rows_of[u]].any())]
        refs = {j: reference_tokens(prompts["examples"][j], services.tokenizer, services.dataset,
                                    batch.stop_token_ids) for j in wrong}
        todo = [j for j in wrong if refs[j] is not None]
        counts = {"igpo_all_wrong_groups": float(len(wrong)), "igpo_hinted_groups": float(len(todo)),
                  "igpo_hinted_correct": 0.0, "igpo_replaced": 0.0, "nfe": 0}
        # Every rank joins the hinted decode's collectives (FSDP's weight gathering) when any rank has a group for it.
        if agree_max([len(todo)], services.device)[0] == 0:
            return counts
        spec = cfg.chunks()
        hints = []
        for j in todo:
            gen = keyed_generator(ctx.seed, "igpo-hints", ctx.step, uids[j])
            for ratio in hint_ratios(G, cfg.hint_ratio_low, cfg.hint_ratio_high, gen).tolist():
                hints.append(chunk_hint_canvas(refs[j], sampler.gen_length, ratio, spec, gen))
        sub = prompts.select(torch.tensor(todo, dtype=torch.long))
        seeds = [derive_seed(ctx.seed, "igpo-hinted", ctx.step, uids[j]) for j in todo]
        hint_rows = torch.stack(hints) if hints else torch.zeros(0, sampler.gen_length, dtype=torch.long)
        ro = services.decode(sub, seeds, model, sampler, hints=hint_rows, record=self.record)
        if ro is None:
            return counts
        counts["nfe"] = ro.nfe
        of = ro.prompt_index.cpu()
        info = rollout_info(ro.completion_mask, ro.step_map, sampler.block_length)
        examples = [{**sub["examples"][int(i)], "rollout": inf} for i, inf in zip(of, info)]
        texts = ro.texts(services.tokenizer)
        rewards = services.score_texts(texts, examples)
        good = rewards.float() >= cfg.correct_reward
        counts["igpo_hinted_correct"] = float(good.sum())
        for k, j in enumerate(todo):
            cand = ((of == k) & good).nonzero().flatten()
            if cand.numel() > cfg.max_replacements:  # a random subset of the correct ones (the reference's randperm)
                pick = torch.randperm(cand.numel(), generator=keyed_generator(ctx.seed, "igpo-pick", ctx.step, uids[j]))
                cand = cand[pick[:cfg.max_replacements]]
            for slot, src in zip(rows_of[uids[j]].tolist(), cand.tolist()):  # the group's first rollouts are replaced
                batch.take_row(slot, ro, src, rewards[src], examples[src], texts[src])  # its hint mask too
                counts["igpo_replaced"] += 1.0
        return counts

    @property
    def frozen_models(self) -> tuple[str, ...]:  # score_hints: the rollout policy's entropies at the hints
        return ("policy",) if self.config.score_hints else ()

    def score_frozen(self, ctx: StepContext, batch: RLBatch, lend, micro_batch_size: int) -> ScoredHints:
        """``score_hints``: the hint positions the reference keeps in the loss, by the rollout policy's entropies of
        the scoring view (the old policy's at every inner iteration: the view draws nothing)."""
        from ..collectives import agree_max, gathered_for_inference
        from ..models.sequence_parallel import sharding_sequences
        hint = self.hints(batch)
        out = torch.zeros_like(hint)
        rows = hint.any(1).nonzero().flatten()
        if agree_max([rows.numel()], hint.device)[0] == 0:
            return ScoredHints(out)
        # the rollout policy's own forward, as the reference's: unsharded (ranks of a sequence group hold the batch)
        with lend("policy") as model, gathered_for_inference(model), sharding_sequences(None):
            if rows.numel():
                sub = batch.select(rows)
                ent = self.log_likelihood(ctx, model, sub, sub.views[0], with_entropy=True).entropy
                cand = hint[rows] & sub.completion_mask.bool()
                out[rows] = hint_entropy_filter(cand, ent.to(cand.device), self.config.hint_entropy_keep)
        return ScoredHints(out)

    # --- (3) the scoring view ----------------------------------------------------------------------------------
    def hints(self, batch: RLBatch) -> torch.Tensor:
        """Bool ``[B, Lc]``: the completion positions that held a hint (the rollout's ``hint_mask``)."""
        if batch.hint_mask is None:
            return torch.zeros_like(batch.completion_ids, dtype=torch.bool)
        return batch.hint_mask.bool()

    def scored(self, batch: RLBatch) -> torch.Tensor:
        """Bool ``[B, Lc]``: the positions the view scores (generated ones; with ``score_hints`` the hints too)."""
        valid = batch.completion_mask.bool()
        return valid if self.config.score_hints else valid & ~self.hints(batch).to(valid.device)

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        comp = batch.completion_ids
        hint = self.hints(batch).to(comp.device)
        noised = torch.ones_like(hint) if self.config.score_hints else ~hint
        x_t = ctx.corrupt(comp, noised, batch.uid, iteration, "completion")
        return [completion_view(ctx, batch, x_t, self.scored(batch))]

    # --- (5) loss ------------------------------------------------------------------------------------------------
    def loss_mask(self, batch: RLBatch) -> torch.Tensor:
        valid = batch.completion_mask.bool()
        kept = batch.frozen.hints.to(valid.device) if batch.frozen is not None else torch.zeros_like(valid)
        keep = valid & (~self.hints(batch).to(valid.device) | kept)
        return keep.float() * batch.active.float()[:, None]

    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int):
        cfg = self.config
        if not cfg.sequence_ratio:
            return super().loss(ctx, batch, current, iteration)
        logp = current.value
        old, ref = self.old_and_ref(batch, current, iteration)
        return sequence_ratio_token_loss(
            logp, old, batch.advantages.values.to(logp.device), self.loss_mask(batch), norms=ctx.norms,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, ratio_mask=self.scored(batch).float(), ref_logp=ref,
            beta=cfg.beta, kl_estimator=cfg.kl_estimator, aggregation=cfg.aggregation, entropy=current.entropy)
