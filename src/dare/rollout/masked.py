"""Masked-diffusion sampler for bidirectional models (LLaDA, LLaDA-MoE, Dream).

Semi-autoregressive blocks start at the end of the (left-padded) prompt, as in LLaDA's ``generate``;
one block spanning the whole completion is Dream's ``diffusion_generate``. Per block the rows advance
in lock step: a row whose block is finished waits (its state does not change, so its result is the same
as when it runs alone) and rows that are finished leave the batch at the next block.

Caches (Fast-dLLM, approximate for bidirectional attention):

* ``none``   every step runs the whole sequence (rows whose block is done are left out of the forward);
* ``prefix`` a full forward at each block start refreshes all keys/values and commits that step; later steps
  feed ``x[block_start:]`` against the cached prefix;
* ``dual``   the same refresh, then later steps feed only the block (its slots overwritten in place).

For shifted-logit models (Dream) the prediction for the block's first position comes from the previous
position, so cached steps feed one extra token in front of the block.

Exact caches of finished blocks (Nemotron-Labs-Diffusion's ``generate``; unshifted models): a block sees the stored
columns and itself, never a later mask. Before each block one forward stores what is not stored yet (the prompt,
then the block just finished), attending to the stored columns and to itself:

* ``block``  with full attention (the reference's ``causal_context=False``);
* ``causal`` with causal attention, the AR mode of the same weights (``adapter.causal_mode``); its last row's
  next-token prediction fills the block's first position before the block is denoised (``causal_context=True``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..diffusion.anyorder import anyorder_inputs
from ..models import LogitsRequest
from . import schedule as sched
from .config import SamplerConfig
from .selection import (REMASKINGS, committed_entropy, propose, ranks, scale_stops, select_dynamic, select_factor,
                        select_sampled, select_threshold, select_top, suppress_stops, takes_packed_logits)
from .state import DecodeState, PromptBatch, cache_rows


def masked_steps(cfg: SamplerConfig) -> tuple[int, int]:
    """(number of blocks, steps per block) for a masked model, with errors naming the parameter."""
    G, BL = cfg.gen_length, cfg.block_length
    if G % BL:
        raise ValueError(f"gen_length={G} must be a multiple of block_length={BL} for masked-diffusion models "
                         f"(blocks start at the end of the prompt)")
    nb = G // BL
    if cfg.schedule == "ass":
        spb = sched.ass_num_steps(BL)
        if cfg.steps_per_block not in (None, spb) or (cfg.steps_per_block is None and cfg.steps not in (G, spb * nb)):
            raise ValueError(f"schedule='ass' takes floor(log2 block_length)={spb} steps per block; "
                             f"leave steps unset or set steps={spb * nb}")
        return nb, spb
    if cfg.steps_per_block is not None:
        return nb, cfg.steps_per_block
    if cfg.steps % nb:
        raise ValueError(f"steps={cfg.steps} must be divisible by the number of blocks gen_length/block_length={nb}")
    return nb, cfg.steps // nb


@dataclass(frozen=True)
class MaskedBlock:
    """One block of a masked-model rollout: completion columns [start, start + length), decoded in ``steps`` steps;
    ``counts [steps]`` fixes the tokens per step (ASS) or is None (the remasking's own split of the block)."""
    start: int
    length: int
    steps: int
    counts: Optional[torch.Tensor] = None


def masked_blocks(cfg: SamplerConfig) -> list[MaskedBlock]:
    """The blocks of a masked model's rollout: ``block_length``-sized blocks, or CJ-GRPO's variable-size ASS
    blocks with ``ass_blocks > 1`` (the ASS steps of the whole completion grouped by ``schedule.ass_block_steps``)."""
    if cfg.ass_blocks > 1:
        G = cfg.gen_length
        if cfg.steps not in (G, sched.ass_num_steps(G)):
            raise ValueError(f"schedule='ass' takes floor(log2 gen_length)={sched.ass_num_steps(G)} steps; "
                             f"leave steps unset")
        counts = sched.ass_split(G)
        out, step, start = [], 0, 0
        for k in sched.ass_block_steps(G, cfg.ass_blocks):
            c = counts[step:step + k]
            out.append(MaskedBlock(start, int(c.sum()), k, c))
            step, start = step + k, start + int(c.sum())
        return out
    nb, spb = masked_steps(cfg)
    counts = sched.ass_split(cfg.block_length) if cfg.schedule == "ass" else None
    return [MaskedBlock(b * cfg.block_length, cfg.block_length, spb, counts) for b in range(nb)]


def build_masked_state(batch: PromptBatch, cfg: SamplerConfig, mask_id: int, stop_ids, gens, record) -> DecodeState:
    N, P = batch.ids.shape
    G = cfg.gen_length
    dev = batch.ids.device
    x = torch.cat([batch.ids, torch.full((N, G), mask_id, dtype=torch.long, device=dev)], dim=1)
    valid = torch.cat([batch.mask, torch.ones((N, G), dtype=torch.bool, device=dev)], dim=1)
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)  # left padding is exact: a padded row equals its own run
    is_prompt = torch.cat([batch.mask, torch.zeros((N, G), dtype=torch.bool, device=dev)], dim=1)
    gen_start = torch.full((N,), P, dtype=torch.long, device=dev)
    return DecodeState(x, valid, pos, is_prompt, gen_start, G, mask_id, stop_ids, gens, record)


