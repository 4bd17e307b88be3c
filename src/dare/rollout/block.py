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
    split = sched.linear_split if cfg.schedule == "linear" else sched.even_split
    return split(torch.tensor([B]), spb)[0]


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
        self.shift = 1 if model.adapter.shift_logits else 0
        self.use_cache = cfg.cache in ("block", "dual")
        self.dual, self.sub = cfg.cache == "dual", cfg.sub_block_length
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

    def _cache_of(self, rows):
        """(the cache for ``rows``, their indices in it): the cache itself when they are all its rows (None), else a
        copy of their rows (a scratch step: what it writes is not kept)."""
        if rows.numel() == self.rows.numel():
            return self.cache, None
        idx = torch.searchsorted(self.rows, rows)
        return cache_rows(self.cache, idx), idx

    def window(self, rows, c0: int, c1: int, s0: int, s1: int) -> torch.Tensor:
        """Dual cache inside block [c0, c1): feed [s0, s1) against the cache, which holds the block's keys/values;
        the fed ones replace theirs (a refresh feeds the whole block). Prediction logits [n, s1 - s0, V]; with
        shifted logits the window's first position reuses its own row (it is never decided on such a step)."""
        st = self.st
        cache, idx = self._cache_of(rows)
        out = self.model(st.x[rows, s0:s1], attention_mask=self._mask(rows, s0, s1, c1), position_ids=st.pos[rows, s0:s1],
                         request=LogitsRequest(rows=slice(0, s1 - s0 - self.shift)), past_key_values=cache, kv_start=s0)
        if idx is not None:  # as the whole batch's window writes in place (the reference's block cache too): the fed
            # sub-block's keys/values stay until the next refresh or window overwrites them
            for i in range(cache.num_layers):
                self.cache.k[i][idx, :, s0:s1] = cache.k[i][:, :, s0:s1]
                self.cache.v[i][idx, :, s0:s1] = cache.v[i][:, :, s0:s1]
        logits = out.logits.float().view(rows.numel(), s1 - s0 - self.shift, -1)
        return torch.cat([logits[:, :1], logits], dim=1) if self.shift else logits

    def logits(self, rows, c0: int, c1: int, first_step: bool) -> torch.Tensor:
        """Prediction logits [n, B, V] of block [c0, c1) for ``rows`` (with the cache: all rows the cache holds).

        Shifted-logit models (Fast-dLLM v2) predict position c from row c - 1: the block's first position from the
        previous block's last row, which is fed only on the block's first step (and always without the cache). On
        the other steps that position is decided already (``_standard_block``), and it takes its own row, as the
        reference's ``cat([logits[:, :1], logits[:, :-1]])`` does."""
        st = self.st
        n = rows.numel()
        q0 = (self.final if first_step else c0) if self.use_cache else 0
        kw = {}
        if self.use_cache:
            cache, idx = self._cache_of(rows)  # rows done with this block sit out (scratch step only)
            if idx is not None and first_step:
                raise RuntimeError("the storing step of a block must run every cached row")
            kw = dict(past_key_values=cache, kv_start=q0, store_kv=first_step)
        lo = max(c0 - self.shift, q0)
        out = self.model(st.x[rows, q0:c1], attention_mask=self._mask(rows, q0, c1, c1), position_ids=st.pos[rows, q0:c1],
                         request=LogitsRequest(rows=slice(lo - q0, c1 - self.shift - q0)), **kw)
        if self.use_cache and first_step:
            self.final = c0  # everything before this block is final now; the block's own slots are scratch
        logits = out.logits.float().view(n, c1 - self.shift - lo, -1)
        if lo > c0 - self.shift:  # the row before the block was not fed
            logits = torch.cat([logits[:, :1], logits], dim=1)
        return logits


def run_block(model, st: DecodeState, cfg: SamplerConfig) -> None:
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


