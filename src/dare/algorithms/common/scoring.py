"""Scoring views with the policy: all views of one shape in one forward, and one backward per view.

``score_views`` batches the views of a differentiated loss (without gradients it scores one view per forward: a
trajectory replay's dozens of views in one batch would multiply the scoring's activations). Why: a parameter that
several forwards of one loss use gets its gradient from autograd only once all of them are differentiated, so each
forward's partial gradient waits in autograd's buffer meanwhile; under FSDP2 those are the *unsharded* gradients of
every layer at once (per GPU, ``dare plan``: 32.5 GiB for LLaDA2.0-mini Coupled-GRPO's three views, as much for
SPG's 16 draws), and FSDP2 reduce-scatters zeros for the earlier forwards. One batched forward also all-gathers each
layer once instead of once per view. The forward's values are the same bits; the weight gradients
sum over one GEMM instead of several (differences ~1e-7).

``backward_each_view`` is the other way round, for losses that are a sum over tokens each scored by exactly one view
(trajectory replays): one forward and backward per view, so only one view's graph is alive, with the same
gradient as the whole loss.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ...diffusion.logprob import DEFAULT_CHUNK, score_targets
from ...models.masks import TokenLayout
from ..batch import View


def _one_forward(views: list[View]) -> bool:
    """Whether ``views`` can run as one batch: same shapes, the same optional inputs, token layouts (or none)."""
    first = views[0]
    for v in views[1:]:
        if v.input_ids.shape != first.input_ids.shape or v.targets.shape != first.targets.shape:
            return False
        for name in ("attention_mask", "position_ids"):
            a, b = getattr(v, name), getattr(first, name)
            if (a is None) != (b is None) or (a is not None and a.shape != b.shape):
                return False
        if not ((v.layout is None and first.layout is None)
                or (isinstance(v.layout, TokenLayout) and isinstance(first.layout, TokenLayout))):
            return False
    return True


def score_view(model, view: View, chunk_size: Optional[int] = DEFAULT_CHUNK, with_entropy: bool = False):
    """``(logp [B, L] fp32, entropy [B, L] or None)`` of one view's targets (zero elsewhere)."""
    return score_targets(model, view.input_ids, view.targets, view.labels, attention_mask=view.attention_mask,
                         position_ids=view.position_ids, layout=view.layout, chunk_size=chunk_size,
                         with_entropy=with_entropy)


def score_views(model, views: list[View], chunk_size: Optional[int] = DEFAULT_CHUNK,
                with_entropy: bool = False) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``score_view`` of each view, all views in one forward when they have one shape and gradients flow (see the
    module docstring)."""
    if len(views) < 2 or not torch.is_grad_enabled() or not _one_forward(views):
        return [score_view(model, v, chunk_size, with_entropy) for v in views]

    def cat(name):
        parts = [getattr(v, name) for v in views]
        return None if parts[0] is None else torch.cat(parts)
    layout = None if views[0].layout is None else TokenLayout.cat_batch([v.layout for v in views])
    logp, ent = score_targets(model, cat("input_ids"), cat("targets"), cat("labels"), attention_mask=cat("attention_mask"),
                              position_ids=cat("position_ids"), layout=layout, chunk_size=chunk_size,
                              with_entropy=with_entropy)
    sizes = [v.size for v in views]
    ents = ent.split(sizes) if ent is not None else [None] * len(views)
    return list(zip(logp.split(sizes), ents))


def backward_each_view(views: list[View], loss_of: Callable[[int, View], tuple[torch.Tensor, dict]],
                       loss_scale: float = 1.0, totals: Optional[dict] = None, loss_key: str = "loss",
                       skip_constant: bool = False, runner: Optional[Callable] = None) -> dict[str, float]:
    """For each view r: ``loss, metrics = loss_of(r, view)`` (its forward and its share of the loss), then
    ``(loss * loss_scale).backward()`` (not for a loss without a graph when ``skip_constant``). Returns ``totals``
    (default ``{loss_key: 0.0}``) with the losses summed under ``loss_key`` and every metric under its name.
    ``runner(key, unit)`` (``ctx.services.run_unit``) runs each view's unit; None runs it here. The planner's
    (``dare.plan.replay``) stands in for a unit of the same shapes that ran before."""
    out = {loss_key: 0.0} if totals is None else totals
    for r, view in enumerate(views):
        def unit(r=r, view=view):
            loss, metrics = loss_of(r, view)
            if loss.requires_grad or not skip_constant:
                (loss * loss_scale).backward()
            return float(loss.detach()), metrics
        value, metrics = unit() if runner is None else runner((loss_of.__code__, view), unit)
        out[loss_key] += value
        for k, v in metrics.items():
            out[k] = out.get(k, 0.0) + v
    return out
