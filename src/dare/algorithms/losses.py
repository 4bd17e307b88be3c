"""The methods' loss math as pure functions of tensors (no batch, no model, no config object).

A method's ``loss`` hook gathers its tensors and settings and calls one of these; the loss-parity tests call them
directly with the inputs the authors' code saw. Shapes: B sequences, L token slots; every function returns
``(loss, metrics)`` with the loss already normalised by the step's global counts passed in (so each micro-batch
returns its additive share) and the metrics as Python floats normalised the same way.

* ``kl_penalty``, ``clip_ratio_loss``, ``clipped_surrogate``: the building blocks.
* ``token_policy_loss``: token-level clipped policy gradient with a KL penalty and an aggregation mode (GRPO and
  the methods built on it).
* ``weighted_policy_loss``: the same per-token terms with explicit surrogate and KL weights on a selection of
  tokens (the trajectory replays: one view's targets at a time).
* ``sequence_ratio_token_loss``: GSPO's sequence ratio (the mean token log-ratio) applied to every token, with a
  per-token KL and a token aggregation (IGPO's released configuration).
* ``sequence_ratio_loss``: a clipped ratio of length-normalised sequence ELBOs and a KL on the raw ELBO (ESPO, EBPO).
* ``clipped_value_loss``: PPO's clipped value loss (TraceRL's value model).
* ``dpo_loss``: the DPO / VRPO objective on ELBO margins.
* ``topk_divergence``: the pointwise generalised JSD / KL between a student and a teacher distribution over the
  teacher's top-k tokens, with pointwise clipping (d-OPSD's self-distillation).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .advantages import aggregate


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of KL(pi || ref) from samples of pi: k1 = l - r, k2 = (l - r)^2 / 2, k3 = e^(r-l) - (r-l) - 1."""
    delta = ref_logp - logp
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta ** 2
    if estimator == "k3":
        delta = delta.clamp(-20.0, 20.0)  # exp overflow guard; k3 is exact (0 at l = r) inside the clamp
        return torch.exp(delta) - delta - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")


def clip_ratio_loss(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: Optional[float] = None,
                    dual_clip: Optional[float] = None):
    """PPO loss ``-min(rho A, clip(rho, 1 - lo, 1 + hi) A)`` (+ dual clip) for a given ratio. Returns (loss, clipped).

    Takes the ratio itself so that surrogates that are not ``exp(logp - old)`` (BGPO's linear bound) share it."""
    hi = clip_low if clip_high is None else clip_high
    adv = advantages if advantages.dim() == ratio.dim() else advantages.view(-1, *([1] * (ratio.dim() - 1)))
    unclipped = ratio * adv
    clipped_term = ratio.clamp(1.0 - clip_low, 1.0 + hi) * adv
    loss = -torch.minimum(unclipped, clipped_term)
    clipped = clipped_term < unclipped
    if dual_clip is not None:
        cap = -dual_clip * adv
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(capped, cap.expand_as(loss), loss)
        clipped = clipped | capped
    return loss, clipped


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: Optional[float] = None, dual_clip: Optional[float] = None,
                      logratio_clamp: Optional[float] = None):
    """PPO token loss with ``rho = exp(logp - old_logp)`` (see ``clip_ratio_loss``). Returns (loss, ratio, clipped)."""
    logratio = logp - old_logp
    if logratio_clamp is not None:
        logratio = logratio.clamp(-logratio_clamp, logratio_clamp)
    ratio = torch.exp(logratio)
    loss, clipped = clip_ratio_loss(ratio, advantages, clip_low, clip_high, dual_clip)
    return loss, ratio, clipped


