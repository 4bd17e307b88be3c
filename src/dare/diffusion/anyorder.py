"""The any-order (decode-order causal) form of a masked-diffusion model: d2-AnyOrder's attention (arXiv 2509.21474).

A model fine-tuned any-order (the authors' ``SFT_AO``) predicts a masked position from the prompt and the tokens
decoded before it *only*: masked positions never see each other. The sampler then follows one rule and the
trajectory likelihood is one forward. Both build their input here, so the conditionals they use are the same by
construction:

    input  = [prompt (P) ; canvas (Lc: the completion, not-yet-decoded tokens masked) ; Q query tokens]
    keys   : a prompt row sees the prompt;
             a decoded canvas token j sees the prompt and the decoded tokens k with (step_k, k) <= (step_j, j) --
             causal in decoding order, ties inside a step broken by position (the authors' pair decoding puts the
             two tokens of a step one after the other);
             a query q sees the prompt, the decoded tokens of steps < ``query_step[q]`` and itself;
             every row sees itself (padding and never-decoded rows have no other key: no empty softmax).
    query q: a [MASK] token at the position that predicts its column -- the column itself, or the one before it on
             a shifted-logit model (Dream predicts position i from row i - 1).

With ``query_step`` = the step that decoded the column, the query's logits are the distribution the token was drawn
from (``d2_anyorder``); in the sampler every query sees every decoded token (``query_step`` = the current step). No
physical reordering is needed: attention only sees the mask and the explicit position ids, so the true-position
layout here gives the same logits as the authors' decode-order layout (``[prompt, y in decode order, L masks]``);
their pair mask (``floor(c/2) < floor(r/2)``) is the case of two tokens per step, this is any number per step.
"""
from __future__ import annotations

import torch

from ..models.masks import positions_from_padding

NEVER = 2 ** 62  # the step of a token that was never decoded: no query's step exceeds it


def anyorder_attention(prompt_valid: torch.Tensor, key_step: torch.Tensor, query_step: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, 1, T, T]`` over ``[prompt (P) ; canvas (Lc) ; queries (Q)]``, T = P + Lc + Q (module docstring).

    ``prompt_valid [B, P]``: real prompt tokens; ``key_step [B, Lc]``: the step that decoded each canvas token
    (-1: not decoded, seen by nobody); ``query_step [B, Q]``: a query sees the tokens decoded at steps below it."""
    B, P = prompt_valid.shape
    Lc, Q = key_step.shape[1], query_step.shape[1]
    T = P + Lc + Q
    dev = key_step.device
    pv = prompt_valid.bool()
    done = key_step >= 0
    step = torch.where(done, key_step.long(), torch.full_like(key_step.long(), NEVER))
    # decoding order: step first, position inside a step; never-decoded tokens last (and invisible anyway)
    order = torch.where(done, step * Lc + torch.arange(Lc, device=dev), torch.full_like(step, NEVER))
    m = torch.zeros(B, T, T, dtype=torch.bool, device=dev)
    m[:, :P, :P] = pv[:, :, None] & pv[:, None, :]
    c = slice(P, P + Lc)
    m[:, c, :P] = done[:, :, None] & pv[:, None, :]
    m[:, c, c] = done[:, :, None] & done[:, None, :] & (order[:, None, :] <= order[:, :, None])
    q = slice(P + Lc, T)
    m[:, q, :P] = pv[:, None, :].expand(B, Q, P)
    m[:, q, c] = done[:, None, :] & (step[:, None, :] < query_step.long()[:, :, None])
    m |= torch.eye(T, dtype=torch.bool, device=dev)
    return m[:, None]


def anyorder_inputs(prompt_ids: torch.Tensor, prompt_valid: torch.Tensor, canvas: torch.Tensor, key_step: torch.Tensor,
                    query_cols: torch.Tensor, query_step: torch.Tensor, mask_id: int, shift: int = 0,
                    extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, attention_mask)`` of one any-order forward.

    ``canvas [B, Lc]`` (masked where not decoded), ``key_step [B, Lc]`` its decoding steps, ``query_cols [B, Q]`` the
    completion column each query predicts and ``query_step [B, Q]`` what it may see. Positions ignore left padding
    (completion column j of a row with p real prompt tokens is at position p + j); a query sits at ``p + col - shift``.
    ``extra`` appends that many unused [MASK] columns (a shifted model's last query is read one column later), each
    seeing only itself."""
    B, P = prompt_ids.shape
    Lc = canvas.shape[1]
    dev = canvas.device
    p_len = prompt_valid.long().sum(1, keepdim=True)
    pos = torch.cat([positions_from_padding(prompt_valid), p_len + torch.arange(Lc, device=dev),
                     p_len + query_cols.long() - shift], dim=1)
    queries = torch.full_like(query_cols, mask_id, dtype=canvas.dtype)
    ids = torch.cat([prompt_ids, canvas, queries], dim=1)
    mask = anyorder_attention(prompt_valid, key_step, query_step)
    if extra:
        T = ids.shape[1]
        ids = torch.cat([ids, torch.full((B, extra), mask_id, dtype=ids.dtype, device=dev)], dim=1)
        pos = torch.cat([pos, torch.zeros(B, extra, dtype=pos.dtype, device=dev)], dim=1)
        wide = torch.zeros(B, 1, T + extra, T + extra, dtype=torch.bool, device=dev)
        wide[:, :, :T, :T] = mask
        wide[:, :, T:, T:] = torch.eye(extra, dtype=torch.bool, device=dev)
        mask = wide
    return ids, pos.clamp_min(0), mask

