"""JustGRPO: GRPO on the exact likelihood of the autoregressive (left-to-right) order (Ni et al. 2026, "The
Flexibility Trap", arXiv 2601.15165; code: LeapLabTHU/JustGRPO ``grpo.py``).

**Rollout.** One token per denoising step, left to right: the method decodes the recipe's sampler with block length
1 and ``steps = gen_length`` (``collect``; another ``rollout.sampler.block_length`` is replaced, with a log line).
Each step then commits the only masked position of its block, so whatever the remasking rule, token t is drawn from
``p(y_t | x, y_<t, masks after t)`` at the sampler's temperature, which the log-probs use too: the rollout policy
*is* the scored one (up to the mask token, which the sampler never draws and a trained model gives ~0 mass).
``check_rollout`` refuses what would change that policy (``cfg_scale``, ``top_p``, ``top_k``, ``rcr``, editing, T = 0).

**Likelihood.** ``log pi(y | x) = sum_t log p(y_t | x, y_<t, [MASK] * (L - t))``, read at position t of the state
where the completion's tokens before t are revealed and every later position is masked:

* *bidirectional models* (LLaDA, LLaDA-MoE, Dream): every state needs its own forward pass over its own input (all
  tokens see all tokens), so the L states of the micro-batch's completions are stacked as rows,
  ``tokens_per_forward // (P + L)`` of them per forward, across positions and samples. Positions after the first
  stop token that the sampler never wrote (``block_stop``) are not scored.
* *block-causal models* (SDAR, SDAR-MoE, LLaDA2) decoding with block length 1 attend causally; every conditional
  comes out of ONE forward of the ``[x_t ; x_0]`` layout with block size 1 and an all-masked x_t: the masked
  position t sees itself and the clean tokens before it -- exactly the sampler's input at step t.

The reference (and the original DARE port) runs one forward per position t over the micro-batch's rows: L forwards.
``benchmarks/bench_methods.py`` counts forwards and times both side by side.

**Loss** (``grpo.py: logprob_loss``): token-level clipped ratio (eps 0.2) with mu = 1 (``old = logp.detach()``),
no KL, advantages ``(r - mean) / (std + 1e-4)`` with the *unbiased* group std (``compute_group_advantages``), the
per-token terms summed over every generated position and scaled by ``1 / (gen_length * (valid_samples + 1e-5))``,
valid_samples = samples with a non-zero advantage. Defaults follow the reference ``train.py`` (lr 5e-6, temperature
1, 16 completions per prompt, gen_length = steps = 256, grad clip 1.0, no weight decay).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ..collectives import agree_max
from ..diffusion.logprob import score_targets
from .advantages import aggregation_weights, group_zscore_unbiased
from .base import StepContext, cost
from .batch import Advantages, LogLik, RLBatch, View
from .common.scoring import backward_each_view
from .common.views import prompt_completion_view, with_attention_blocks
from .grpo import AdvantageMode, Aggregation, GRPOAlgorithm, GRPOConfig
from .losses import clipped_surrogate, kl_penalty
from .paper import GridAdjust, LrDeparture, PaperSettings
from .registry import register_algorithm

log = logging.getLogger(__name__)


@dataclass
class JustGRPOConfig(GRPOConfig):
    name: str = "justgrpo"
    inner_iterations: int = cost(1, "iterations")  # train.py: one update per rollout batch (ratio = exp(logp - logp.detach()))
    clip_low: float = 0.2  # grpo.py logprob_loss eps=0.2
    beta: float = 0.0  # no KL term in the reference
    advantage: AdvantageMode = "mean_std"  # compute_group_advantages: unbiased std (torch.std), eps 1e-4
    advantage_eps: float = 1e-4
    aggregation: Aggregation = "seq_mean_token_sum_norm"  # gain / gen_length / valid_samples
    valid_eps: float = 1e-5  # scale = gain / gen_length / (valid_samples + 1e-5): added to the sample count
    # Positions after the completion mask (the first stop token) that are scored when the sampler wrote them; None:
    # all of them (the reference scores every generated position; with block_stop the sampler writes none).
    post_tokens: Optional[int] = None
    # Bidirectional models: tokens per forward of stacked AR states (each state is prompt + gen_length tokens).
    tokens_per_forward: int = 16384

    def __post_init__(self):
        super().__post_init__()
        if self.post_tokens is not None and self.post_tokens < 0:
            raise ValueError(f"post_tokens must be >= 0 or null, got {self.post_tokens}")
        if self.tokens_per_forward < 1:
            raise ValueError(f"tokens_per_forward must be >= 1, got {self.tokens_per_forward}")


def ar_sampler(sampler):
    """The recipe's sampler decoding one token per step, left to right (block length 1)."""
    return dataclasses.replace(sampler, block_length=1, steps=sampler.gen_length, steps_per_block=None)