def token_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                      norms: dict, clip_low: float, clip_high: Optional[float] = None, dual_clip: Optional[float] = None,
                      logratio_clamp: Optional[float] = None, ref_logp: Optional[torch.Tensor] = None, beta: float = 0.0,
                      kl_estimator: str = "k3", aggregation: str = "token_mean",
                      entropy: Optional[torch.Tensor] = None, length: Optional[int] = None) -> tuple[torch.Tensor, dict]:
    """Token-level clipped policy gradient ``-min(rho A, clip(rho) A) + beta KL(pi || ref)`` over ``mask``.

    ``logp``, ``old_logp``, ``ref_logp``, ``mask``, ``entropy``: ``[B, L]``; ``advantages [B]`` (or ``[B, L]``);
    ``norms``: the step's global ``tokens`` and ``seqs`` (``aggregation`` divides by them); ``length``: the
    completion length some aggregations divide by (default L). The KL term is added when ``ref_logp`` is given. Metrics: clipped fraction, mean ratio, KL, entropy per masked token."""
    per_token, ratio, clipped = clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high, dual_clip,
                                                  logratio_clamp)
    tok = max(norms["tokens"], 1.0)
    metrics = {"clip_frac": float((clipped.float() * mask).sum()) / tok,
               "ratio_mean": float((ratio.detach() * mask).sum()) / tok}
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        per_token = per_token + beta * kl
        metrics["kl"] = float((kl.detach() * mask).sum()) / tok
    if entropy is not None:
        metrics["entropy"] = float((entropy * mask).sum()) / tok
    return aggregate(per_token, mask, aggregation, norms, logp.shape[1] if length is None else length), metrics


def sequence_ratio_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                              *, norms: dict, clip_low: float, clip_high: Optional[float] = None,
                              ratio_mask: Optional[torch.Tensor] = None, ref_logp: Optional[torch.Tensor] = None,
                              beta: float = 0.0, kl_estimator: str = "k3", aggregation: str = "token_mean",
                              entropy: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """GSPO's ratio on token terms: ``s_b = exp(mean_{ratio_mask}(logp) - mean_{ratio_mask}(old_logp))`` is every
    token's ratio in ``-min(s A, clip(s) A) + beta KL(pi || ref)_token``, aggregated over ``mask``.

    ``ratio_mask`` (default ``mask``): the positions the sequence ratio averages over (IGPO's reference averages
    over every completion position, also those the loss mask drops). Shapes ``[B, L]``, ``advantages [B]``."""
    rm = (mask if ratio_mask is None else ratio_mask).to(logp.dtype)
    n = rm.sum(-1).clamp_min(1.0)
    # the two means separately, as the reference (sum / L of each), so the values match it to rounding
    log_ratio = (logp * rm).sum(-1) / n - (old_logp * rm).sum(-1) / n
    ratio = torch.exp(log_ratio)[:, None].expand_as(logp)
    per_token, clipped = clip_ratio_loss(ratio, advantages, clip_low, clip_high)
    tok = max(norms["tokens"], 1.0)
    m = mask.to(logp.dtype)
    metrics = {"clip_frac": float((clipped.float() * m).sum()) / tok,
               "ratio_mean": float((ratio.detach() * m).sum()) / tok}
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        per_token = per_token + beta * kl
        metrics["kl"] = float((kl.detach() * m).sum()) / tok
    if entropy is not None:
        metrics["entropy"] = float((entropy * m).sum()) / tok
    return aggregate(per_token, mask, aggregation, norms, logp.shape[1]), metrics


def weighted_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, select: torch.Tensor,
                         w_pg: torch.Tensor, w_kl: torch.Tensor, *, target_count: float, clip_low: float,
                         clip_high: Optional[float] = None, dual_clip: Optional[float] = None,
                         logratio_clamp: Optional[float] = None, ref_logp: Optional[torch.Tensor] = None,
                         beta: float = 0.0, kl_estimator: str = "k3",
                         entropy: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """``sum_sel w_pg * surrogate + beta * w_kl * KL`` over the ``select [B, L]`` tokens (one replay view's targets).

    Outside the selection the log-probs are placeholders (0, or another view's), so they are neutralised before the
    ratio: ``exp(logp - old)`` cannot overflow into ``inf * 0``. ``target_count``: the step's global targets (the
    metrics' denominator); the weights carry the loss's own normalisation."""
    old_logp = old_logp.to(logp.device)
    w_pg, w_kl = w_pg * select, w_kl * select
    logp_s = torch.where(select, logp, old_logp.detach())
    per_tok, ratio, clipped = clipped_surrogate(logp_s, old_logp, advantages.to(logp.device), clip_low, clip_high,
                                                dual_clip, logratio_clamp)
    loss = (per_tok * w_pg).sum()
    n = max(target_count, 1.0)
    selected = select.float()
    metrics = {"clip_frac": float((clipped.float() * selected).sum()) / n,
               "ratio_mean": float((ratio.detach() * selected).sum()) / n}
    if ref_logp is not None:
        ref_s = torch.where(select, ref_logp.to(logp.device), logp_s.detach())
        kl = kl_penalty(logp_s, ref_s, kl_estimator)
        loss = loss + beta * (kl * w_kl).sum()
        metrics["kl"] = float((kl.detach() * selected).sum()) / n
    if entropy is not None:
        metrics["entropy"] = float((entropy * selected).sum()) / n
    return loss, metrics


