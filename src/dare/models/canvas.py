"""The encoder/canvas layout of encoder-decoder block diffusion (DiffusionGemma), and its attention masks.

A causal encoder reads the *clean* context (prompt, and in training the clean response) into a KV cache; a
bidirectional decoder denoises the *canvas* (the noisy response, ``canvas_length`` tokens per block) and attends to
``[encoder KV ; canvas]``. One training forward scores every canvas block at once (block-causal, as the block NELBO
needs and as NeMo AutoModel trains it):

* an encoder query sees the encoder keys of its document at positions <= its own (sliding layers: the last
  ``sliding_window`` of them, transformers' ``kv > q - window``);
* a canvas query of block b sees the encoder keys of its document *strictly before the block's first position*
  (the prompt and the clean blocks < b: exactly the cache the sampler holds when it decodes block b; sliding layers:
  the last ``sliding_window - 1`` of them, what transformers' sliding cache keeps) and the canvas keys of block b.

Everything is a rule over per-token metadata (position, document, block start), so the same functions build the
masks of packed SFT rows, left-padded RL batches and the sampler's cached steps. Padding tokens have document -1;
padding queries attend to themselves only (finite states, never NaN in a cache). Masks are bool (True = attend),
``[B, 1, Lq, Lk]``, one per layer type (``full_attention`` / ``sliding_attention``) as transformers' Gemma layers
take them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .masks import positions_from_padding

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class CanvasLayout:
    """Per-token metadata of one encoder-decoder forward whose input is ``[encoder ids ; canvas ids]``.

    ``enc_*`` are ``[B, Le]``, ``dec_*`` ``[B, Lc]``; documents are -1 at padding. ``dec_block_start`` is the absolute
    position of the first token of each canvas token's block. ``self_condition [B]`` (training): samples whose canvas
    is denoised twice, the second pass fed the first pass's logits (None: no self-conditioning).
    """
    enc_pos: torch.Tensor
    enc_doc: torch.Tensor
    dec_pos: torch.Tensor
    dec_doc: torch.Tensor
    dec_block_start: torch.Tensor
    self_condition: Optional[torch.Tensor] = None

    @property
    def enc_len(self) -> int:
        return self.enc_pos.shape[1]

    def encoder_masks(self, sliding_window: Optional[int]) -> dict[str, torch.Tensor]:
        n = self.enc_len
        return encoder_masks(self.enc_pos, self.enc_doc, self.enc_pos, self.enc_doc, sliding_window, {FULL: n, SLIDING: n})

    def decoder_masks(self, sliding_window: Optional[int]) -> dict[str, torch.Tensor]:
        n = self.enc_len
        return decoder_masks(self.dec_pos, self.dec_doc, self.dec_block_start, self.enc_pos, self.enc_doc,
                             sliding_window, {FULL: n, SLIDING: n})


def _pad_diagonal(allowed: torch.Tensor, q_doc: torch.Tensor, offset: int) -> torch.Tensor:
    """Padding query i also sees key ``offset + i`` (itself), so no softmax row is empty."""
    q = q_doc.shape[1]
    eye = torch.zeros(allowed.shape[-2:], dtype=torch.bool, device=allowed.device)
    eye[torch.arange(q), offset + torch.arange(q)] = True
    return allowed | (eye[None] & (q_doc < 0)[:, :, None])


def encoder_masks(q_pos, q_doc, k_pos, k_doc, sliding_window: Optional[int], key_counts: dict) -> dict[str, torch.Tensor]:
    """Causal encoder masks. The queries are the last ``q`` of the keys; layer type t sees the last
    ``key_counts[t]`` keys (a sliding cache holds only the end of the context)."""
    out = {}
    for kind, n in key_counts.items():
        kp, kd = k_pos[:, k_pos.shape[1] - n:], k_doc[:, k_doc.shape[1] - n:]
        ok = (kd[:, None, :] == q_doc[:, :, None]) & (kd[:, None, :] >= 0) & (kp[:, None, :] <= q_pos[:, :, None])
        if kind == SLIDING and sliding_window:
            ok &= (q_pos[:, :, None] - kp[:, None, :]) < sliding_window
        out[kind] = _pad_diagonal(ok, q_doc, n - q_pos.shape[1])[:, None]
    return out


def decoder_masks(q_pos, q_doc, q_block_start, enc_pos, enc_doc, sliding_window: Optional[int],
                  enc_counts: dict) -> dict[str, torch.Tensor]:
    """Canvas masks over ``[the last enc_counts[t] encoder keys ; the canvas]`` (see the module docstring)."""
    same_block = ((q_doc[:, :, None] == q_doc[:, None, :]) & (q_doc[:, None, :] >= 0)
                  & (q_block_start[:, :, None] == q_block_start[:, None, :]))
    out = {}
    for kind, n in enc_counts.items():
        kp, kd = enc_pos[:, enc_pos.shape[1] - n:], enc_doc[:, enc_doc.shape[1] - n:]
        ok = (kd[:, None, :] == q_doc[:, :, None]) & (kd[:, None, :] >= 0) & (kp[:, None, :] < q_block_start[:, :, None])
        if kind == SLIDING and sliding_window:
            ok &= kp[:, None, :] >= q_block_start[:, :, None] - (sliding_window - 1)
        full = torch.cat([ok, same_block], dim=2)
        out[kind] = _pad_diagonal(full, q_doc, n)[:, None]
    return out


def completion_layout(prompt_mask: torch.Tensor, completion_len: int, canvas_length: int, encoded_len: int,
                      completion_valid: Optional[torch.Tensor] = None) -> CanvasLayout:
    """Layout of ``[left-padded prompt ; clean completion[:encoded_len] ; canvas = noisy completion]`` (RL, DPO).

    Canvas block b covers completion positions ``[b C, (b+1) C)`` and sees the prompt and the clean blocks before
    it, as the sampler decoded it. ``encoded_len`` clean completion tokens are encoded: the blocks before the last
    one (what any canvas can see). ``completion_valid`` marks canvas tokens that exist (None: all).
    """
    B, P = prompt_mask.shape
    dev = prompt_mask.device
    prompt_len = prompt_mask.long().sum(1)
    valid = torch.ones(B, completion_len, dtype=torch.bool, device=dev) if completion_valid is None else completion_valid.bool()
    enc_valid = torch.cat([prompt_mask.bool(), valid[:, :encoded_len]], 1)
    enc_pos = positions_from_padding(enc_valid)
    k = torch.arange(completion_len, device=dev)
    dec_pos = prompt_len[:, None] + k[None]
    block_start = prompt_len[:, None] + (k // canvas_length * canvas_length)[None]
    zero = torch.zeros((), dtype=torch.long, device=dev)
    return CanvasLayout(enc_pos=enc_pos, enc_doc=torch.where(enc_valid, zero, zero - 1), dec_pos=dec_pos,
                        dec_doc=torch.where(valid, zero, zero - 1), dec_block_start=block_start)


def encoded_completion_len(completion_len: int, canvas_length: int) -> int:
    """Clean completion tokens the canvases can see: every block but the last."""
    if completion_len <= 0:
        return 0
    return (completion_len - 1) // canvas_length * canvas_length