@dataclass
class ARState:
    """``targets [B, Lc]``: the completion slots whose AR conditional is scored (JustGRPO's ``batch.state``)."""
    targets: torch.Tensor


def ar_targets(batch: RLBatch, post_tokens: Optional[int]) -> torch.Tensor:
    """Bool ``[B, Lc]``: completion positions whose AR conditional is scored (the completion mask, plus up to
    ``post_tokens`` later positions the sampler wrote; ``step_map`` -1 marks positions it never decoded)."""
    cm = batch.completion_mask.bool()
    written = (batch.step_map >= 0).to(cm.device) if batch.step_map is not None else torch.ones_like(cm)
    if post_tokens is not None:
        end = cm.long().sum(1, keepdim=True) + post_tokens
        written = written & (torch.arange(cm.shape[1], device=cm.device)[None] < end)
    return cm | written


def ar_state_views(batch: RLBatch, targets: torch.Tensor, mask_id: int, tokens_per_forward: int) -> list[View]:
    """Bidirectional models: one state per target (sample i, slot t) -- ``[prompt ; y_<t ; MASK * (Lc - t)]`` --
    stacked ``tokens_per_forward // (P + Lc)`` states per forward (each state a row; padding is only the prompts'
    left padding, which attention and positions ignore). ``info["sample"]`` / ``info["slot"]`` say which
    completion slot each row scores."""
    comp = batch.completion_ids
    Lc = comp.shape[1]
    width = batch.prompt_ids.shape[1] + Lc
    sample, slot = targets.nonzero(as_tuple=True)
    per = max(1, tokens_per_forward // width)
    cols = torch.arange(Lc, device=comp.device)[None]
    views = []
    for s in range(0, sample.numel(), per):
        i, t = sample[s:s + per], slot[s:s + per]
        state = torch.where(cols >= t[:, None], torch.full_like(comp[i], mask_id), comp[i])
        views.append(prompt_completion_view(batch.prompt_ids[i], batch.prompt_mask[i], comp[i], state,
                                            cols == t[:, None], info={"sample": i, "slot": t}))
    return views


def ar_block_view(batch: RLBatch, targets: torch.Tensor, mask_id: int) -> View:
    """Block-causal models: every AR conditional in one ``[x_t ; x_0]`` forward with block size 1 (x_t all masked)."""
    comp = batch.completion_ids
    view = prompt_completion_view(batch.prompt_ids, batch.prompt_mask, comp, torch.full_like(comp, mask_id),
                                  targets, block_layout=True)
    return with_attention_blocks(view, 1)  # the sampler's attention at block length 1


@register_algorithm
class JustGRPO(GRPOAlgorithm):
    """Exact AR-order likelihood: sum_t log p(y_t given x, y_<t, masks after t), stacked states (one pass on block models)."""
    name = "justgrpo"
    config_class = JustGRPOConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal")
    undefined: ClassVar[dict[str, str]] = {
        "encoder_decoder": "its likelihood reads token t with the tokens after t masked; a uniform-noise canvas has no "
                           "mask state (unseen positions are random tokens), and its sampler accepts positions by an "
                           "entropy bound, not one token per step left to right, so rollout and scored policy differ"}
    paper = PaperSettings(
        lr=5e-6, grad_clip=1.0, temperature=1.0,
        published_code=True,
        source="LeapLabTHU/JustGRPO train.py (learning_rate 5e-6, max_grad_norm 1.0, num_generations 8 x repeat_times 2), "
               "grpo.py (sample(temperature=1.), block_length=1)")
    grid = GridAdjust("JustGRPO's rollouts decode this sampler one token per step, left to right (block length 1, "
                      "steps = gen_length: the method's own rollout, docs/algorithms/justgrpo.md)")
    departure = LrDeparture(
        0.2,
        "at its paper ratio (5x Coupled-GRPO's lr: 5e-4 on the tiny LLaDA, full fine-tuning, no KL) the "
        "training reward fell from 0.33 to about 0.05 right after the warm-up, with gradient norms up to 9, "
        "and the held-out score collapsed 41.0 -> 5.5 % (seed 0, 200 puzzles, docs/comparison.md); at factor 0.2 "
        "(1e-4, Coupled-GRPO's lr) it rose 41.0 -> 50.9.",
        ("lazy-sudoku-llada-sft",), "docs/comparison.md")

    def check_rollout(self, sampler, adapter) -> None:
        for key, bad in (("cfg_scale", sampler.cfg_scale > 0), ("rcr", sampler.rcr),
                         ("editing_threshold", sampler.editing_threshold is not None),
                         ("top_p", sampler.top_p not in (None, 1.0)), ("top_k", bool(sampler.top_k)),
                         ("temperature", sampler.temperature <= 0)):
            if bad:
                raise ValueError(f"justgrpo scores the sampled policy softmax(logits / T), T > 0; "
                                 f"rollout.sampler.{key}={getattr(sampler, key)} changes or removes it")
        if sampler.block_length != 1:
            log.info("justgrpo decodes left to right: rollout.sampler.block_length=%d is replaced by 1",
                     sampler.block_length)

    deterministic_views = True  # the clean view names the scored slots; the AR states are built from it

    def collect(self, ctx: StepContext, prompts, model) -> tuple[RLBatch, dict]:
        """The group rollout of the recipe's sampler in AR order (block length 1, one token per step)."""
        services = ctx.services
        return services.collect(ctx, prompts, model, sampler=ar_sampler(services.rollout_sampler), record=self.record)

    # --- advantages and normalisers -----------------------------------------------------------------------
    def advantages(self, ctx: StepContext, batch: RLBatch) -> Advantages:
        cfg = self.config
        base = super().advantages(ctx, batch)  # the active mask (zero-variance filter)
        if cfg.advantage != "mean_std":
            return base
        return Advantages(group_zscore_unbiased(batch.rewards.float(), batch.group, cfg.advantage_eps).to(base.values.device),
                          base.active)

    def loss_mask(self, batch: RLBatch) -> torch.Tensor:
        return batch.state.targets.float() * batch.active.float()[:, None]

    def normalizers(self, batch: RLBatch) -> dict[str, float]:
        out = super().normalizers(batch)
        # The reference divides by the number of samples with a non-zero advantage (valid_samples).
        valid = (batch.advantages.values != 0).float() * batch.active.float()
        out["seqs"] = float(valid.sum())
        return out

    # --- likelihood --------------------------------------------------------------------------------------
    def prepare(self, ctx: StepContext, batch: RLBatch) -> ARState:
        return ARState(ar_targets(batch, self.config.post_tokens))

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        """One clean ``[prompt ; y]`` view naming the scored slots; ``log_likelihood`` builds the AR states from it
        (deterministic: every inner iteration and the reference share it)."""
        comp = batch.completion_ids
        return [prompt_completion_view(batch.prompt_ids, batch.prompt_mask, comp, comp, batch.state.targets)]

    def forwards(self, ctx: StepContext, batch: RLBatch) -> list[View]:
        """The forward passes of the micro-batch's AR log-likelihood (one view each)."""
        targets = batch.state.targets
        mask_id = ctx.adapter.mask_token_id
        if ctx.adapter.is_block_causal:
            return [ar_block_view(batch, targets, mask_id)]
        views = ar_state_views(batch, targets, mask_id, self.config.tokens_per_forward)
        # Data-parallel ranks run the same number of forwards (FSDP): pad with views that score nothing.
        (count,) = agree_max([len(views)], targets.device)
        if count > len(views):
            one = torch.zeros_like(targets)
            one[0, 0] = True
            (v,) = ar_state_views(batch, one, mask_id, 1)  # a one-row state, then stripped of its target
            pad = View(v.input_ids, torch.zeros_like(v.targets), v.labels, attention_mask=v.attention_mask,
                       score_index=v.score_index, info={k: x[:0] for k, x in v.info.items()})
            views += [pad] * (count - len(views))
        return views

    def _run(self, ctx: StepContext, model, batch: RLBatch, v: View, with_entropy: bool):
        """(logp [B, Lc], entropy or None, scored [B, Lc] bool) of one forward, at the rollout's temperature (the
        policy the sampler drew from)."""
        sampler = ctx.services.rollout_sampler
        lp, ent = score_targets(model, v.input_ids, v.targets, v.labels, attention_mask=v.attention_mask,
                                position_ids=v.position_ids, chunk_size=ctx.chunk_size,
                                temperature=sampler.temperature if sampler is not None else 1.0,
                                with_entropy=with_entropy)
        lp, scored = lp.gather(1, v.score_index), v.targets.gather(1, v.score_index)
        ent = ent.gather(1, v.score_index) if ent is not None else None
        if "sample" not in v.info:  # the block view: rows are the batch's samples
            return lp, ent, scored
        # state rows: one scored slot per row, scattered back to (sample, slot)
        B, Lc = batch.completion_ids.shape
        idx = (v.info["sample"].to(lp.device), v.info["slot"].to(lp.device))
        dense = torch.zeros(B, Lc, device=lp.device).index_put(idx, lp[scored])
        dense_ent = torch.zeros(B, Lc, device=lp.device).index_put(idx, ent[scored]) if ent is not None else None
        hit = torch.zeros(B, Lc, dtype=torch.bool, device=lp.device).index_put(idx, torch.ones_like(idx[0], dtype=torch.bool))
        return dense, dense_ent, hit

    def log_likelihood(self, ctx: StepContext, model, batch: RLBatch, views: list[View], *, with_entropy: bool = False) -> LogLik:
        B, Lc = batch.completion_ids.shape
        total = torch.zeros(B, Lc, device=batch.completion_ids.device)
        ent_total = torch.zeros_like(total) if with_entropy else None
        for item in self.forwards(ctx, batch):
            lp, ent, _ = self._run(ctx, model, batch, item, with_entropy)
            total = total.to(lp.device) + lp
            if ent is not None:
                ent_total = ent_total.to(ent.device) + ent
        return LogLik(total, ent_total)

    # --- loss and update -----------------------------------------------------------------------------------
    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int, select: Optional[torch.Tensor] = None):
        """The loss share of ``batch`` (of its ``select`` tokens when given: one forward's conditionals)."""
        cfg = self.config
        logp = current.value
        old, ref = self.old_and_ref(batch, current, iteration)
        old = old.to(logp.device)
        full = self.loss_mask(batch).to(logp.device)
        sel = full if select is None else full * select.float()
        norms = dict(ctx.norms, seqs=ctx.norms["seqs"] + cfg.valid_eps)
        w = aggregation_weights(sel, cfg.aggregation, norms, batch.completion_ids.shape[1], full.sum(-1))
        logp_s = torch.where(sel > 0, logp, old.detach())  # placeholders outside the selection: ratio 1, no grad
        per_tok, ratio, clipped = clipped_surrogate(logp_s, old, batch.advantages.values.to(logp.device), cfg.clip_low,
                                                    cfg.clip_high, cfg.dual_clip, cfg.logratio_clamp)
        loss = (per_tok * w).sum()
        tok = max(ctx.norms["tokens"], 1.0)
        metrics = {"clip_frac": float((clipped.float() * sel).sum()) / tok,
                   "ratio_mean": float((ratio.detach() * sel).sum()) / tok}
        if ref is not None:
            ref_s = torch.where(sel > 0, ref.to(logp.device), logp_s.detach())
            kl = kl_penalty(logp_s, ref_s, cfg.kl_estimator)
            loss = loss + cfg.beta * (kl * w).sum()
            metrics["kl"] = float((kl.detach() * sel).sum()) / tok
        if current.entropy is not None:
            metrics["entropy"] = float((current.entropy * sel).sum()) / tok
        return loss, metrics

    def backward(self, ctx: StepContext, model, batch: RLBatch, iteration: int, loss_scale: float = 1.0) -> dict[str, float]:
        """One forward + backward per forward of ``forwards``: the loss is linear in the per-token terms (global normalisers), so
        the accumulated gradient is the whole loss's while only one row's graph is alive."""
        def forward_loss(_, item):
            lp, ent, scored = self._run(ctx, model, batch, item, ctx.want_entropy)
            return self.loss(ctx, batch, LogLik(lp, ent), iteration, select=scored)
        return backward_each_view(self.forwards(ctx, batch), forward_loss, loss_scale, runner=ctx.services.run_unit)