class MaskedForward:
    """Model calls of one cache mode; returns prediction-aligned logits [n, BL, V] of the block rows, or with
    ``keep [n, BL]`` (bool) the logits of the kept positions only, packed [k, V] in row-major order."""

    def __init__(self, model, st: DecodeState, cfg: SamplerConfig):
        self.model, self.st, self.kind, self.cfg_scale = model, st, cfg.cache, cfg.cfg_scale
        self.shift = 1 if model.adapter.shift_logits else 0
        self.all_valid = bool(st.valid.all())
        self.cache = None
        self.any_order = cfg.any_order
        self.exact, self.causal = cfg.cache in ("block", "causal"), cfg.cache == "causal"
        self.rows = None  # exact caches: global row ids the cache holds, in cache order
        self.stored = 0  # exact caches: columns [0, stored) hold final keys/values

    def _call(self, rows, f0: int, f1: int, c0: int, c1: int, keep=None, **kw) -> torch.Tensor:
        st = self.st
        ids, valid, pos = st.x[rows, f0:f1], st.valid[rows], st.pos[rows, f0:f1]
        n = ids.shape[0]
        if self.cfg_scale > 0:  # unconditional branch: prompt tokens masked, run in the same batch
            # the condition is masked: the prompt, and any hints (the inpainting reference masks both)
            un = ids.masked_fill(st.fixed(rows, f0, f1), st.mask_id)
            ids, valid, pos = torch.cat([ids, un]), torch.cat([valid, valid]), torch.cat([pos, pos])
            keep = None if keep is None else torch.cat([keep, keep])
        out = self.model(ids, attention_mask=None if self.all_valid else valid, position_ids=pos,
                         request=LogitsRequest(rows=slice(c0 - self.shift - f0, c1 - self.shift - f0), keep=keep),
                         **kw).logits.float()
        logits = out if keep is not None else out.view(ids.shape[0], c1 - c0, -1)
        if self.cfg_scale > 0:
            half = logits.shape[0] // 2  # conditional rows (or kept positions) first
            cond, uncond = logits[:half], logits[half:]
            logits = uncond + (self.cfg_scale + 1) * (cond - uncond)
        return logits

    def full(self, rows, c0: int, c1: int, keep=None) -> torch.Tensor:
        if self.any_order:
            return self._any_order(rows, c0, c1, keep)
        return self._call(rows, 0, self.st.x.shape[1], c0, c1, keep)

    def _any_order(self, rows, c0: int, c1: int, keep=None) -> torch.Tensor:
        """d2-AnyOrder decoding (``cfg.any_order``): one [MASK] query per block position, seeing the prompt, every
        decoded token and itself (``dare.diffusion.anyorder``); the queries' raw logits are the predictions (a query
        already sits at the position that predicts its column, so no shift is applied here)."""
        st = self.st
        P = int(st.gen_start[0])
        steps = st.row_steps[rows]
        cols = torch.arange(c0 - P, c1 - P, device=st.x.device).expand(rows.numel(), -1)
        ids, pos, mask = anyorder_inputs(st.x[rows, :P], st.valid[rows, :P], st.x[rows, P:], st.step_map[rows, P:],
                                         cols, steps[:, None].expand_as(cols), st.mask_id, self.shift)
        W = ids.shape[1]
        logits = self.model(ids, attention_mask=mask, position_ids=pos,
                            request=LogitsRequest(rows=slice(W - (c1 - c0), W))).logits.float()
        return logits[keep] if keep is not None else logits

    def refresh(self, rows, c0: int, c1: int, keep=None) -> torch.Tensor:
        """Full forward that (re)builds the cache of every position, then keeps what the mode needs."""
        W = self.st.x.shape[1]
        self.cache, self.rows = self.model.new_cache(W), rows
        logits = self._call(rows, 0, W, c0, c1, keep, past_key_values=self.cache, store_kv=True)
        if self.kind == "prefix":
            self.cache.crop(c0 - self.shift)
        return logits

    def store(self, rows, c0: int) -> Optional[torch.Tensor]:
        """Exact caches: store the keys/values of columns [stored, c0) of ``rows`` (every row still decoding),
        attending to the stored columns and to themselves, causally with ``cache='causal'``. Returns then the logits
        [n, V] of the last column: the next-token prediction for column c0. A resumed decode starts with an empty
        cache: it stores the prompt and each finished block in turn, each seeing only what precedes it, as the
        uninterrupted decode did (with causal attention one pass is the same)."""
        st = self.st
        if self.cache is None:
            self.cache, self.rows = self.model.new_cache(st.x.shape[1]), rows
        elif rows.numel() != self.rows.numel():  # rows that finished leave the cache
            self.cache.select(torch.isin(self.rows, rows).nonzero().flatten())
            self.rows = rows
        dev, P = st.x.device, int(st.gen_start[0])
        bounds = [self.stored, c0]
        if not self.causal and self.stored < P < c0:  # resumed at block st.start[0] >= 1 (blocks of one size)
            bounds = [self.stored, *range(P, c0 + 1, (c0 - P) // st.start[0])]
        out = None
        for s0, s1 in zip(bounds[:-1], bounds[1:]):
            q, k = torch.arange(s0, s1, device=dev)[:, None], torch.arange(s1, device=dev)[None, :]
            allowed = st.valid[rows, None, :s1] & (k <= q) if self.causal else st.valid[rows, None, :s1]
            mask = (allowed | (k == q))[:, None]  # padding queries see themselves: finite states that nothing reads
            request = LogitsRequest(rows=slice(s1 - s0 - 1, s1 - s0), logits=self.causal, hidden=not self.causal)
            out = self.model(st.x[rows, s0:s1], attention_mask=mask, position_ids=st.pos[rows, s0:s1], request=request,
                             past_key_values=self.cache, kv_start=s0, store_kv=True)
        self.stored = c0
        return out.logits[:, -1].float() if self.causal else None

    def exact_step(self, rows, c0: int, c1: int, keep=None) -> torch.Tensor:
        """A denoising step of block [c0, c1) against the exact cache (its keys/values are scratch)."""
        st = self.st
        cache = self.cache
        if rows.numel() != self.rows.numel():
            cache = cache_rows(cache, torch.searchsorted(self.rows, rows))
        out = self.model(st.x[rows, c0:c1], attention_mask=None if self.all_valid else st.valid[rows, :c1],
                         position_ids=st.pos[rows, c0:c1], request=LogitsRequest(keep=keep), past_key_values=cache,
                         kv_start=c0)
        logits = out.logits.float()
        return logits if keep is not None else logits.view(rows.numel(), c1 - c0, -1)

    def step(self, rows, c0: int, c1: int, keep=None) -> torch.Tensor:
        """A cached step for ``rows`` (a subset of the refreshed rows: the step's keys/values are scratch)."""
        cache = self.cache
        if rows.numel() != self.rows.numel():
            idx = torch.searchsorted(self.rows, rows)
            if self.cfg_scale > 0:  # the cache holds [conditional rows ; unconditional rows]
                idx = torch.cat([idx, idx + self.rows.numel()])
            cache = cache_rows(cache, idx)
        f0 = c0 - self.shift
        if self.kind == "prefix":
            return self._call(rows, f0, self.st.x.shape[1], c0, c1, keep, past_key_values=cache)
        return self._call(rows, f0, c1, c0, c1, keep, past_key_values=cache, kv_start=f0)


def run_masked(model, st: DecodeState, cfg: SamplerConfig) -> None:
    remask = REMASKINGS[cfg.remasking]
    blocks = masked_blocks(cfg)
    total_steps = sum(blk.steps for blk in blocks)
    fwd = MaskedForward(model, st, cfg)
    # Only masked positions are decided, so only they need logits (the last layer's MLP and the LM head run for
    # them alone) where the remasking scores positions on their own.
    packed = takes_packed_logits(remask, masked_model=True)
    cached = cfg.cache in ("prefix", "dual")
    P, mask_id = int(st.gen_start[0]), st.mask_id
    b0, i0 = st.start
    for b in range(b0, len(blocks)):
        blk = blocks[b]
        act = st.active()
        if act.numel() == 0:
            break
        BL, spb = blk.length, blk.steps
        grid = sched.time_grid(spb, cfg.eps, device=st.x.device)
        c0, c1 = P + blk.start, P + blk.start + BL
        if fwd.exact:  # what precedes the block goes into the cache (on a resume too); causal: it seeds the block
            seed = fwd.store(act, c0)
            st.count_forward(act)
            if seed is not None and (b != b0 or i0 == 0):
                _seed(st, cfg, remask, act, c0, c1, seed)
                if cfg.eos_early_stop:
                    st.finish_rows_with_stop(act, final_only=True)
        masks0 = st.block_start_masks(act, c0, c1)
        if blk.counts is not None:
            counts = blk.counts.to(st.x.device).expand(act.numel(), -1)
        elif cfg.schedule == "linear":
            counts = sched.linear_split(masks0, spb)
        elif remask.time_grid:
            counts = sched.time_grid_split(masks0, spb, cfg.eps)
        else:
            counts = sched.even_split(masks0, spb)
        run_conf = torch.zeros((act.numel(), BL), dtype=torch.float64, device=st.x.device)
        i = first = i0 if b == b0 else 0
        while True:
            if st.should_pause(b, i):
                return
            masked_now = st.x[act, c0:c1] == mask_id
            open_ = masked_now.any(1) & ~st.finished[act]
            if not bool(open_.any()):
                break
            if i > max(spb, BL):  # every rule commits >= 1 token per step, or the schedule's count
                raise RuntimeError(f"block {b} did not finish after {i} steps (sampler bug)")
            if cached and i == first:  # the refresh builds the cache of every active row (also on resume)
                if packed:
                    logits = fwd.refresh(act, c0, c1, keep=masked_now & open_[:, None])
                else:
                    logits = fwd.refresh(act, c0, c1)[open_]
            else:
                step = fwd.exact_step if fwd.exact else fwd.step if cached else fwd.full
                logits = step(act[open_], c0, c1, keep=masked_now[open_] if packed else None)
            rows = act[open_]
            st.count_forward(act if cached and i == first else rows)
            step_i = min(i, spb - 1)
            ctx = _StepContext(cfg, remask, st, rows, c0, BL, step_i, spb, total_steps, grid)
            new_conf = _decide(ctx, logits, counts[open_], run_conf[open_])
            if new_conf is not None:
                run_conf[open_] = new_conf
            if cfg.eos_early_stop:
                st.finish_rows_with_stop(rows, final_only=True)
            i += 1
        if cfg.block_stop:
            st.finish_rows_with_stop(act, final_only=False)
    st.finished[:] = True


def _seed(st, cfg, remask, rows, c0: int, c1: int, logits: torch.Tensor) -> None:
    """``cache='causal'``: the block's first position, where still masked, takes the next token predicted by the
    causal pass that stored what precedes it (logits [n, V]); a step of its own for the trajectory."""
    if st.should_pause(int(c0 - st.gen_start[0]) // (c1 - c0), 0):  # a pause at the block's start: seeded on resume
        return
    cur = st.x[rows, c0:c1]
    open_ = cur[:, 0] == st.mask_id
    if not bool(open_.any()):
        return
    rows, cur, logits = rows[open_], cur[open_], logits[open_][:, None]
    cand = propose(logits, remask, cfg.temperature, cfg.top_k, cfg.top_p, st.row_gens(rows), masked_model=True,
                   forbid=st.mask_id)
    sel = torch.zeros_like(cur, dtype=torch.bool)
    sel[:, 0] = True
    new = cur.clone()
    new[:, 0] = cand.x0[:, 0]
    score = torch.zeros(cur.shape, dtype=cand.score.dtype, device=cur.device)
    score[:, 0] = cand.score[:, 0]
    ent = None
    if st.entropy_map is not None:
        ent = torch.zeros(cur.shape, dtype=torch.float32, device=cur.device)
        ent[:, :1] = committed_entropy(logits, sel[:, :1])
    st.commit(rows, c0, new, sel, x0=new, score=score, predicted=sel, entropy=ent)


class _StepContext:
    def __init__(self, cfg, remask, st, rows, c0, block_length, step_i, spb, total_steps, grid):
        self.cfg, self.remask, self.st, self.rows, self.c0, self.block_length = cfg, remask, st, rows, c0, block_length
        self.i, self.spb, self.total_steps, self.grid = step_i, spb, total_steps, grid


def _decide(ctx: _StepContext, logits: torch.Tensor, counts: torch.Tensor, run_conf: torch.Tensor) -> Optional[torch.Tensor]:
    """Choose and commit this step's tokens for ``ctx.rows`` from the block's logits [n, BL, V] (or those of its
    masked positions, packed [k, V]); returns the new running confidences (RCR)."""
    cfg, st, rows, c0 = ctx.cfg, ctx.st, ctx.rows, ctx.c0
    BL = ctx.block_length
    cur = st.x[rows, c0:c0 + BL]
    eligible = cur == st.mask_id
    gens = st.row_gens(rows)
    cand = propose(logits, ctx.remask, cfg.temperature, cfg.top_k, cfg.top_p, gens, masked_model=True,
                   forbid=st.mask_id, eligible=eligible)
    score = cand.score
    if cfg.suppress_eos_confidence:
        score = suppress_stops(score, cand.x0, st.stop_ids)
    if cfg.eoser:
        gamma = sched.eoser_gamma(st.row_steps[rows], ctx.total_steps, cfg.eoser_gamma_min, cfg.eoser_gamma_max, cfg.schedule)
        score = scale_stops(score, cand.x0, st.stop_ids, gamma.to(score.device))
    k = counts[:, ctx.i]
    if cfg.rcr:
        return _rcr_commit(ctx, cur, eligible, cand.x0, score, counts, run_conf)
    if ctx.remask.score == "origin":
        # Dream "origin": every mask moves independently with probability 1 - s/t (all on the last step).
        t, s = ctx.grid[ctx.i], ctx.grid[ctx.i + 1]
        p_move = (1 - s / t) if ctx.i < ctx.spb - 1 else torch.ones((), device=logits.device)
        u = torch.stack([torch.rand(BL, generator=g, device=logits.device) for g in gens])
        sel = eligible & (u < p_move)
    elif cfg.factor is not None:
        sel = select_factor(score, eligible, cfg.factor)
    elif ctx.remask.rule == "dynamic":
        sel = select_dynamic(score, eligible, cfg.threshold, k)
    elif cfg.threshold is not None:
        sel = select_threshold(score, eligible, cfg.threshold)
    elif cfg.alg_temp:
        sel = select_sampled(score, eligible, k, cfg.alg_temp, gens)
    else:
        sel = select_top(score, eligible, k)
    ent = committed_entropy(logits, sel, eligible) if st.entropy_map is not None else None
    st.commit(rows, c0, torch.where(sel, cand.x0, cur), sel, x0=cand.x0, score=score, predicted=eligible, entropy=ent)
    return None


def _rcr_commit(ctx, cur, eligible, x0, score, counts, run_conf) -> torch.Tensor:
    """MDPO running-confidence remasking: fill every mask, remember each fill's confidence, then re-mask the
    generated positions of the block with the lowest running confidence so that exactly the schedule's
    cumulative count stays unmasked. (The reference ranks the whole sequence; here earlier, finished
    blocks are final, so only the current block is ranked.)"""
    st, rows, c0 = ctx.st, ctx.rows, ctx.c0
    BL = cur.shape[1]
    filled = torch.where(eligible, x0, cur)
    run = torch.where(eligible, score.double(), run_conf)
    remaining = counts[:, ctx.i + 1:].sum(1)
    generated = ~st.fixed(rows, c0, c0 + BL)  # prompt tokens and hints are never re-masked
    low = ranks(run.masked_fill(~generated, float("inf")), descending=False) < remaining[:, None]
    remask = generated & low
    new = filled.masked_fill(remask, st.mask_id)
    st.commit(rows, c0, new, eligible & ~remask, x0=filled, score=run, predicted=generated)
    return run
