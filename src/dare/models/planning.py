"""Where a ``dare plan`` simulation answers what model code cannot know without weights.

``dare.plan.simulate.Simulation`` registers itself here while it runs. Model code asks ``active()`` and, for fake
tensors only, takes the simulation's answers: balanced MoE routing (``dare.models.experts.route``) and CUDA's
attention kernel (``dare.models.modules.planned_attention``). The models never import the planner: it sits above
them (it drives the trainer, which drives the models).
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch


class PlanningSimulation(Protocol):
    """What model code may ask of the running simulation."""
    cuda_kernels: bool  # plan the memory of the kernels a GPU runs

    def assume(self, what: str) -> None: ...  # record a stated assumption of the plan

    def balanced_routing(self, num_tokens: int, top_k: int, num_experts: int, device): ...  # a ``Routing``


_active: list = [None]


def active() -> Optional[PlanningSimulation]:
    """The running simulation, or None (training, evaluation, tests)."""
    return _active[0]


def set_active(sim: Optional[PlanningSimulation]) -> None:
    if sim is not None and _active[0] is not None:
        raise RuntimeError("a planning simulation is already running")
    _active[0] = sim


def is_fake(t) -> bool:
    """A fake tensor of the simulation (shape, dtype and size, no values)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor) and isinstance(t, torch.Tensor)
