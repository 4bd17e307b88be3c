"""Per-step token choice: sample candidates x0, score them, and decide which positions to commit.

Everything works on one block of R rows at a time: ``logits [R, L, V]`` (already aligned with the
positions they predict), ``eligible [R, L]`` (masked positions of the current block). Random draws use
one ``torch.Generator`` per row, so a row's draws never depend on the other rows in the batch.

A remasking strategy is a registry entry (``REMASKINGS``), not a branch on a name: it says how to
score a candidate, which count schedule a masked model uses, and which sampling convention applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class Remasking:
    name: str
    # prob: p(x0) | margin: p1 - p2 | neg_entropy: sum p log p | uniform: U(0,1) | position: leftmost first
    # | origin: Dream's random-time unmasking (no score; each mask moves with probability 1 - s/t)
    score: str
    # Masked models: Dream's eps time grid decides the per-step count instead of LLaDA's even split.
    time_grid: bool = False
    # Masked models: LLaDA's float64 Gumbel-max sampling with confidences from the float64 softmax of the
    # untempered logits (Fast-dLLM). Otherwise the categorical convention of Dream / SDAR / LLaDA2:
    # logits / T, top-k / top-p, float32 softmax, confidence = p(x0) under those probabilities.
    gumbel64: bool = False
    # "fixed": count from the schedule; "dynamic": {p > threshold} if it has >= k members, else top-k.
    rule: str = "fixed"
    block_models: bool = True  # usable by the block-diffusion sampler
    prob_like: bool = True  # score is a probability-like value >= 0 (EOSER can scale it)


REMASKINGS: dict[str, Remasking] = {}


def register_remasking(r: Remasking) -> Remasking:
    REMASKINGS[r.name] = r
    return r


for _r in (
    Remasking("low_confidence", "prob", gumbel64=True),
    Remasking("random", "uniform", gumbel64=True),
    Remasking("maskgit_plus", "prob", time_grid=True),
    Remasking("topk_margin", "margin", time_grid=True),
    Remasking("entropy", "neg_entropy", time_grid=True, prob_like=False),
    Remasking("origin", "origin", time_grid=True, block_models=False),
    Remasking("static", "prob"),
    Remasking("dynamic", "prob", rule="dynamic"),
    Remasking("sequential", "position", prob_like=False),
):
    register_remasking(_r)


# --- logits filters and sampling -------------------------------------------------------------------
def filter_logits(logits: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> torch.Tensor:
    """Top-k then nucleus filtering (filtered entries get -inf); a no-op when both are off."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum > top_p
        drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses top_p
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def _per_row_uniform(gens: Sequence[torch.Generator], shape, dtype, device) -> torch.Tensor:
    """U(0, 1) of ``shape`` for every row from its own generator, written in place (the same draws as one
    ``torch.rand(shape, generator=g)`` per row, without stacking copies)."""
    out = torch.empty((len(gens), *shape), dtype=dtype, device=device)
    for r, g in enumerate(gens):
        out[r].uniform_(0.0, 1.0, generator=g)
    return out


def _categorical(probs: torch.Tensor, gens: Sequence[torch.Generator]) -> torch.Tensor:
    """One sample per position from ``probs [R, L, V]``, each row with its own generator."""
    R, L, V = probs.shape
    return torch.stack([torch.multinomial(probs[r], 1, generator=gens[r]).view(L) for r in range(R)])


@dataclass
class Candidates:
    x0: torch.Tensor  # [R, L] candidate tokens
    score: torch.Tensor  # [R, L] confidence used for ranking (float32 or float64)


def _argmax_excluding(scores: torch.Tensor, token: Optional[int]) -> torch.Tensor:
    """argmax over the last axis, never ``token`` (the mask id): a "committed" mask would stay masked
    forever. A trained model never predicts it, a random one can. Where the argmax is not ``token`` this is
    exactly ``argmax`` (first index on ties), so decoding equals the references'."""
    x0 = scores.argmax(-1)
    if token is None or not bool((x0 == token).any()):  # the second-best pass only where it can matter
        return x0
    top2 = scores.topk(2, dim=-1).indices
    alt = torch.where(top2[..., 0] == token, top2[..., 1], top2[..., 0])
    return torch.where(x0 == token, alt, x0)