def sequence_ratio_loss(elbo: torch.Tensor, old_elbo: torch.Tensor, advantages: torch.Tensor, length: torch.Tensor,
                        active: torch.Tensor, *, seqs: float, clip_low: float, clip_high: Optional[float] = None,
                        dual_clip: Optional[float] = None, logratio_clamp: Optional[float] = None,
                        ref_elbo: Optional[torch.Tensor] = None, beta: float = 0.0,
                        kl_estimator: str = "k2") -> tuple[torch.Tensor, dict]:
    """Sequence-level clipped ratio ``rho = exp((B - B_old) / L)`` of ELBOs ``[B]`` over completion lengths
    ``length [B]``, plus ``beta`` times a KL estimate on the raw ELBO divided by L; mean over the ``active [B]``
    sequences of the step (``seqs``, global)."""
    per_seq, ratio, clipped = clipped_surrogate(elbo / length, old_elbo / length, advantages, clip_low, clip_high,
                                                dual_clip, logratio_clamp)
    seqs = max(seqs, 1.0)
    metrics = {"ratio_mean": float((ratio.detach() * active).sum()) / seqs,
               "clip_frac": float((clipped.float() * active).sum()) / seqs,
               "elbo_per_token": float((elbo.detach() / length * active).sum()) / seqs}
    if ref_elbo is not None:
        kl = kl_penalty(elbo, ref_elbo, kl_estimator) / length
        per_seq = per_seq + beta * kl
        metrics["kl"] = float((kl.detach() * active).sum()) / seqs
    return (per_seq * active).sum() / seqs, metrics


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ``0.5 max((V - R)^2, (V_clip - R)^2)`` (PPO's clipped value loss); returns (loss, clipped-branch)."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def dpo_loss(margin: torch.Tensor, weight: torch.Tensor, *, pairs: float, beta: float) -> tuple[torch.Tensor, dict]:
    """``-log sigma(s)`` of the preference margins ``s [B] = beta ((B_w - B_w^ref) - (B_l - B_l^ref))`` weighted by
    ``weight [B]`` (real pairs), over the step's ``pairs``."""
    pairs = max(pairs, 1.0)
    loss = (-F.logsigmoid(margin) * weight).sum() / pairs
    metrics = {"pref_accuracy": float(((margin.detach() > 0).float() * weight).sum()) / pairs,
               "reward_margin": float((margin.detach() / beta * weight).sum()) / pairs}
    return loss, metrics


def topk_divergence(student_logq: torch.Tensor, teacher_logq: torch.Tensor, beta: float,
                    clip: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pointwise divergence terms ``[..., K]`` between two distributions given as log-probs over the same K tokens
    (renormalised over them), and where the clip acted (bool, same shape).

    ``beta = 1``: reverse KL(student || teacher), ``d_v = q_s (log q_s - log q_t)``; ``beta = 0``: forward
    KL(teacher || student), ``d_v = q_t (log q_t - log q_s)``; otherwise the generalised JSD with the mixture
    ``m = (1 - beta) q_s + beta q_t``: ``d_v = beta q_t (log q_t - log m) + (1 - beta) q_s (log q_s - log m)``.
    Summed over v each is the divergence; single terms can be negative. ``clip`` caps every term (d-OPSD's
    pointwise KL clipping: ``min(d_v, clip)``; a capped term passes no gradient), so a sum of clipped terms is at most
    the divergence."""
    s, t = student_logq, teacher_logq
    if beta == 1.0:
        d = s.exp() * (s - t)
    elif beta == 0.0:
        d = t.exp() * (t - s)
    elif 0.0 < beta < 1.0:
        b = torch.tensor(beta, dtype=s.dtype, device=s.device)
        m = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
        d = beta * (t.exp() * (t - m)) + (1.0 - beta) * (s.exp() * (s - m))
    else:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if clip is None:
        return d, torch.zeros_like(d, dtype=torch.bool)
    return d.clamp(max=clip), d > clip
