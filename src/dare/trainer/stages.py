"""The per-batch stages of the loop that call algorithm hooks: corruption + old/reference scoring, and the update.

Kept separate from ``loop.py`` (which owns data, rollout, optimizer, checkpoints) so tests and other drivers can
run exactly the stage code the trainer runs.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Optional

import torch

from ..algorithms.base import Algorithm, StepContext
from ..algorithms.batch import concat_rows


@torch.no_grad()
def score_iteration(algo: Algorithm, ctx: StepContext, model, batch, iteration: int, micro_batch_size: int,
                    reference_views: bool = False) -> torch.Tensor:
    """Likelihood values of the batch's views (``ref_views`` with ``reference_views``) of ``iteration`` under
    ``model``, batched like the update will be."""
    def views(mb):
        return (mb.ref_views if reference_views else mb.views)[iteration]
    parts = [algo.log_likelihood(ctx, model, mb, views(mb)).value.float() for mb in batch.split(micro_batch_size)]
    return concat_rows(parts)


def score_iterations(algo: Algorithm, ctx: StepContext, model, batch, micro_batch_size: int,
                     reference_views: bool = False) -> dict:
    """``score_iteration`` for every inner iteration; an iteration whose views are the very same list as an earlier
    one's (``Algorithm.deterministic_views``) reuses that iteration's scores."""
    out: dict = {}
    views = batch.ref_views if reference_views else batch.views
    for it in range(algo.inner_iterations):
        same = next((j for j in range(it) if views[j] is views[it]), None)
        out[it] = out[same] if same is not None else score_iteration(algo, ctx, model, batch, it, micro_batch_size,
                                                                     reference_views)
    return out


def prepare(algo: Algorithm, ctx: StepContext, batch, policy, reference=None, micro_batch_size: int = 1_000_000) -> None:
    """Stage (3): the method's per-batch state (``prepare``), every inner iteration's corruption drawn once (one
    draw for all iterations when ``deterministic_views``), the method's own no-grad passes with the models it borrows
    (``score_frozen``), and the views scored with the pre-update policy and the reference policy where the algorithm
    needs them. Results land in the batch's ``state``, ``views``, ``frozen``, ``old_logp``, ``ref_logp`` (and
    ``ref_views`` when the reference has its own noise): one writer each."""
    n_it = algo.inner_iterations
    batch.state = algo.prepare(ctx, batch)
    if algo.deterministic_views:
        views = algo.corrupt(ctx, batch, 0)
        batch.views = {it: views for it in range(n_it)}
    else:
        batch.views = {it: algo.corrupt(ctx, batch, it) for it in range(n_it)}
    if algo.frozen_models:
        batch.frozen = algo.score_frozen(ctx, batch, lender(algo, ctx, policy, reference), micro_batch_size)
    if algo.needs_old_logp:
        batch.old_logp = score_iterations(algo, ctx, policy, batch, micro_batch_size)
    if algo.needs_reference:
        if reference is None:
            raise ValueError(f"algorithm {algo.name!r} needs a reference policy, but none is configured "
                             f"(set reference.mode to 'copy' or, with LoRA, 'lora_disabled')")
        ref_views = {it: algo.reference_views(ctx, batch, it) for it in range(n_it)}
        shared = all(ref_views[it] is batch.views[it] for it in range(n_it))
        if not shared:
            batch.ref_views = ref_views
        with reference.scoring() as ref_model:
            batch.ref_logp = score_iterations(algo, ctx, ref_model, batch, micro_batch_size, reference_views=not shared)


def lender(algo: Algorithm, ctx: StepContext, policy, reference) -> Callable:
    """``lend(name)``: the no-grad context lending a module ``algo.frozen_models`` names: the current policy, the
    reference policy or a companion model (``ctx.companions``), each as it is before this step's updates."""
    def lend(name: str):
        if name not in algo.frozen_models:
            raise ValueError(f"algorithm {algo.name!r} borrows {name!r}, which its frozen_models "
                             f"{algo.frozen_models} does not name")
        if name == "reference":
            if reference is None:
                raise ValueError(f"algorithm {algo.name!r} scores with the reference policy, but none is "
                                 f"configured (set reference.mode to 'copy' or, with LoRA, 'lora_disabled')")
            return reference.scoring()
        if name == "policy":
            return frozen(policy)
        if name in ctx.companions:
            return frozen(ctx.companions[name])
        raise ValueError(f"algorithm {algo.name!r}: frozen_models names 'policy', 'reference' or a companion "
                         f"({', '.join(sorted(ctx.companions)) or 'none built'}), got {name!r}")
    return lend


def update(algo: Algorithm, ctx: StepContext, model, batch, iteration: int, micro_batch_size: int,
           loss_scale: float = 1.0, grad_sync: Optional[Callable[[bool], None]] = None) -> dict[str, float]:
    """Stage (5), one inner iteration: run ``algo.backward`` on every micro-batch; return the summed metrics.

    ``grad_sync(flag)`` lets a data-parallel wrapper skip gradient reduction on all but the last micro-batch.
    """
    micro = batch.split(micro_batch_size)
    totals: dict[str, float] = defaultdict(float)
    for i, mb in enumerate(micro):
        if grad_sync is not None:
            grad_sync(i == len(micro) - 1)
        for k, v in algo.backward(ctx, model, mb, iteration, loss_scale).items():
            totals[k] += v
    return dict(totals)


@contextlib.contextmanager
def frozen(model):
    """No-grad scoring context that leaves the model's train/eval mode as it was."""
    with torch.no_grad():
        yield model
