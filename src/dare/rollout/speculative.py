"""Linear speculative decoding (Nemotron-Labs-Diffusion's ``linear_spec_generate``): the model drafts a block
bidirectionally and verifies it causally, with the same weights (``adapter.causal_mode``).

Per row: a causal prefill of the prompt stores its keys/values and predicts the first token. Then, until the row has
``gen_length`` tokens or a stop token: a block of ``block_length`` opens with the last accepted token and masks; the
draft fills the masks against the cache (full attention, nothing stored): every mask at once, or with ``threshold``
the masks whose confidence reaches it (at least the most confident one) per forward until none is left; the verify
runs the drafted block causally, storing its keys/values, and its argmax predicts each next position. The longest
prefix of the draft that the verify predicts is accepted, plus the verify's token after it (at least one token per
block); the cache keeps the accepted positions only. The tokens written are the verify's (equal to the draft's where
accepted). A row's completion can overrun ``gen_length`` by up to ``block_length - 1`` tokens in the reference; here
it is cut at ``gen_length``. A row always ends at its first stop token (``eos_early_stop`` and ``block_stop`` change
nothing here) and ``steps`` has no meaning (each block takes as many draft forwards as the threshold needs).

Rows decode one at a time (their accepted lengths differ, so their caches do); greedy decoding of a row is the same
alone or batched.
"""
from __future__ import annotations

import torch

from ..models import LogitsRequest
from .config import SamplerConfig
from .selection import REMASKINGS, propose, select_threshold
from .state import DecodeState


def run_linear_spec(model, st: DecodeState, cfg: SamplerConfig) -> None:
    if st.record:
        raise ValueError("a trajectory cannot be recorded with speculative decoding: its blocks are not denoising "
                         "steps of a schedule (a draft's tokens are replaced by the verify's)")
    for r in st.active().tolist():
        _decode_row(model, st, cfg, r)
    st.finished[:] = True


def _next(st: DecodeState, cfg: SamplerConfig, remask, row: torch.Tensor,
          logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and confidences [1, n] of ``logits [1, n, V]`` (argmax at temperature 0, never the mask token)."""
    cand = propose(logits, remask, cfg.temperature, cfg.top_k, cfg.top_p, st.row_gens(row), masked_model=True,
                   forbid=st.mask_id)
    return cand.x0, cand.score


def _decode_row(model, st: DecodeState, cfg: SamplerConfig, r: int) -> None:
    row = torch.tensor([r], device=st.x.device)
    remask = REMASKINGS[cfg.remasking]
    P, G, L, mask = int(st.gen_start[r]), st.gen_length, cfg.block_length, st.mask_id
    p0 = int((~st.valid[r, :P]).sum())  # left padding: the row's own tokens start here
    cache = model.new_cache(P - p0 + G + L)

    def forward(tokens: torch.Tensor, start: int, causal: bool, store: bool, last: bool = False) -> torch.Tensor:
        """Logits [1, n, V] of ``tokens [1, n]`` at row positions start.. against the cache (causal or full); with
        ``last`` those of the last position only [1, 1, V]."""
        n = tokens.shape[1]
        pos = torch.arange(start, start + n, device=st.x.device)[None]
        attn = (torch.arange(start + n, device=st.x.device) <= pos[0, :, None])[None, None] if causal else None
        out = model(tokens, attention_mask=attn, position_ids=pos, past_key_values=cache, kv_start=start,
                    store_kv=store, request=LogitsRequest(rows=slice(n - 1, n) if last else None))
        st.count_forward(row)
        return out.logits.float()

    prompt = st.x[row, p0:P]
    first, _ = _next(st, cfg, remask, row, forward(prompt, 0, True, True, last=True))
    out, total = [first[0]], 1  # generated tokens, and how many
    stops = st.stop_ids
    while not bool(torch.isin(out[-1], stops).any()) and total < G:
        start = P - p0 + total - 1  # the block opens with the last accepted token
        block = torch.full((1, L), mask, dtype=torch.long, device=st.x.device)
        block[0, 0] = out[-1][-1]
        while bool((block == mask).any()):  # the draft (nothing stored)
            eligible = block == mask
            x0, score = _next(st, cfg, remask, row, forward(block, start, False, False))
            take = select_threshold(score, eligible, cfg.threshold) if cfg.threshold else eligible
            block = torch.where(take, x0, block)
        ar, _ = _next(st, cfg, remask, row, forward(block, start, True, True))  # the verify (stored)
        agree = (ar[0, :-1] == block[0, 1:]).long().cumprod(0)
        accepted = int(agree.sum()) + 1
        cache.crop(start + accepted)
        out.append(ar[0, :accepted])
        total += accepted
    gen = torch.cat(out)
    hit = torch.isin(gen, stops).nonzero()
    gen = gen[:int(hit[0]) + 1] if hit.numel() else gen
    gen = gen[:G]
    written = torch.zeros((1, G), dtype=torch.bool, device=st.x.device)
    written[0, :gen.numel()] = True
    new = st.x[row, P:P + G].clone()
    new[0, :gen.numel()] = gen
    st.commit(row, P, new, written, x0=new, score=written.float(), predicted=written)