def _dual_logits(fwd, st, rows, c0: int, c1: int, eligible: torch.Tensor, refresh: torch.Tensor) -> torch.Tensor:
    """A later step of a block with ``cache='dual'`` (Fast-dLLM v2's ``use_block_cache``): a row whose current
    sub-block still starts with a mask, or that committed the block's first token on the step before, runs the whole
    block and keeps the block's keys/values (the reference's refresh rule); every other row feeds only its current
    sub-block against them (grouped by sub-block, so a row decodes as it would alone). Prediction logits
    [n, B, V]; positions outside the fed window are zero and never eligible."""
    n, B = eligible.shape
    pos = torch.arange(B, device=eligible.device)
    start = torch.where(eligible, pos, B).min(1).values  # the first eligible position: inside the current sub-block
    size = fwd.sub or B
    s0 = start // size * size
    masked = (st.x[rows, c0:c1] == st.mask_id).gather(1, s0[:, None]).squeeze(1)
    refresh = refresh | masked
    out = None
    for key in sorted({-1 if bool(r) else int(s) for r, s in zip(refresh.tolist(), s0.tolist())}):
        g = refresh if key < 0 else ~refresh & (s0 == key)
        a, z = (0, B) if key < 0 else (key, key + size)
        lg = fwd.window(rows[g], c0, c1, c0 + a, c0 + z)
        st.count_forward(rows[g])
        if out is None:
            out = lg.new_zeros((n, B, lg.shape[-1]))
        out[g, a:z] = lg
    return out


def _sub_block(eligible: torch.Tensor, size: int) -> torch.Tensor:
    """``eligible`` [n, B] kept only in each row's first sub-block of ``size`` positions that has an eligible one."""
    sub = torch.arange(eligible.shape[1], device=eligible.device) // size
    first = torch.where(eligible, sub, eligible.shape[1]).min(1).values
    return eligible & (sub[None, :] == first[:, None])


def _standard_block(fwd, st, cfg, remask, counts, act, c0, c1, b: int = 0, i0: int = 0) -> bool:
    """Decode column block [c0, c1) (the b-th generated block) from its step i0; True when paused inside it.

    Shifted-logit models (Fast-dLLM v2): a block whose first position is masked commits that position alone on its
    first step, from the previous block's last row -- the reference's "next token" of a finished block (or of a
    prefilled prompt that ends on a block boundary)."""
    next_token = bool(fwd.shift)
    spb = counts.numel()
    total_steps = spb * int(st.last_block.max() - st.first_block + 1)
    dynamic = remask.rule == "dynamic" or cfg.threshold is not None  # block references' only threshold rule
    after_next_token = torch.zeros(act.numel(), dtype=torch.bool, device=st.x.device)
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
        cur = st.x[rows, c0:c1]
        eligible = cur == st.mask_id
        if cfg.sub_block_length is not None:
            eligible = _sub_block(eligible, cfg.sub_block_length)
        if fwd.dual and i != i0:
            logits = _dual_logits(fwd, st, rows, c0, c1, eligible, after_next_token[open_] & (i == i0 + 1))
        else:  # the first step of the block (or of a resumed one) stores the keys/values of everything before it
            logits = _block_logits(fwd, act, open_, c0, c1, i == i0)
            st.count_forward(act if fwd.use_cache and i == i0 else rows)
        x0, score = _propose(st, cfg, remask, rows, logits, total_steps)
        # past the schedule (sub-blocks or a block's first token can leave masks): at least one token per step
        k = counts[min(i, spb - 1)].clamp_min(1 if i >= spb else 0).expand(rows.numel())
        if cfg.factor is not None:
            sel = select_factor(score, eligible, cfg.factor)
        elif dynamic:
            sel = select_dynamic(score, eligible, cfg.threshold, k)
        else:  # static / sequential (position score) / random (uniform score)
            sel = select_top(score, eligible, k)
        if next_token and i == 0:
            first = eligible[:, 0]
            sel = torch.where(first[:, None], torch.arange(c1 - c0, device=sel.device)[None, :] == 0, sel)
            after_next_token[open_] = first
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
    for name, bad in (("a shifted-logit model", fwd.shift), ("sub_block_length", cfg.sub_block_length is not None),
                      ("cache='dual'", fwd.dual)):
        if bad:
            raise ValueError(f"editing_threshold (LLaDA2.1 token editing) cannot be used with {name}: its passes "
                             f"decide the whole block from the block's own rows")
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
