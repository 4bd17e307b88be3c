"""Block-diffusion sampler for block-causal models (SDAR, SDAR-MoE, LLaDA2.0, LLaDA2.1).

Blocks are absolute: block j covers positions [jB, (j+1)B) of each row's own sequence, so the first
decoded block may hold the prompt's tail (never changed). To batch prompts of different lengths the
buffer is laid out so that every row's block boundaries fall on the same buffer columns: row r gets
``B * (K - p_r // B)`` padding columns in front (K = max_r p_r // B) and starts decoding at column block K.
Rows then decode the same column block in lock step; a row ends after its last block
(``ceil((p_r + G) / B)``, as the references) or when it stops.

Attention is block-causal over absolute positions with the *sampler's* block length (the references build
the mask from ``block_length``). ``cache="block"`` is exact: finished blocks' keys/values are stored once and
each step feeds only the current block; storing rides along with the next block's first step, so every
forward is a denoising step (the references spend one extra forward per block on it). ``cache="none"``
recomputes ``x[:, :block_end]`` every step, as LLaDA2's HF ``generate`` does.

Per block: ``static`` commits the top k_s of the schedule (B split evenly over the steps), ``dynamic``
commits {p > threshold} if it has >= k_s members else the top k_s, ``sequential`` the leftmost k_s masks.
LLaDA2.1 editing (``editing_threshold``) also rewrites committed, non-prompt tokens whose prediction
changed with p > editing_threshold, and runs up to ``max_post_steps`` editing passes once the block has no
mask left. Unlike the SDAR reference, a step never commits more tokens than there are masks (its top-k
overflow rewrites prompt tokens).
"""
from __future__ import annotations

import torch

from ..models import LogitsRequest
from . import schedule as sched
from .config import SamplerConfig
from .selection import (REMASKINGS, committed_entropy, propose, scale_stops, select_dynamic, select_factor, select_top,
                        suppress_stops)
from .state import DecodeState, PromptBatch, cache_rows