def _prob_at(logits: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """softmax(logits)[idx] computed in ``dtype`` (Fast-dLLM: float64) a bounded number of rows at a time, so a
    large vocabulary times many rows never materialises a full float64 copy."""
    V = logits.shape[-1]
    flat, flat_idx = logits.reshape(-1, V), idx.reshape(-1, 1)
    out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
    step = max(1, chunk_elems // V)
    for s in range(0, flat.shape[0], step):
        part = flat[s:s + step].to(dtype)
        out[s:s + step] = (part.gather(1, flat_idx[s:s + step])[:, 0] - torch.logsumexp(part, -1)).exp()
    return out.view(idx.shape)


def _gumbel64(logits: torch.Tensor, u: Optional[torch.Tensor], temperature: float, top_k, top_p,
              forbid: Optional[int], confidence: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """LLaDA's float64 Gumbel-max on positions ``logits [n, V]`` with their uniforms ``u [n, V]`` (None when
    greedy): argmax exp(l) / (-log u)^T == a sample from softmax(l / T); and p(x0) under the float64 softmax.
    ``u`` is consumed (the same elementwise ops as the out-of-place formula, so the same bits)."""
    filt = filter_logits(logits, top_k, top_p)
    if u is not None:
        x0 = _argmax_excluding(filt.double().exp_().div_(u.log_().neg_().pow_(temperature)), forbid)
    else:
        x0 = _argmax_excluding(filt, forbid)
    return x0, (_prob_at(filt, x0, torch.float64) if confidence else None)


def takes_packed_logits(remask: Remasking, masked_model: bool) -> bool:
    """Whether ``propose`` can work from the logits of the eligible positions alone (``logits [n, V]``): the
    float64 Gumbel-max convention scores every position on its own; the categorical one draws per row over the
    whole block."""
    return masked_model and remask.gumbel64


def propose(logits: torch.Tensor, remask: Remasking, temperature: float, top_k, top_p,
            gens: Optional[Sequence[torch.Generator]], masked_model: bool, forbid: Optional[int] = None,
            eligible: Optional[torch.Tensor] = None) -> Candidates:
    """Candidate tokens and their scores for every position of the block (never the ``forbid`` token;
    confidences still come from the full distribution).

    ``eligible [R, L]``: the caller reads candidates only there (masked positions). Under the float64 Gumbel-max
    convention (``takes_packed_logits``) the vocabulary-wide work (sampling, confidences) then runs only there;
    elsewhere x0 is 0 and the score 0. Every row still draws its random numbers for the whole block, so its random
    stream, and every eligible result, is unchanged; ``logits`` may then be ``[n, V]``: the eligible positions only,
    in row-major order. The categorical convention draws per row over the whole block and ignores ``eligible``."""
    logits = logits.float()
    packed = logits.dim() == 2
    if packed and (eligible is None or not takes_packed_logits(remask, masked_model)):
        raise ValueError(f"packed logits [n, V] need eligible positions and a remasking that scores positions on "
                         f"their own (remasking {remask.name!r}, masked model: {masked_model})")
    if masked_model and remask.gumbel64:
        R, L = eligible.shape if packed else logits.shape[:2]
        V = logits.shape[-1]
        u = _per_row_uniform(gens, (L, V), torch.float64, logits.device) if temperature > 0 else None
        conf = remask.score != "uniform"
        if not packed and (eligible is None or bool(eligible.all())):
            x0, score = _gumbel64(logits.view(R * L, V), None if u is None else u.view(R * L, V), temperature,
                                  top_k, top_p, forbid, conf)
            x0, score = x0.view(R, L), (score.view(R, L) if conf else None)
        else:
            x0_e, score_e = _gumbel64(logits if packed else logits[eligible], None if u is None else u[eligible],
                                      temperature, top_k, top_p, forbid, conf)
            x0 = torch.zeros((R, L), dtype=torch.long, device=logits.device).masked_scatter_(eligible, x0_e)
            score = None if not conf else torch.zeros((R, L), dtype=torch.float64,
                                                       device=logits.device).masked_scatter_(eligible, score_e)
        if not conf:
            score = _per_row_uniform(gens, (L,), torch.float32, x0.device)
        return Candidates(x0, score)
    scaled = logits / temperature if temperature > 0 else logits
    filt = filter_logits(scaled, top_k, top_p)
    probs = filt.softmax(-1)
    if temperature > 0:
        drop = torch.tensor([forbid], device=probs.device) if forbid is not None else None
        x0 = _categorical(probs if drop is None else probs.index_fill(-1, drop, 0.0), gens)
    else:
        x0 = _argmax_excluding(filt, forbid)
    if remask.score == "margin":
        top2 = probs.topk(2, dim=-1).values
        score = top2[..., 0] - top2[..., 1]
    elif remask.score == "neg_entropy":
        score = (probs * torch.log(probs + 1e-10)).sum(-1)
    elif remask.score == "uniform":
        score = _per_row_uniform(gens, x0.shape[1:], torch.float32, x0.device)
    elif remask.score == "position":
        L = x0.shape[1]
        score = -torch.arange(L, dtype=torch.float32, device=x0.device).expand(x0.shape)
    else:  # prob (and origin, which only needs x0)
        score = probs.gather(-1, x0[..., None]).squeeze(-1)
    return Candidates(x0, score)


def committed_entropy(logits: torch.Tensor, sel: torch.Tensor, eligible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[R, L]`` fp32: the entropy (nats) of ``softmax(logits)`` -- the model's distribution at temperature 1, no
    top-k / top-p -- at the committed positions ``sel [R, L]``, 0 elsewhere (``Record.entropy``). ``logits`` are the
    block's ``[R, L, V]``, or ``[n, V]`` packed over the ``eligible`` positions (``sel`` is a subset of them). Only
    the committed rows are evaluated: a few per step, so recording costs little next to the forward."""
    rows = logits[sel[eligible]] if logits.dim() == 2 else logits[sel]
    logp = torch.log_softmax(rows.float(), dim=-1)
    h = -(logp.exp() * logp).sum(-1)  # -sum p log p: no cancellation, exact 0 for a one-hot distribution
    return torch.zeros(sel.shape, dtype=torch.float32, device=sel.device).masked_scatter_(sel, h)


# --- confidence adjustments ------------------------------------------------------------------------
def is_stop(tokens: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    return torch.isin(tokens, stop_ids)


def suppress_stops(score: torch.Tensor, x0: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """Predicted stop tokens rank last among the eligible positions (LLaDA's eos/eot confidence -inf fix).

    The lowest finite value, not -inf: -inf marks non-eligible positions, which must never be picked.
    """
    return score.masked_fill(is_stop(x0, stop_ids), torch.finfo(score.dtype).min)


def scale_stops(score: torch.Tensor, x0: torch.Tensor, stop_ids: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """EOSER: the confidence of a predicted stop token times gamma [R] (per row: its own global step)."""
    g = gamma.to(score.dtype)[:, None].expand_as(score)
    return torch.where(is_stop(x0, stop_ids), score * g, score)


# --- selection rules --------------------------------------------------------------------------------
def masked_score(score: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    return score.masked_fill(~eligible, float("-inf"))


def ranks(score: torch.Tensor, descending: bool = True) -> torch.Tensor:
    """Rank of every position (0 = best); ties keep index order."""
    order = score.argsort(dim=-1, descending=descending, stable=True)
    r = torch.empty_like(order)
    r.scatter_(-1, order, torch.arange(score.shape[-1], device=score.device).expand_as(order))
    return r


def select_top(score: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The min(k, #eligible) best eligible positions per row (never a non-eligible one)."""
    k = torch.minimum(k, eligible.sum(-1))
    return eligible & (ranks(masked_score(score, eligible)) < k[:, None])


def select_threshold(score: torch.Tensor, eligible: torch.Tensor, tau: float) -> torch.Tensor:
    """Fast-dLLM: every eligible position with confidence >= tau, and always the best one."""
    best = ranks(masked_score(score, eligible)) == 0
    return eligible & ((score >= tau) | best)


def select_dynamic(score: torch.Tensor, eligible: torch.Tensor, tau: float, k: torch.Tensor) -> torch.Tensor:
    """SDAR / LLaDA2: {p > tau} if it has at least k members, else the top min(k, #eligible)."""
    high = eligible & (score > tau)
    enough = high.sum(-1) >= k
    return torch.where(enough[:, None], high, select_top(score, eligible, k))


def select_factor(score: torch.Tensor, eligible: torch.Tensor, factor: float) -> torch.Tensor:
    """Fast-dLLM factor decoding: the longest prefix of sorted confidences with c_n >= 1 - f / (n + 1).

    Mirrors the reference loop exactly, including its edge case: when the first failure is the last
    eligible position (or nothing fails) every eligible token is accepted; at least one always is.
    """
    s = masked_score(score, eligible)
    srt = s.sort(dim=-1, descending=True).values
    n = eligible.sum(-1)
    L = s.shape[-1]
    j = torch.arange(L, device=s.device)
    thr = 1.0 - factor / (j.to(srt.dtype) + 2.0)
    thr[0] = -1.0
    fail = (srt < thr) & (j[None] < n[:, None])
    first = torch.where(fail.any(-1), fail.float().argmax(-1), n)
    count = torch.where(first >= n - 1, n, first).clamp_min(torch.ones_like(n).clamp_max(n))
    return eligible & (ranks(s) < count[:, None])


def select_sampled(score: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor, alg_temp: float,
                   gens: Sequence[torch.Generator]) -> torch.Tensor:
    """Dream's alg_temp > 0: draw k positions without replacement from softmax(score / alg_temp)."""
    w = masked_score(score.float(), eligible) / alg_temp
    probs = torch.softmax(w, dim=-1)
    out = torch.zeros_like(eligible)
    k = torch.minimum(k, eligible.sum(-1)).tolist()
    for r, kr in enumerate(k):
        if kr > 0:
            out[r, torch.multinomial(probs[r], kr, replacement=False, generator=gens[r])] = True
    return out
