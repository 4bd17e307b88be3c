"""d-OPSD: on-policy self-distillation for masked dLLMs (Luo et al. 2026, "Learning from the Self-future",
arXiv:2606.18195; authors' code xingzhejun/d-OPSD, ``d-opsd/d_opsd_trainer.py``; docs/algorithms/d_opsd.md).

The model is its own teacher. For a rollout x_0 -> ... -> x_final of the semi-autoregressive masked sampler, every
recorded pre-step state x_s is shown to a teacher with a random ``reveal_ratio`` (25 %) of the positions of *all
future blocks* (the blocks after the one being decoded at step s, EOS padding included) filled with the rollout's
own final tokens -- the model's "self-future" as suffix conditioning. The teacher is the frozen initial model (the
reference policy: LoRA-disabled base or frozen copy; ``fixed_teacher``) or the current weights, always without
gradient. At each state the ``k_s`` masked positions of the current block the teacher is most confident about (max
raw logit; ``k_s`` = tokens the sampler wrote at step s, 2 in the paper) are supervised with a divergence between the
student ``pi_theta(. | x_s)`` and the teacher over the teacher's top-``top_k`` tokens, renormalised over them
(``losses.topk_divergence``: reverse KL at ``jsd_beta`` 1), every term clipped at ``token_clip``::

    L = (1/N) sum_i [r_i >= train_reward] (1/b_i) sum_{s in chunk j of row i} sum_{p in P_s} sum_{v in top-k} min(d, c)

N = samples of the step; the recorded states of row i are split into ``inner_iterations`` chunks of b_i states
(the authors' ``batch_divide``), chunk j trained by inner iteration j. A rollout below the gate contributes zero.
No reward enters the loss beyond the gate; there is no advantage.

Recorded states (the authors' ``generate``): the states before each step whose text before the first stop token
still holds a mask, never those of the last block (no future to reveal); the last recorded one is never a student
input. They are rebuilt from the rollout's ``step_map`` (tokens written at a step >= s are masked), so nothing but the
step map is kept; steps that write no token are not states.

The teacher pass (``score_frozen``, stage 3 after the views) runs once per rollout batch: one no-grad forward per
state, and caches per (sample, state) the supervised positions, the teacher's top-k token ids and its renormalised
log-probs there -- ``samples x states x k_s x top_k`` ids and floats (KBs). Every inner iteration reuses the cache.

pass@k (``passk``, ``collect``): a sample whose reward is below ``correct_reward`` is decoded again (at
``passk_temperature``, its own keyed seed) up to ``passk`` tries in all; the first try reaching it is kept, else the
best (the latest among equals: for a binary reward the last try, as the authors). Other methods' rollouts are not
touched: this is the method's own ``collect`` hook.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import torch

from ..collectives import agree_max
from ..models import LogitsRequest
from .base import Algorithm, AlgorithmConfig, StepContext, cost
from .batch import LogLik, RLBatch, View
from .common.replay import step_groups
from .common.scoring import backward_each_view
from .common.states import chunk_plan, first_stop, recorded_states, step_table
from .common.views import completion_view
from .losses import topk_divergence
from .paper import GridAdjust, PaperSettings
from .registry import register_algorithm


@dataclass
class DOPSDConfig(AlgorithmConfig):
    name: str = "d_opsd"
    # The authors' ``batch_divide``: the recorded states are split into this many chunks, one optimizer update each
    # (run/*/opsd.sh: 4 on B200; the config default and README: 8 on A100/H100).
    inner_iterations: int = cost(4, "iterations")
    passk: int = 8  # decode a failed sample again, up to this many tries in all
    passk_temperature: float = 0.9  # sampler temperature of the retries (the first try uses the recipe's)
    correct_reward: float = 1.0  # reward at which a try counts as correct (retries stop)
    train_reward: Optional[float] = None  # the loss gate: distil rollouts with reward >= it (None: correct_reward)
    reveal_ratio: float = 0.25  # fraction of the future-block positions the teacher sees (teacher_retain_ratio)
    top_k: int = 20  # teacher tokens the divergence is computed over, renormalised (top_k_loss)
    jsd_beta: float = 1.0  # 1: reverse KL(student || teacher), 0: forward KL, between: generalised JSD (beta)
    token_clip: Optional[float] = 0.05  # pointwise clip of every divergence term (jsd_token_clip; math 0.04)
    fixed_teacher: bool = True  # teacher = the frozen initial model (reference); False: the current weights
    # Supervised positions: the teacher's most confident masked positions of the current block ("teacher"), or the
    # positions the sampler wrote at the step ("sampler": the authors' diff_student_mask ablation).
    positions: Literal["teacher", "sampler"] = "teacher"

    def __post_init__(self):
        if self.inner_iterations < 1:
            raise ValueError(f"inner_iterations must be >= 1, got {self.inner_iterations}")
        if self.passk < 1:
            raise ValueError(f"passk must be >= 1, got {self.passk}")
        if self.passk_temperature < 0:
            raise ValueError(f"passk_temperature must be >= 0, got {self.passk_temperature}")
        if not 0.0 <= self.reveal_ratio <= 1.0:
            raise ValueError(f"reveal_ratio must be in [0, 1], got {self.reveal_ratio}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise ValueError(f"jsd_beta must be in [0, 1], got {self.jsd_beta}")
        if self.token_clip is not None and self.token_clip <= 0:
            raise ValueError(f"token_clip must be > 0 or null, got {self.token_clip}")
        if self.positions not in ("teacher", "sampler"):
            raise ValueError(f"positions must be 'teacher' or 'sampler', got {self.positions!r}")

    @property
    def gate(self) -> float:
        return self.correct_reward if self.train_reward is None else self.train_reward


# ----------------------------------------------------------------------------------------------------------
# The teacher's revealed future and the positions it supervises (pure functions, tested directly)
# ----------------------------------------------------------------------------------------------------------


def reveal_positions(ctx: StepContext, uid: int, step: int, candidates: int, ratio: float) -> torch.Tensor:
    """Which of the ``candidates`` future positions the teacher sees at state ``step`` of sample ``uid``: a random
    ``int(candidates * ratio)`` of them (the reference's ``randperm``), keyed so that it reproduces from the seed."""
    gen = ctx.generator("d_opsd_reveal", int(uid), int(step))
    return torch.randperm(candidates, generator=gen)[:int(candidates * ratio)]


def select_positions(confidence: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor, width: int):
    """``(index [n, width], valid [n, width])``: the ``k[i]`` eligible columns of row i with the largest ``confidence``
    (``[n, C]``), in ascending column order (padding: column 0, invalid)."""
    n, C = confidence.shape
    score = confidence.masked_fill(~eligible, float("-inf"))
    top = score.topk(min(width, C), dim=1).indices
    take = torch.arange(top.shape[1], device=top.device)[None] < k[:, None]
    chosen = torch.zeros(n, C, dtype=torch.bool, device=top.device).scatter(1, top, take) & eligible
    cols = torch.arange(C, device=top.device)[None].expand(n, C)
    order = torch.where(chosen, cols, torch.full_like(cols, C))  # unchosen columns sort last
    idx = order.sort(dim=1).values[:, :width]
    valid = idx < C
    if idx.shape[1] < width:
        pad = width - idx.shape[1]
        idx = torch.nn.functional.pad(idx, (0, pad), value=C)
        valid = torch.nn.functional.pad(valid, (0, pad), value=False)
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


@dataclass
class DOPSDState:
    """``batch.state``: the step ranks of every token (``ranks [B, Lc]``), the step table (``block`` / ``count``
    ``[B, R]``), the recorded states ``states [B]``, the plan ``plan [B, D, W]`` (step rank per inner iteration and
    view, -1 none) and each sample's weight ``1/b_i`` if it passes the gate (``weight [B]``); ``width`` k: supervised
    positions per state (the most tokens any trained step wrote)."""
    ranks: torch.Tensor
    block: torch.Tensor
    count: torch.Tensor
    states: torch.Tensor
    plan: torch.Tensor
    weight: torch.Tensor
    width: int = 0


@dataclass
class Teacher:
    """``batch.frozen``, the teacher pass (``score_frozen``), per view slot ``j * W + r``: the supervised completion
    columns ``positions [B, D*W, k]`` (``valid``), the teacher's top-k token ids ``ids [B, D*W, k, K]`` and its
    renormalised log-probs ``logq``."""
    positions: torch.Tensor
    valid: torch.Tensor
    ids: torch.Tensor
    logq: torch.Tensor


# ----------------------------------------------------------------------------------------------------------


@register_algorithm
class DOPSD(Algorithm):
    """Self-distillation: KL to the model itself shown a random 25% of its own final answer's future blocks."""
    name = "d_opsd"
    config_class = DOPSDConfig
    data_kind = "prompts"
    uses_rollout = True
    iterations_split_work = True  # iteration j trains chunk j of each row's recorded states
    supports: ClassVar[tuple[str, ...]] = ("bidirectional",)
    undefined: ClassVar[dict[str, str]] = {
        "block_causal": "the teacher's only extra information is tokens of *future* blocks; under block-causal "
                        "attention a position of block b attends to blocks <= b only, so the revealed tokens cannot "
                        "reach the supervised positions: the teacher's logits there equal the student's (current "
                        "weights) or the frozen base's (a plain KL to the initial model), and the self-future signal "
                        "is gone",
        "encoder_decoder": "it distils at the masked positions of the current block of an absorbing masked-diffusion "
                           "state, rebuilt from the step map; the uniform-noise canvas sampler has no masked positions "
                           "and writes no token at a step (every pass re-noises what it does not accept)"}
    paper = PaperSettings(
        lr=5e-6, grad_clip=0.2, temperature=0.9, lora={"r": 128, "alpha": 64},
        published_code=True,
        # The authors' sampler decodes every block; the method needs several blocks (its teacher reveals future ones):
        # they decode 256 tokens in 32-token blocks, 2 tokens per step; on the 40-token compare canvas (20 steps)
        # 8-token blocks keep 2 tokens per step.
        sampler={"block_stop": False, "block_length": 8},
        source="xingzhejun/d-OPSD @1b55cf3 d-opsd/opsd.yaml (learning_rate 5e-6, max_grad_norm 0.2, lora_r 128, "
               "lora_alpha 64, block_length 32 of max_completion_length 256 at diffusion_steps 128: several blocks, "
               "2 tokens per step, which block_length 8 keeps on the 40-token compare canvas), d_opsd_config.py "
               "l.291-296 (temperature 0.9); run/math/opsd.sh (jsd_token_clip 0.04), run/sudoku/opsd.sh "
               "(sudoku_threshold 0.25)",
        per_task={"math": {"algorithm": {"token_clip": 0.04}}, "sudoku": {"algorithm": {"train_reward": 0.25}}})
    grid = GridAdjust("d-OPSD's pass@8 retries are off (passk 1): the unified group of 8 completions is each prompt's 8 "
                      "tries, each distilled when correct (the authors retry one completion up to 8 times); every block "
                      "is decoded (block_stop false) as the authors' sampler does; the authors' task values: Sudoku "
                      "distils rollouts with cell accuracy >= 0.25, math clips at 0.04 (docs/algorithms/d_opsd.md)",
                      algorithm={"passk": 1}, sampler={"block_stop": False},
                      per_task={"sudoku": {"train_reward": 0.25}, "math": {"token_clip": 0.04}})

    @property
    def inner_iterations(self) -> int:
        return self.config.inner_iterations

    @property
    def mc_samples(self) -> int:
        return 1  # one forward per recorded state (and one teacher forward)

    @property
    def frozen_models(self) -> tuple[str, ...]:  # the teacher: the frozen initial model, or the current weights
        return ("reference",) if self.config.fixed_teacher else ("policy",)

    def check_rollout(self, sampler, adapter) -> None:
        if sampler.block_length >= sampler.gen_length:
            raise ValueError(f"d-OPSD reveals tokens of future blocks: rollout.sampler.block_length "
                             f"({sampler.block_length}) must be smaller than gen_length ({sampler.gen_length})")
        if sampler.rcr:
            raise ValueError("d-OPSD rebuilds each state from the step map (written tokens stay written); "
                             "rollout.sampler.rcr re-masks written tokens: unset it")

    # --- (1)-(2) rollout with pass@k ----------------------------------------------------------------------
    def collect(self, ctx: StepContext, prompts, model) -> tuple[RLBatch, dict]:
        batch, metrics = ctx.services.collect(ctx, prompts, model, record=self.record)
        tries = torch.ones(batch.size)
        if self.config.passk > 1:
            tries = retry_until_correct(self.config, ctx, model, batch, self.record)
        cfg = self.config
        sums = ctx.services.all_reduce_sums({
            "n": float(batch.size), "tries": float(tries.sum()), "kept": float(batch.rewards.float().sum()),
            "gated": float((batch.rewards >= cfg.gate).float().sum())})
        n = max(sums["n"], 1.0)
        # reward_mean stays the first try's (the policy's own success rate, comparable across methods)
        metrics.update({"passk_tries": sums["tries"] / n, "kept_reward_mean": sums["kept"] / n,
                        "distilled_frac": sums["gated"] / n, "nfe": float(batch.nfe)})
        return batch, metrics

    # --- (3) states, views, teacher pass ------------------------------------------------------------------
    def _block_length(self, ctx: StepContext) -> int:
        sampler = ctx.services.rollout_sampler
        if sampler is None:
            raise ValueError("d-OPSD needs the rollout sampler's block length (ctx.services.rollout_sampler)")
        return int(sampler.block_length)

    def prepare(self, ctx: StepContext, batch: RLBatch) -> DOPSDState:
        if batch.step_map is None:
            raise ValueError("d-OPSD rebuilds the sampler's states from the rollout's step_map, but the batch has none")
        BL = self._block_length(ctx)
        ranks, _ = step_groups(batch.step_map, 1)
        block, count = step_table(ranks, BL)
        Lc = batch.completion_ids.shape[1]
        states = recorded_states(ranks, batch.completion_ids, batch.stop_token_ids or ctx.adapter.all_stop_ids,
                                 block, (Lc - 1) // BL)
        D = self.config.inner_iterations
        per = (states - 1).clamp_min(0) // D
        (width,) = agree_max([int(per.max()) if per.numel() else 0], ranks.device)  # same views on every rank
        plan = chunk_plan(states, D, width)
        gate = (batch.rewards.float() >= self.config.gate).to(per.device)
        weight = torch.where((per > 0) & gate, 1.0 / per.clamp_min(1).float(),
                             torch.zeros(per.shape, device=per.device))
        used = plan.flatten(1)
        k = count.gather(1, used.clamp_min(0)) * (used >= 0) if count.numel() else used.clamp_min(0) * 0
        return DOPSDState(ranks, block, count, states, plan, weight, width=max(int(k.max()) if k.numel() else 1, 1))

    def state_input(self, batch: RLBatch, step: torch.Tensor, mask_id: int) -> torch.Tensor:
        """``[B, Lc]``: each row's completion before step rank ``step[i]`` (every token written at a rank >= it, or
        never written, is masked; a row without a state, ``step < 0``, is all masks)."""
        st = batch.state
        masked = (st.ranks >= step.clamp_min(0)[:, None]) | (step < 0)[:, None]
        return torch.where(masked, torch.full_like(batch.completion_ids, mask_id), batch.completion_ids)

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        st, mask_id = batch.state, ctx.adapter.mask_token_id
        W = st.plan.shape[2]
        views = []
        for r in range(W):
            step = st.plan[:, iteration, r]
            state = self.state_input(batch, step, mask_id)
            slot = torch.full((batch.size,), iteration * W + r, dtype=torch.long, device=step.device)
            views.append(completion_view(ctx, batch, state, state == mask_id, info={"slot": slot}))
        return views

    def _rows(self, ctx: StepContext, batch: RLBatch, step: torch.Tensor) -> torch.Tensor:
        """Rows a forward must score: those with a state and a nonzero weight; every row on several ranks (a sharded
        model's forward is a collective every rank joins with the same count)."""
        if ctx.world_size > 1:
            return torch.arange(batch.size, device=step.device)
        return ((step >= 0) & (batch.state.weight > 0)).nonzero().flatten()

    @torch.no_grad()
    def score_frozen(self, ctx: StepContext, batch: RLBatch, lend, micro_batch_size: int) -> Teacher:
        """One no-grad forward of the teacher per state: reveal, select the positions, cache the top-k."""
        _no_sequence_parallel()
        cfg, st = self.config, batch.state
        B, Lc = batch.completion_ids.shape
        P, BL, K, k = batch.prompt_ids.shape[1], self._block_length(ctx), cfg.top_k, st.width
        D, W = st.plan.shape[1], st.plan.shape[2]
        dev = batch.completion_ids.device
        positions = torch.zeros(B, D * W, k, dtype=torch.long, device=dev)
        valid = torch.zeros(B, D * W, k, dtype=torch.bool, device=dev)
        ids = torch.zeros(B, D * W, k, K, dtype=torch.long, device=dev)
        logq = torch.zeros(B, D * W, k, K, dtype=torch.float32, device=dev)
        stops = batch.stop_token_ids or ctx.adapter.all_stop_ids
        eos = first_stop(batch.completion_ids, stops)
        with lend(self.frozen_models[0]) as teacher:
            for j in range(D):
                for r, view in enumerate(batch.views[j]):
                    step = st.plan[:, j, r]
                    rows = self._rows(ctx, batch, step)
                    for chunk in rows.split(max(1, micro_batch_size)):
                        out = self._teacher_chunk(ctx, batch, teacher, view, chunk, step[chunk], eos[chunk], P, BL, K, k)
                        slot = j * W + r
                        positions[chunk, slot], valid[chunk, slot], ids[chunk, slot], logq[chunk, slot] = out
        return Teacher(positions, valid, ids, logq)

    def _teacher_chunk(self, ctx, batch, teacher, view: View, rows, step, eos, P: int, BL: int, K: int, k: int):
        cfg, st = self.config, batch.state
        Lc = batch.completion_ids.shape[1]
        has = step >= 0
        s = step.clamp_min(0)
        blk = st.block[rows].gather(1, s[:, None]).squeeze(1).clamp_min(0) if st.block.numel() else s * 0
        inputs = view.input_ids[rows].clone()
        for i, row in enumerate(rows.tolist()):  # the self-future: a random share of every future block position
            start = (int(blk[i]) + 1) * BL
            if has[i] and start < int(eos[i]):
                picked = reveal_positions(ctx, int(batch.uid[row]), int(s[i]), Lc - start, cfg.reveal_ratio)
                sel = start + picked.to(rows.device)
                inputs[i, P + sel] = batch.completion_ids[row, sel]
        cols = (blk * BL)[:, None] + torch.arange(BL, device=rows.device)[None]  # the current block's columns
        logits = teacher(inputs, attention_mask=view.attention_mask[rows] if view.attention_mask is not None else None,
                         position_ids=view.position_ids[rows] if view.position_ids is not None else None,
                         request=LogitsRequest(rows=ctx.adapter.prediction_rows(P + cols))).logits.float()
        masked = st.ranks[rows].gather(1, cols) >= s[:, None]
        count = st.count[rows].gather(1, s[:, None]).squeeze(1) if st.count.numel() else s * 0
        if cfg.positions == "teacher":  # the teacher's most confident masked positions (max raw logit)
            local, ok = select_positions(logits.max(-1).values, masked, count, k)
        else:  # the positions the sampler wrote at the step
            local, ok = select_positions(torch.zeros_like(masked, dtype=torch.float32),
                                         st.ranks[rows].gather(1, cols) == s[:, None], count, k)
        ok = ok & has[:, None]
        picked = logits.gather(1, local[..., None].expand(-1, -1, logits.shape[-1]))  # [n, k, V]
        top = picked.topk(min(K, picked.shape[-1]), dim=-1)
        return cols.gather(1, local), ok, top.indices, torch.log_softmax(top.values, dim=-1)

    # --- (5) student pass and loss ------------------------------------------------------------------------
    def normalizers(self, batch: RLBatch) -> dict[str, float]:
        st = batch.state
        used = st.plan.flatten(1)
        k = st.count.gather(1, used.clamp_min(0)) * (used >= 0) if st.count.numel() else used * 0
        supervised = (k.sum(1).float() * (st.weight > 0).float()).sum()
        return {"samples": float(batch.size), "positions": float(supervised)}

    def student(self, ctx: StepContext, model, batch: RLBatch, view: View):
        """``(logq [B, k, K], overlap [B, k])`` or None: the student's log-probs of the teacher's top-k tokens at the
        view's supervised positions, renormalised over them (rows without a weight are zeros), and the fraction of
        the teacher's top-k in the student's own top-k."""
        _no_sequence_parallel()
        st = batch.state
        slot = view.info["slot"].long()
        rows = self._rows(ctx, batch, st.plan.flatten(1).gather(1, slot[:, None]).squeeze(1))
        if rows.numel() == 0:
            return None
        P = batch.prompt_ids.shape[1]
        pos = batch.frozen.positions[rows, slot[rows]]
        ids = batch.frozen.ids[rows, slot[rows]]
        logits = model(view.input_ids[rows],
                       attention_mask=view.attention_mask[rows] if view.attention_mask is not None else None,
                       position_ids=view.position_ids[rows] if view.position_ids is not None else None,
                       request=LogitsRequest(rows=ctx.adapter.prediction_rows(P + pos))).logits.float()
        logq = torch.log_softmax(logits.gather(-1, ids), dim=-1)
        with torch.no_grad():
            own = logits.topk(ids.shape[-1], dim=-1).indices
            overlap = (own[..., :, None] == ids[..., None, :]).any(-2).float().mean(-1)
        full = torch.zeros(batch.size, *logq.shape[1:], dtype=logq.dtype, device=logq.device)
        over = torch.zeros(batch.size, overlap.shape[1], device=logq.device)
        return full.index_put((rows,), logq), over.index_put((rows,), overlap)

    def log_likelihood(self, ctx: StepContext, model, batch: RLBatch, views: list[View], *,
                       with_entropy: bool = False) -> LogLik:
        """``[B, views x k x K]``: the student's log-probs of the teacher's top-k tokens, renormalised over them."""
        B, k, K = batch.size, batch.state.width, batch.frozen.ids.shape[-1]
        parts = []
        for v in views:
            out = self.student(ctx, model, batch, v)
            parts.append(out[0].flatten(1) if out is not None else torch.zeros(B, k * K, device=batch.uid.device))
        return LogLik(torch.cat(parts, dim=1))

    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int,
             views: Optional[list[View]] = None):
        """The step-level self-distillation loss of ``views`` (default: the iteration's), its additive share."""
        cfg, st = self.config, batch.state
        views = batch.views[iteration] if views is None else views
        B, k = batch.size, st.width
        slots = torch.stack([v.info["slot"].long() for v in views], dim=1)  # [B, nv]
        rows = torch.arange(B, device=slots.device)[:, None]
        teacher = batch.frozen.logq[rows, slots]  # [B, nv, k, K]
        student = current.value.view(B, len(views), k, -1)
        ok = batch.frozen.valid[rows, slots] & (st.weight > 0)[:, None, None]  # [B, nv, k]
        d, clipped = topk_divergence(student, teacher.to(student.dtype), cfg.jsd_beta, cfg.token_clip)
        per_state = (d * ok[..., None]).sum((-1, -2))  # [B, nv]: sum over positions and top-k tokens
        n = max(ctx.norms.get("samples", float(B)), 1.0)
        loss = (per_state * st.weight[:, None].to(d.dtype)).sum() / n
        raw, _ = topk_divergence(student.detach(), teacher.to(student.dtype), cfg.jsd_beta, None)
        elems = max(ctx.norms.get("positions", 0.0), 1.0) * teacher.shape[-1]
        metrics = {"kl": float(((raw * ok[..., None]).sum((-1, -2)) * st.weight[:, None]).sum()) / n,
                   "clip_frac": float((clipped & ok[..., None]).sum()) / elems}
        return loss, metrics

    def backward(self, ctx: StepContext, model, batch: RLBatch, iteration: int,
                 loss_scale: float = 1.0) -> dict[str, float]:
        """One forward + backward per view (state): the loss is a sum over states, so only one graph is alive."""
        positions = max(ctx.norms.get("positions", 0.0), 1.0)

        def view_loss(r, view):
            out = self.student(ctx, model, batch, view)
            if out is None:  # nothing to distil in this view on this rank
                return torch.zeros(()), {}
            logq, overlap = out
            loss, metrics = self.loss(ctx, batch, LogLik(logq.flatten(1)), iteration, views=[view])
            slot = view.info["slot"].long()
            ok = batch.frozen.valid[torch.arange(batch.size), slot] & (batch.state.weight > 0)[:, None]
            metrics["top_k_overlap"] = float((overlap * ok).sum()) / positions
            return loss, metrics
        return backward_each_view(batch.views[iteration], view_loss, loss_scale, skip_constant=True,
                                  runner=ctx.services.run_unit)


def _no_sequence_parallel() -> None:
    from ..models import sequence_parallel
    if sequence_parallel.active() is not None:
        raise ValueError("d-OPSD scores top-k logits at a few positions per state; distributed.sequence_parallel is "
                         "not supported for it")


# ----------------------------------------------------------------------------------------------------------
# pass@k
# ----------------------------------------------------------------------------------------------------------


def retry_until_correct(cfg: DOPSDConfig, ctx: StepContext, model, batch: RLBatch, record=None) -> torch.Tensor:
    """Decode every sample below ``correct_reward`` again (``passk_temperature``, a seed keyed by (step, sample, try),
    recording what the first rollout recorded: ``record``) until it reaches it or has ``passk`` tries; keep the first
    correct try, else the best (latest among equals). Replaces rows of ``batch`` in place; returns the tries per
    sample ``[B]``."""
    from ..diffusion.noise import STREAM_ROLLOUT, derive_seed
    from ..rewards.speed import rollout_info
    services = ctx.services
    sampler = dataclasses.replace(services.rollout_sampler, temperature=cfg.passk_temperature)
    tries = torch.ones(batch.size)
    examples = [{k: v for k, v in e.items() if k != "rollout"} for e in batch.examples]
    # One all-gather for every rank (a rank without failures joins it too): retries differ across ranks.
    with services.gathered(model):
        for attempt in range(1, cfg.passk):
            todo = (batch.rewards < cfg.correct_reward).nonzero().flatten()
            if todo.numel() == 0:
                break
            seeds = [derive_seed(ctx.seed, STREAM_ROLLOUT, "passk", ctx.step, int(batch.uid[i]), attempt) for i in todo]
            ro = services.generate(model, batch.prompt_ids[todo], sampler, n=1, seeds=seeds,
                                   attention_mask=batch.prompt_mask[todo], record=record)
            info = rollout_info(ro.completion_mask, ro.step_map, sampler.block_length)
            ex = [{**examples[int(i)], "rollout": inf} for i, inf in zip(todo, info)]
            texts = ro.texts(services.tokenizer)
            rewards = services.score_texts(texts, ex).to(batch.rewards.device)
            batch.nfe += ro.nfe
            tries[todo.cpu()] += 1
            better = rewards >= batch.rewards[todo]  # the best so far, the latest among equals
            for n, i in enumerate(todo.tolist()):
                if bool(better[n]):
                    batch.take_row(i, ro, n, rewards[n], ex[n], texts[n])
    return tries