def block_schedule(cfg: SamplerConfig) -> torch.Tensor:
    """Per-step commit counts within one block (over the block length, as SDAR and LLaDA2)."""
    B, G = cfg.block_length, cfg.gen_length
    if cfg.schedule == "ass":
        return sched.ass_split(B)
    if cfg.steps_per_block is not None:
        spb = cfg.steps_per_block
    else:
        if G % B or cfg.steps % (G // B):
            raise ValueError(f"steps={cfg.steps} (total) cannot be split over blocks of block_length={B} for "
                             f"gen_length={G}; set steps_per_block for block-diffusion models")
        spb = cfg.steps // (G // B)
    spb = min(spb, max(1, G // cfg.minimal_topk))  # LLaDA2.0's cap
    if spb > B:
        raise ValueError(f"steps_per_block={spb} exceeds block_length={B}: some steps would commit nothing")
    return sched.even_split(torch.tensor([B]), spb)[0]


def build_block_state(batch: PromptBatch, cfg: SamplerConfig, mask_id: int, pad_id: int, stop_ids, gens, record):
    B, G = cfg.block_length, cfg.gen_length
    p = batch.lengths
    dev = batch.ids.device
    first = p // B  # absolute block holding the first generated position
    K = int(first.max())
    nblk = (p + G + B - 1) // B - first
    pad = B * (K - first)
    W = B * (K + int(nblk.max()))
    rel = torch.arange(W, device=dev)[None] - pad[:, None]  # absolute position of every buffer column
    end = (first + nblk) * B
    valid = (rel >= 0) & (rel < end[:, None])
    is_prompt = (rel >= 0) & (rel < p[:, None])
    x = torch.full((p.shape[0], W), pad_id, dtype=torch.long, device=dev)
    x[valid] = mask_id
    x[is_prompt] = batch.ids[batch.mask]  # row-major order on both sides
    st = DecodeState(x, valid, rel.clamp_min(0), is_prompt, pad + p, G, mask_id, stop_ids, gens, record)
    st.first_block = K
    st.last_block = K + nblk - 1  # last column block of every row
    return st


class BlockForward:
    """Model calls of the block sampler.

    With the exact cache, every forward is a denoising step: the first step of a block also feeds the
    blocks whose keys/values are not stored yet (the prompt's full blocks, or the block just finished) and
    stores them on the way, so no forward is spent only on storing. Block-causal attention makes this the
    same computation as the references' separate "store the finished block" forward.
    """

    def __init__(self, model, st: DecodeState, cfg: SamplerConfig):
        self.model, self.st, self.B = model, st, cfg.block_length
        self.use_cache = cfg.cache == "block"
        self.cache = model.new_cache(st.x.shape[1]) if self.use_cache else None
        self.rows = None  # global row ids held by the cache, in cache order
        self.final = 0  # columns [0, final) hold final keys/values in the cache

    def _mask(self, rows, q0: int, q1: int, k1: int) -> torch.Tensor:
        """Block-causal bool mask [n, 1, q, k] over absolute positions; padding keys hidden. Padding queries
        see themselves, so their (unused) states stay finite and never put NaN into the cache."""
        st, B = self.st, self.B
        qb = st.pos[rows, q0:q1] // B
        kb = st.pos[rows, :k1] // B
        allowed = st.valid[rows, None, :k1] & (kb[:, None, :] <= qb[:, :, None])
        diag = torch.arange(q0, q1, device=qb.device)[:, None] == torch.arange(k1, device=qb.device)[None, :]
        return (allowed | diag)[:, None]

    def keep(self, rows) -> None:
        """Drop cache rows that are no longer decoded."""
        if self.rows is not None and rows.numel() != self.rows.numel():
            self.cache.select(torch.isin(self.rows, rows).nonzero().flatten())
        self.rows = rows

    def logits(self, rows, c0: int, c1: int, first_step: bool) -> torch.Tensor:
        """Logits [n, B, V] of block [c0, c1) for ``rows`` (with the cache: all rows the cache holds)."""
        st = self.st
        n = rows.numel()
        q0 = (self.final if first_step else c0) if self.use_cache else 0
        kw = {}
        if self.use_cache:
            cache = self.cache
            if rows.numel() != self.rows.numel():  # rows done with this block sit out (scratch step only)
                if first_step:
                    raise RuntimeError("the storing step of a block must run every cached row")
                cache = cache_rows(cache, torch.searchsorted(self.rows, rows))
            kw = dict(past_key_values=cache, kv_start=q0, store_kv=first_step)
        out = self.model(st.x[rows, q0:c1], attention_mask=self._mask(rows, q0, c1, c1), position_ids=st.pos[rows, q0:c1],
                         request=LogitsRequest(rows=slice(c0 - q0, c1 - q0)), **kw)
        if self.use_cache and first_step:
            self.final = c0  # everything before this block is final now; the block's own slots are scratch
        return out.logits.float().view(n, c1 - c0, -1)


def run_block(model, st: DecodeState, cfg: SamplerConfig) -> None:
    if model.adapter.shift_logits:
        raise ValueError("block decoding of shifted-logit models is not supported")
    remask = REMASKINGS[cfg.remasking]
    counts = None if cfg.editing else block_schedule(cfg).to(st.x.device)
    B = cfg.block_length
    fwd = BlockForward(model, st, cfg)
    n_col_blocks = st.x.shape[1] // B
    b0, i0 = st.start
    for cb in range(st.first_block + b0, n_col_blocks):
        act = st.active()
        if act.numel() == 0:
            break
        c0, c1 = cb * B, (cb + 1) * B
        if fwd.use_cache:
            fwd.keep(act)
        if cfg.editing:
            _editing_block(fwd, st, cfg, remask, act, c0, c1)
        else:
            b = cb - st.first_block
            if _standard_block(fwd, st, cfg, remask, counts, act, c0, c1, b, i0 if b == b0 else 0):
                return  # paused (generate(until_step=...)): the block is unfinished, nothing else is marked
        if cfg.block_stop or (cfg.editing and cfg.eos_early_stop):
            st.finish_rows_with_stop(act, final_only=False)
        st.finished[act[st.last_block[act] == cb]] = True
    st.finished[:] = True


def _block_logits(fwd, act, open_, c0, c1, first_step):
    """Logits of the open rows (the storing first step of a block runs every cached row)."""
    if fwd.use_cache and first_step:
        return fwd.logits(act, c0, c1, first_step)[open_]
    return fwd.logits(act[open_], c0, c1, first_step)


def _propose(st, cfg, remask, rows, logits, total_steps, forbid_mask: bool = True):
    cand = propose(logits, remask, cfg.temperature, cfg.top_k, cfg.top_p, st.row_gens(rows), masked_model=False,
                   forbid=st.mask_id if forbid_mask else None)
    score = cand.score
    if cfg.suppress_eos_confidence:
        score = suppress_stops(score, cand.x0, st.stop_ids)
    if cfg.eoser:
        gamma = sched.eoser_gamma(st.row_steps[rows], total_steps, cfg.eoser_gamma_min, cfg.eoser_gamma_max, cfg.schedule)
        score = scale_stops(score, cand.x0, st.stop_ids, gamma.to(score.device))
    return cand.x0, score


def _standard_block(fwd, st, cfg, remask, counts, act, c0, c1, b: int = 0, i0: int = 0) -> bool:
    """Decode column block [c0, c1) (the b-th generated block) from its step i0; True when paused inside it."""
    spb = counts.numel()
    total_steps = spb * int(st.last_block.max() - st.first_block + 1)
    dynamic = remask.rule == "dynamic" or cfg.threshold is not None  # block references' only threshold rule
    i = i0
    while True:
        if st.should_pause(b, i):
            return True
        open_ = (st.x[act, c0:c1] == st.mask_id).any(1) & ~st.finished[act]
        if not bool(open_.any()):
            break
        if i > max(spb, c1 - c0):  # every rule commits at least min(k, #masks) >= 1 token per step
            raise RuntimeError(f"block at column {c0} did not finish after {i} steps (sampler bug)")
        rows = act[open_]
        # The first step of the block (or of a resumed one) stores the keys/values of everything before it.
        logits = _block_logits(fwd, act, open_, c0, c1, i == i0)
        st.count_forward(act if fwd.use_cache and i == i0 else rows)
        cur = st.x[rows, c0:c1]
        eligible = cur == st.mask_id
        x0, score = _propose(st, cfg, remask, rows, logits, total_steps)
        k = counts[min(i, spb - 1)].expand(rows.numel())
        if cfg.factor is not None:
            sel = select_factor(score, eligible, cfg.factor)
        elif dynamic:
            sel = select_dynamic(score, eligible, cfg.threshold, k)
        else:  # static / sequential (position score) / random (uniform score)
            sel = select_top(score, eligible, k)
        ent = committed_entropy(logits, sel) if st.entropy_map is not None else None
        st.commit(rows, c0, torch.where(sel, x0, cur), sel, x0=x0, score=score, predicted=eligible, entropy=ent)
        if cfg.eos_early_stop:
            st.finish_rows_with_stop(rows, final_only=True)
        i += 1
    return False


def _editing_block(fwd, st, cfg, remask, act, c0, c1) -> None:
    """LLaDA2.1: mask-to-token (threshold, at least num_to_transfer) plus token-to-token edits.

    Edits follow the reference's greedy argmax even when it is the mask token (that re-masks the position;
    the random fixture model does it). Should edits keep a block from settling for 4 x block_length + 
    max_post_steps passes, edits stop and the remaining masks are filled (the reference would loop on).
    """
    n = act.numel()
    post = torch.zeros(n, dtype=torch.long, device=st.x.device)
    done = st.finished[act].clone()
    prompt = st.fixed(act, c0, c1)  # prompt tokens and hints are never edited
    k_min = torch.full((n,), cfg.num_to_transfer, dtype=torch.long, device=st.x.device)
    limit = 4 * (c1 - c0) + cfg.max_post_steps
    it = 0
    while True:
        cur_all = st.x[act, c0:c1]
        had_mask = (cur_all == st.mask_id).any(1)
        post += (~had_mask & ~done).long()
        done |= post > cfg.max_post_steps
        run = ~done
        if not bool(run.any()):
            break
        rows = act[run]
        logits = _block_logits(fwd, act, run, c0, c1, it == 0)
        st.count_forward(act if fwd.use_cache and it == 0 else rows)
        cur = cur_all[run]
        eligible = cur == st.mask_id
        x0, score = _propose(st, cfg, remask, rows, logits, 1)
        x0_e, score_e = (_propose(st, cfg, remask, rows, logits, 1, forbid_mask=False) if cfg.temperature == 0
                         else (x0, score))
        unmask = select_dynamic(score, eligible, cfg.threshold, k_min[run]) & eligible
        edit = ~eligible & ~prompt[run] & (score_e > cfg.editing_threshold) & (x0_e != cur) & (it < limit)
        new = torch.where(unmask, x0, torch.where(edit, x0_e, cur))
        st.commit(rows, c0, new, unmask | edit, x0=torch.where(eligible, x0, x0_e),
                  score=torch.where(eligible, score, score_e), predicted=~prompt[run])
        done[run] = ~had_mask[run] & ~edit.any(1)
        it += 1
