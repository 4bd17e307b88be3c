"""Advantage estimators and loss aggregation modes, as registries of pure functions.

``ADVANTAGE_ESTIMATORS[name](rewards, groups, eps)`` -> advantages (a method's ``advantage:`` setting picks one);
``AGGREGATIONS[name]`` -> how per-token terms become a micro-batch's share of the step's loss, as a sum
(``aggregate``) and as per-token weights (``aggregation_weights``: for methods that back-propagate a micro-batch's
tokens in several forwards). Register another with ``register_advantage`` / ``register_aggregation``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch

# The names the built-in configs accept (typed config fields); the registries are the source of truth.
AdvantageMode = Literal["mean", "mean_std", "mean_std_unbiased", "loo", "none"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_sum"]

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
AGGREGATIONS: dict[str, "AggregationMode"] = {}


def group_mean_std(values: torch.Tensor, groups: torch.Tensor):
    """Per-sample group mean, population std and group size (values ``[B]`` or ``[B, S]``: per column)."""
    v = values.double()
    _, inv = torch.unique(groups.to(v.device), return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    shape = (n_groups,) + tuple(v.shape[1:])
    counts = torch.bincount(inv, minlength=n_groups).double()
    cshape = (-1,) + (1,) * (v.dim() - 1)
    mean = torch.zeros(shape, dtype=v.dtype, device=v.device).index_add_(0, inv, v) / counts.view(cshape)
    dev = (v - mean[inv]) ** 2
    var = torch.zeros(shape, dtype=v.dtype, device=v.device).index_add_(0, inv, dev) / counts.view(cshape)
    return mean[inv], var.sqrt()[inv], counts[inv].view(cshape).expand_as(v)


def register_advantage(name: str):
    """Decorator: ``fn(rewards [B] or [B, S], groups [B], eps) -> advantages`` (fp64 in, any float out)."""
    def add(fn):
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return add


@register_advantage("none")
def _raw(r, groups, eps):
    return r


@register_advantage("mean")
def _centred(r, groups, eps):
    """r - mean (d1, CJ-GRPO, wd1, SPG)."""
    mean, _, _ = group_mean_std(r, groups)
    return r - mean


@register_advantage("mean_std")
def _z_score(r, groups, eps):
    """(r - mean) / (std + eps) with the population std; 0 where the std is 0 and eps is 0 (TraceRL, DiRL; MDPO per
    step with eps 1e-4 on ``[B, S]`` rewards)."""
    mean, std, _ = group_mean_std(r, groups)
    denom = std + eps
    return torch.where(denom > 0, (r - mean) / denom.clamp_min(1e-300), torch.zeros_like(r))


@register_advantage("mean_std_unbiased")
def _z_score_unbiased(r, groups, eps):
    """(r - mean) / (std + eps) with the unbiased (n - 1) std, ``torch.std``'s default (d2-AnyOrder); 0 for groups of
    one and where the std is 0 and eps is 0."""
    mean, std, n = group_mean_std(r, groups)
    unbiased = torch.where(n > 1, std * torch.sqrt(n / (n - 1).clamp_min(1)), torch.zeros_like(std))
    denom = unbiased + eps
    return torch.where(denom > 0, (r - mean) / denom.clamp_min(1e-300), torch.zeros_like(r))


@register_advantage("loo")
def _leave_one_out(r, groups, eps):
    """``r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean)`` (Coupled-GRPO)."""
    mean, _, n = group_mean_std(r, groups)
    return torch.where(n > 1, (r - mean) * n / (n - 1).clamp_min(1), torch.zeros_like(r))


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, mode: str = "mean", eps: float = 0.0) -> torch.Tensor:
    """Group-relative advantages of ``rewards`` by the registered estimator ``mode`` (fp32 out)."""
    fn = ADVANTAGE_ESTIMATORS.get(mode)
    if fn is None:
        raise ValueError(f"unknown advantage mode {mode!r}; use one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    r = rewards.double()
    return r.float() if mode == "none" else fn(r, groups, eps).float()


def group_zscore_unbiased(values: torch.Tensor, groups: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-column ``(v - mean) / (std + eps)`` within each group, unbiased std (0 for groups of one): the z-score
    of MDPO's per-step rewards and of JustGRPO (``torch.std`` in both references)."""
    mean, std, n = group_mean_std(values, groups)
    unbiased = torch.where(n > 1, std * torch.sqrt(n / (n - 1).clamp_min(1)), torch.zeros_like(std))
    return ((values.double() - mean) / (unbiased + eps)).float()


def zero_variance_groups(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Bool ``[B]``: True where the sample's group has identical rewards (no learning signal; DAPO filter)."""
    r = rewards if rewards.dim() == 1 else rewards.reshape(rewards.shape[0], -1).sum(-1)
    _, std, _ = group_mean_std(r, groups)
    return std == 0


# --- aggregation --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AggregationMode:
    """``weights(m, norms, length, seq_counts) -> [B, L]`` with ``sum(x * weights)`` the micro-batch's share of the
    step's loss for per-token terms ``x`` under mask ``m``; ``aggregate`` computes that sum in the form the
    references use (the same value, its own rounding)."""
    weights: Callable
    aggregate: Callable


def register_aggregation(name: str, weights: Callable, aggregate_fn: Callable) -> None:
    AGGREGATIONS[name] = AggregationMode(weights, aggregate_fn)


def _seq_counts(m, seq_counts):
    return m.sum(-1) if seq_counts is None else seq_counts.float()


register_aggregation("token_mean", lambda m, norms, length, sc: m / max(norms["tokens"], 1.0),
                     lambda x, m, norms, length: (x * m).sum() / max(norms["tokens"], 1.0))
register_aggregation("token_sum", lambda m, norms, length, sc: m, lambda x, m, norms, length: (x * m).sum())
register_aggregation("seq_mean_token_mean",
                     lambda m, norms, length, sc: m / (_seq_counts(m, sc).clamp_min(1.0)[:, None] * max(norms["seqs"], 1.0)),
                     lambda x, m, norms, length: ((x * m).sum(-1) / m.sum(-1).clamp_min(1.0)).sum() / max(norms["seqs"], 1.0))
register_aggregation("seq_mean_token_sum", lambda m, norms, length, sc: m / max(norms["seqs"], 1.0),
                     lambda x, m, norms, length: (x * m).sum(-1).sum() / max(norms["seqs"], 1.0))
register_aggregation("seq_mean_token_sum_norm", lambda m, norms, length, sc: m / (max(norms["seqs"], 1.0) * length),
                     lambda x, m, norms, length: (x * m).sum(-1).sum() / (max(norms["seqs"], 1.0) * length))


def _mode(name: str) -> AggregationMode:
    if name not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {name!r}")
    return AGGREGATIONS[name]


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norms: dict, length: int) -> torch.Tensor:
    """This micro-batch's share of the global loss (``norms``: global ``tokens`` and ``seqs``)."""
    return _mode(mode).aggregate(per_token, mask.float(), norms, length)


def aggregation_weights(mask: torch.Tensor, mode: str, norms: dict, length: int,
                        seq_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token weights ``w [B, L]`` with ``aggregate(x, mask, mode, norms, length) == (x * w).sum()``.

    For methods that score a micro-batch's tokens in several forwards and back-propagate each one on its own (the
    loss is linear in the per-token terms once the global counts are fixed). ``seq_counts [B]``: the per-sequence
    token counts of ``seq_mean_token_mean`` when ``mask`` is only part of each sequence's tokens.
    """
    return _mode(mode).weights(mask.float(), norms, length, seq_counts)
