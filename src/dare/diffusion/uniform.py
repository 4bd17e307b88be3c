"""Uniform-noise corruption (DiffusionGemma) and the encoder/canvas training inputs built from it.

The forward process replaces each corrupted position by a token drawn uniformly from the vocabulary (it may draw the
clean token itself); there is no mask token. Which positions are corrupted is the same set every estimator draws
for masked diffusion, so the ELBO weights carry over unchanged (docs/algorithms/uniform_noise.md): only the
operator that builds the model input differs. Random tokens come from per-sample generators over the sample's real
positions only, so a sample's corrupted input never depends on batching or padding.

``packed_canvas_view`` builds the SFT input of an encoder-decoder model from packed rows: the encoder reads the
clean rows (every document: prompt, answer, EOS), the canvas holds each document's answer positions (corrupted),
blocked by ``canvas_length`` from the answer's first token; targets are the canvas positions plus the encoder's
next-token pairs (its autoregressive loss).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..models.canvas import CanvasLayout


def uniform_replace(ids: torch.Tensor, corrupted: torch.Tensor, vocab_size: int, gens: Sequence[torch.Generator],
                    valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``ids`` with the ``corrupted`` positions replaced by uniform random tokens of ``[0, vocab_size)``.

    Row i draws one token per real position (``valid``, default all) from ``gens[i]``, in position order."""
    if not vocab_size:
        raise ValueError("uniform-noise corruption needs the model's vocabulary size (adapter.vocab_size)")
    noise = ids.detach().cpu().clone()
    real = torch.ones_like(noise, dtype=torch.bool) if valid is None else valid.bool().cpu()
    for i, g in enumerate(gens):
        n = int(real[i].sum())
        if n:
            noise[i, real[i]] = torch.randint(0, vocab_size, (n,), generator=g)
    return torch.where(corrupted.bool(), noise.to(ids.device), ids)


def _runs(values: list) -> list[tuple[int, int, int]]:
    """(value, start, end) of the consecutive runs of ``values``."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((values[start], start, i))
            start = i
    return out


def packed_canvas_view(ids: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor, answer: torch.Tensor, noisy: torch.Tensor,
                       canvas_weight: torch.Tensor, canvas_length: int, self_condition: Optional[torch.Tensor] = None):
    """(input_ids, targets, labels, weight, layout) of packed SFT rows ``[R, L]`` for an encoder-decoder model.

    ``noisy`` is the corrupted row, ``canvas_weight [R, L]`` the per-position weight of the canvas targets (0 where a
    position is not scored). The returned tensors are over ``[encoder (L) ; canvas (A)]``, A the most answer
    positions of a row; encoder targets are next-token pairs inside a document (weight 1)."""
    R, L = ids.shape
    dev = ids.device
    cols = [torch.nonzero(answer[r]).flatten() for r in range(R)]
    A = max([int(c.numel()) for c in cols] + [1])
    canvas = torch.zeros(R, A, dtype=torch.long, device=dev)
    clean = torch.zeros(R, A, dtype=torch.long, device=dev)
    w = torch.zeros(R, A, dtype=torch.float32, device=dev)
    dpos = torch.zeros(R, A, dtype=torch.long, device=dev)
    ddoc = torch.full((R, A), -1, dtype=torch.long, device=dev)
    start = torch.zeros(R, A, dtype=torch.long, device=dev)
    for r in range(R):
        c = cols[r]
        n = c.numel()
        if not n:
            continue
        canvas[r, :n], clean[r, :n], w[r, :n] = noisy[r, c], ids[r, c], canvas_weight[r, c]
        dpos[r, :n], ddoc[r, :n] = pos[r, c], docs[r, c]
        first = {}  # each document's first answer position
        for d, s, _ in _runs(docs[r, c].tolist()):
            first[d] = int(pos[r, c[s]])
        base = torch.tensor([first[int(d)] for d in docs[r, c].tolist()], dtype=torch.long, device=dev)
        start[r, :n] = base + (pos[r, c] - base) // canvas_length * canvas_length
    # the encoder's autoregressive targets: token i+1 predicted at row i, within a document
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
    same = torch.cat([(docs[:, 1:] == docs[:, :-1]) & (docs[:, 1:] >= 0) & (pos[:, 1:] > pos[:, :-1]),
                      torch.zeros(R, 1, dtype=torch.bool, device=dev)], 1)
    layout = CanvasLayout(enc_pos=pos, enc_doc=docs.long(), dec_pos=dpos, dec_doc=ddoc, dec_block_start=start,
                          self_condition=self_condition)
    targets = torch.cat([same, w > 0], 1)
    labels = torch.cat([nxt, clean], 1)
    weight = torch.cat([same.float(), w], 1)
    return torch.cat([ids, canvas], 1), targets, labels, weight, layout
