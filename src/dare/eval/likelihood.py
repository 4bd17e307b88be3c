"""Log-likelihood of a continuation under a diffusion LM: the ELBO Monte-Carlo estimate (algorithms.md §0.1).

A masked-diffusion model has no exact ``log p(y | x)``; LLaDA scores answers with the NELBO bound in its
low-variance form: draw ``l ~ U{1..L}``, mask exactly ``l`` of the ``L`` answer tokens uniformly, keep the
prompt clean, and weight the masked log-probs by ``L / l``::

    log p(y | x) >= E_l E_mask [ (L / l) * sum_{masked i} log p(y_i | x, y_masked) ]

The ``l`` of the MC samples are stratified (``l_j = ((k + floor(j L / n)) mod L) + 1`` for one random ``k``), so a
sample count that is a multiple of ``L`` visits every ``l`` equally often. Dream's shifted logits are read
through ``model.adapter.prediction_rows``. Block-diffusion models (SDAR, LLaDA2) are scored with their
training layout ``[x_t ; x_0]``, so each noisy block conditions on the clean earlier blocks: the block NELBO.
(With one shared ``l`` per row the estimator equals the sum of the per-block bounds; see docs/eval.md.)
Uniform-noise encoder-decoder models (DiffusionGemma) use the same estimator with the chosen tokens replaced by
uniform random tokens, the context in the encoder and the continuation as canvases: the indicator ELBO of
docs/algorithms/uniform_noise.md.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..diffusion.corruption import apply_mask, block_diffusion_inputs, exact_count_mask
from ..diffusion.logprob import score_targets


def stratified_counts(length: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` mask counts in ``1..length``, evenly spread from one uniform offset (LLaDA's stratification)."""
    if length <= 0 or n <= 0:
        raise ValueError(f"need a positive length and sample count, got length={length}, n={n}")
    k = int(torch.randint(0, length, (1,), generator=gen).item())
    # floor(j L / n) rather than LLaDA's round(linspace): identical for n <= L up to rounding, and exactly
    # uniform over 1..L whenever n is a multiple of L.
    offsets = torch.div(torch.arange(n) * length, n, rounding_mode="floor")
    return ((k + offsets) % length) + 1


def _score_canvas_rows(model, seq: torch.Tensor, masked: torch.Tensor, P: int, gen: torch.Generator) -> torch.Tensor:
    """Encoder-decoder models: ``seq[:, :P]`` is encoded, ``seq[:, P:]`` is the canvas with its ``masked`` positions
    replaced by uniform random tokens; the canvas blocks see the clean blocks before them."""
    from ..diffusion.uniform import uniform_replace
    from ..models.canvas import completion_layout, encoded_completion_len
    device = model.device
    b, L = seq.shape[0], seq.shape[1] - P
    C = model.adapter.block_size
    E = encoded_completion_len(L, C)
    cont = seq[:, P:]
    noisy = uniform_replace(cont, masked[:, P:], model.adapter.vocab_size, [gen] * b)
    inputs = torch.cat([seq[:, :P + E], noisy], 1).to(device)
    layout = completion_layout(torch.ones(b, P, dtype=torch.bool, device=device), L, C, E)
    targets = torch.cat([torch.zeros(b, P + E, dtype=torch.bool), masked[:, P:]], 1).to(device)
    labels = torch.cat([seq[:, :P + E], cont], 1).to(device)
    logp, _ = score_targets(model, inputs, targets, labels, layout=layout)
    return logp.sum(dim=1)


def _score_rows(model, seq: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Sum of log p(seq_i) over the masked positions of each row ([b] fp32), one forward pass."""
    device = model.device
    noisy = apply_mask(seq, masked, model.adapter.mask_token_id).to(device)
    seq, masked = seq.to(device), masked.to(device)
    if model.adapter.is_block_causal:
        pos = torch.arange(seq.shape[1], device=device).expand_as(seq)
        inputs, layout = block_diffusion_inputs(noisy, seq, pos, packed=False)
    else:
        inputs, layout = noisy, None
    logp, _ = score_targets(model, inputs, masked, seq, layout=layout)
    return logp.sum(dim=1)


@torch.no_grad()
def elbo_loglikelihood(model, context: Sequence[int], continuation: Sequence[int], *, mc_num: int = 32,
                       batch_size: int = 32, generator: Optional[torch.Generator] = None) -> float:
    """ELBO estimate of ``log p(continuation | context)`` (nats) from ``mc_num`` masked samples."""
    P, L = len(context), len(continuation)
    if L == 0:
        return 0.0
    if model.adapter.shift_logits and P == 0:
        raise ValueError("a shifted-logit model (Dream) needs at least one context token (e.g. BOS) to score position 0")
    if model.adapter.is_encoder_decoder and P == 0:
        raise ValueError(f"{model.family} encodes the context before denoising: give at least one context token (e.g. BOS)")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    seq = torch.tensor(list(context) + list(continuation), dtype=torch.long)
    counts = stratified_counts(L, mc_num, gen)
    total = 0.0
    for start in range(0, mc_num, batch_size):
        chunk = counts[start:start + batch_size]
        masked = torch.zeros(len(chunk), P + L, dtype=torch.bool)
        for r, l in enumerate(chunk.tolist()):
            masked[r, P:] = exact_count_mask(L, l, gen)
        if model.adapter.is_encoder_decoder:
            rows = _score_canvas_rows(model, seq.expand(len(chunk), -1), masked, P, gen).double().cpu()
        else:
            rows = _score_rows(model, seq.expand(len(chunk), -1), masked).double().cpu()
        total += float((rows * (L / chunk.double())).sum())
    return total / mc_num


@torch.no_grad()
def greedy_matches(model, context: Sequence[int], continuation: Sequence[int]) -> bool:
    """Would greedy low-confidence decoding (one token per step) write exactly ``continuation``?

    Starts from the fully masked continuation and commits the most confident argmax each step (block models:
    within the earliest unfinished block); a committed token is final, so the first wrong commit decides.
    """
    P, L = len(context), len(continuation)
    if L == 0:
        return True
    if model.adapter.is_encoder_decoder:
        raise ValueError(f"greedy_matches replays masked decoding; {model.family} decodes canvases from uniform noise "
                         f"(use greedy_check=False)")
    device = model.device
    x = torch.tensor([list(context) + [model.adapter.mask_token_id] * L], dtype=torch.long, device=device)
    target = torch.tensor(list(continuation), dtype=torch.long, device=device)
    pos = torch.arange(P, P + L, device=device)
    open_ = torch.ones(L, dtype=torch.bool, device=device)
    block = model.adapter.block_size if model.adapter.is_block_causal else None
    for _ in range(L):
        logits = model.adapter.prediction_logits(model(x).logits)[0, P:].float()
        conf, pred = logits.softmax(-1).max(-1)
        allowed = open_.clone()
        if block:
            first = int((pos[open_] // block).min())
            allowed &= (pos // block) == first
        i = int(torch.where(allowed, conf, torch.full_like(conf, -1.0)).argmax())
        if int(pred[i]) != int(target[i]):
            return False
        x[0, P + i] = target[i]
        open_[i] = False
    return True
