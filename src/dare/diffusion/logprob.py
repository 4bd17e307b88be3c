"""Per-token log-probabilities at target positions, with logits only where a loss needs them.

``score_targets`` runs the model once (hidden states only, no LM head), gathers the hidden rows that predict the
target positions (``model.adapter.prediction_rows``: Dream predicts position i from row i-1) and computes
``log softmax(lm_head(h))[label]`` in fp32 with ``linear_log_prob``: a chunked linear + log-softmax whose
forward and backward hold one ``[chunk, vocab]`` block of logits at a time, so memory does not scale with
vocabulary x sequence length (what the original DARE's dense per-sample logits did).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..models import LogitsRequest

DEFAULT_CHUNK = 1024


def _capped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(logits / softcap) * softcap if softcap else logits


class _LinearLogProb(torch.autograd.Function):
    """log p(label | h) = (z / T)[label] - logsumexp(z / T) with z = cap(h W^T), chunked over rows; fp32 softmax.

    ``cap`` is Gemma's final soft-capping ``c tanh(x / c)`` (``softcap`` c, 0 = none)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, temperature: float, want_entropy: bool, softcap: float = 0.0):
        ctx.weight_dtype = weight.dtype
        weight = weight.to(hidden.dtype)  # bf16 hidden states under autocast / mixed precision: matmul in their dtype
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if want_entropy else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits = _capped(F.linear(hidden[s:e], weight).float(), softcap)
            if temperature != 1.0:
                logits = logits / temperature
            lse_c = torch.logsumexp(logits, dim=-1)
            lse[s:e] = lse_c
            logp[s:e] = logits.gather(1, labels[s:e, None]).squeeze(1) - lse_c
            if entropy is not None:
                logprobs = logits - lse_c[:, None]  # -sum p log p, not lse - sum p z: no cancellation
                entropy[s:e] = -(logprobs.exp() * logprobs).sum(-1)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.temperature, ctx.softcap = chunk, temperature, softcap
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, labels, lse = ctx.saved_tensors
        chunk, temp, cap = ctx.chunk, ctx.temperature, ctx.softcap
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n = hidden.shape[0]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            capped = _capped(F.linear(hidden[s:e], weight).float(), cap)
            logits = capped / temp if temp != 1.0 else capped
            g = grad_logp[s:e].float()
            # d logp / d logits = onehot(label) - softmax; chain through 1/T and the cap (1 - tanh^2).
            grad_logits = torch.exp(logits - lse[s:e, None]).mul_(-g[:, None])
            grad_logits.scatter_add_(1, labels[s:e, None], g[:, None])
            if temp != 1.0:
                grad_logits.div_(temp)
            if cap:
                grad_logits.mul_(1.0 - (capped / cap) ** 2)
            if need_h:
                grad_h[s:e] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(grad_logits.t(), hidden[s:e].float())
        return grad_h, (grad_w.to(ctx.weight_dtype) if need_w else None), None, None, None, None, None


def linear_log_prob(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: Optional[int] = DEFAULT_CHUNK,
                    temperature: float = 1.0, with_entropy: bool = False, softcap: Optional[float] = None):
    """fp32 ``log softmax(cap(hidden @ weight.T) / temperature)[labels]`` for rows ``hidden [N, H]`` (``softcap``: the
    logits are ``c tanh(x / c)``, Gemma's final soft-capping; None = raw logits).

    Returns ``(logp [N], entropy [N] or None)``; the entropy is a detached diagnostic. ``chunk_size=None``
    processes all rows at once (the dense baseline the benchmarks compare against).
    """
    if hidden.shape[0] == 0:
        # Still connected to the hidden states and the head: under FSDP every rank's backward must reach every layer
        # (a rank whose micro-batch has no targets would otherwise skip its reduce-scatters and deadlock the others).
        empty = hidden.float().sum(-1) * 0.0 + weight.float().sum() * 0.0
        return empty, (empty.detach() if with_entropy else None)
    chunk = int(chunk_size or hidden.shape[0])
    return _LinearLogProb.apply(hidden, weight, labels.long(), chunk, float(temperature), bool(with_entropy),
                                float(softcap or 0.0))


def score_targets(model, input_ids: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor, *,
                  attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                  layout=None, chunk_size: Optional[int] = DEFAULT_CHUNK, temperature: float = 1.0,
                  with_entropy: bool = False):
    """Log-probs of ``labels`` at the ``targets`` positions of one forward pass.

    ``targets``/``labels`` are ``[B, L]`` with ``L <= input length`` (a ``[x_t ; x_0]`` input scores its first
    half). Returns ``(logp [B, L] fp32, entropy [B, L] or None)``, zero outside the targets.
    """
    from ..models import sequence_parallel
    sp = sequence_parallel.active()
    if sp is not None and getattr(model, "supports_sequence_parallel", False):
        return _score_sharded(sp, model, input_ids, targets, labels, attention_mask, position_ids, layout,
                              chunk_size, temperature, with_entropy)
    out = model(input_ids, attention_mask=attention_mask, position_ids=position_ids, layout=layout,
                request=LogitsRequest.hidden_states())
    hidden = out.hidden_states
    b, col = targets.nonzero(as_tuple=True)
    rows = model.adapter.prediction_rows(col)
    logp, ent = linear_log_prob(hidden[b, rows], model.lm_head.weight, labels[b, col], chunk_size, temperature, with_entropy,
                                softcap=model.adapter.logit_softcap)
    return _scattered(targets, b, col, logp), (_scattered(targets, b, col, ent) if with_entropy else None)


def _scattered(targets: torch.Tensor, b: torch.Tensor, col: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, L]`` zeros with ``values`` at the target positions ``(b, col)``."""
    return torch.zeros(targets.shape, dtype=torch.float32, device=values.device).index_put((b, col), values)


def _score_sharded(sp, model, input_ids, targets, labels, attention_mask, position_ids, layout, chunk_size,
                   temperature, with_entropy):
    """``score_targets`` over a sequence-parallel group: this rank's rows score the targets they predict, and a sum
    over the group gives every rank the whole ``[B, L]`` result (``dare.models.sequence_parallel``). Which rows a
    rank holds is the model's to say (``sequence_parallel_inputs``: a slice of the sequence for the native models,
    a slice of the encoder part and one of the canvas for DiffusionGemma)."""
    sharded = model.sequence_parallel_inputs(sp, input_ids, attention_mask, position_ids, layout)
    hidden = model(sharded.input_ids, attention_mask=sharded.attention_mask, position_ids=sharded.position_ids,
                   layout=sharded.layout, request=LogitsRequest.hidden_states(), sequence_parallel=sp).hidden_states
    local = sharded.local_rows(input_ids.shape[1])
    b, col = targets.nonzero(as_tuple=True)
    rows = model.adapter.prediction_rows(col)
    at = torch.where(rows >= 0, local[rows.clamp(min=0)], -1)  # this rank's hidden row of each target, or -1
    mine = at >= 0
    b, col, at = b[mine], col[mine], at[mine]
    logp, ent = linear_log_prob(hidden[b, at], model.lm_head.weight, labels[b, col], chunk_size, temperature,
                                with_entropy, softcap=model.adapter.logit_softcap)
    return sp.sum(_scattered(targets, b, col, logp)), (sp.sum(_scattered(targets, b, col, ent)) if with_entropy else None)
