"""The model side of a training run, built one way for ``dare train`` and ``dare plan``.

``assemble`` takes the loaded policy and builds around it what the loop trains with: LoRA, gradient checkpointing,
the reference policy, the algorithm's companion models, FSDP2 sharding, the mixed-precision context, the optimizer
and the LR schedule. The trainer calls it on a real model; the planner (``dare.plan``) calls it on a model of
meta tensors and materialises them as fake tensors after sharding (``Placement``), so a plan always describes the
wrapping the trainer really does.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..models import sequence_parallel
from ..models.lora import apply_lora
from .companions import Companions
from .distributed import shard_model
from .optim import build_optimizer, build_scheduler
from .reference import CopyReference, build_reference


@dataclass
class Placement:
    """Where modules live. ``place`` runs on every module before sharding (the trainer: move it to the device);
    ``materialize`` after sharding, before the optimizer sees the parameters (the planner: fake tensors)."""
    place: Callable[[torch.nn.Module], torch.nn.Module]
    materialize: Callable[[torch.nn.Module, bool], None] = lambda module, sharded: None

    @classmethod
    def on_device(cls, device: torch.device) -> "Placement":
        return cls(place=lambda module: module.to(device))


@dataclass
class TrainingModels:
    model: torch.nn.Module
    reference: Optional[object]  # CopyReference / LoraDisabledReference / None
    companions: Companions
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    fsdp: bool
    autocast: Callable[[], contextlib.AbstractContextManager]


def assemble(recipe, env, algo, model: torch.nn.Module, placement: Optional[Placement] = None) -> TrainingModels:
    """Wrap the policy ``model`` as ``recipe`` trains it (errors for settings the model or method cannot use)."""
    placement = placement or Placement.on_device(env.device)
    algo.check_model(model.adapter)  # fail before any rollout when the method is undefined for this family
    sequence_parallel.check_model(model, env.sequence_parallel)
    if algo.uses_rollout:
        algo.record.check(recipe.rollout.sampler)  # the sampler can record what the method reads
        algo.check_rollout(recipe.rollout.sampler, model.adapter)
    if recipe.lora.enabled:
        lc = recipe.lora
        apply_lora(model, lc.r, lc.alpha, lc.dropout, lc.target_modules, lc.include_experts, seed=recipe.train.seed)
    if recipe.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    placement.place(model)
    reference = None
    if algo.needs_reference or "reference" in algo.frozen_models:  # copied before sharding, then sharded the same way
        reference = build_reference(recipe.reference.mode, model, recipe.lora.enabled)
    sync_every = algo.reference_sync[0]
    if sync_every and reference is not None and not isinstance(reference, CopyReference):
        raise ValueError(f"algorithm.ref_sync_every={sync_every} needs a frozen copy to update: set reference.mode: "
                         f"copy, or algorithm.ref_sync_every: 0 to keep the LoRA-disabled base as the reference")
    fsdp = env.distributed and recipe.distributed.fsdp
    if env.distributed and not recipe.distributed.fsdp:
        raise ValueError("distributed.fsdp: false with several processes is not supported (use FSDP2 or nproc: 1)")
    mp = recipe.train.mixed_precision
    # Models the algorithm trains alongside the policy (TraceRL's value model): copies of the unsharded policy.
    companions = Companions(algo, model, recipe, env, fsdp, recipe.train.steps * algo.inner_iterations, placement)
    if fsdp:
        shard_model(model, env, mp, recipe.distributed.sharding)
        if isinstance(reference, CopyReference):
            shard_model(reference.model, env, mp, recipe.distributed.sharding)
    placement.materialize(model, fsdp)
    if isinstance(reference, CopyReference):
        placement.materialize(reference.model, fsdp)
    # Single process: autocast does what FSDP's mixed-precision policy does under FSDP.
    autocast = (lambda: torch.autocast(env.device.type, dtype=torch.bfloat16)) if mp == "bf16" and not fsdp \
        else contextlib.nullcontext
    model.train()
    companions.build_optimizers()
    optimizer = build_optimizer(model.parameters(), recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.optim, recipe.train.steps * algo.inner_iterations)
    return TrainingModels(model, reference, companions, optimizer, scheduler, fsdp, autocast)
