"""Models an algorithm trains alongside the policy (``Algorithm.companions``, e.g. TraceRL's value model): built
from the policy, sharded like it, one AdamW + LR schedule each (the recipe's settings with the companion's own
learning rate), stepped right after every policy update, checkpointed with the policy."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .distributed import set_grad_sync, shard_model
from .optim import build_optimizer, build_scheduler, grad_norm_and_clip


@dataclass
class CompanionState:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


class Companions:
    """The algorithm's companion models of one run (an empty mapping for most methods)."""

    def __init__(self, algo, policy, recipe, env, fsdp: bool, total_updates: int, placement):
        """``placement`` (``dare.trainer.assemble.Placement``): where the modules live. The optimizers are built by
        ``build_optimizers``, once the parameters are materialised."""
        self.items: dict[str, CompanionState] = {}
        self._pending = []
        for spec in algo.companions():
            module = placement.place(spec.build(policy))
            if fsdp:
                shard_model(module, env, recipe.train.mixed_precision, recipe.distributed.sharding)
            placement.materialize(module, fsdp)
            module.train()
            self._pending.append((spec, module))
        self._optim, self._total = recipe.optim, total_updates

    def build_optimizers(self) -> None:
        for spec, module in self._pending:
            optimizer = build_optimizer(module.parameters(), dataclasses.replace(self._optim, lr=spec.lr))
            self.items[spec.name] = CompanionState(module, optimizer, build_scheduler(optimizer, self._optim, self._total))
        self._pending = []

    def __bool__(self) -> bool:
        return bool(self.items)

    def modules(self) -> dict[str, torch.nn.Module]:
        return {name: c.module for name, c in self.items.items()}

    def set_grad_sync(self, enabled: bool) -> None:
        for c in self.items.values():
            set_grad_sync(c.module, enabled)

    def clip(self, max_norm) -> dict[str, float]:
        """Gradient norm of every companion (before clipping), clipped like the policy's."""
        return {name: grad_norm_and_clip(c.module.parameters(), max_norm) for name, c in self.items.items()}

    def step(self) -> None:
        for c in self.items.values():
            c.optimizer.step()
            c.scheduler.step()
            c.optimizer.zero_grad(set_to_none=True)

    def zero_grad(self) -> None:
        for c in self.items.values():
            c.optimizer.zero_grad(set_to_none=True)

    def params_finite(self) -> bool:
        for c in self.items.values():
            for p in c.module.parameters():
                t = p.to_local() if hasattr(p, "to_local") else p
                if not bool(torch.isfinite(t).all()):
                    return False
        return True

    # --- checkpoints --------------------------------------------------------------------------------------
    def checkpoint_items(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        return {name: (c.module, c.optimizer) for name, c in self.items.items()}

    def scheduler_states(self) -> dict[str, dict]:
        return {name: c.scheduler.state_dict() for name, c in self.items.items()}

    def load_scheduler_states(self, states: dict) -> None:
        for name, c in self.items.items():
            if name not in states:
                raise ValueError(f"the checkpoint has no state of companion model {name!r}")
            c.scheduler.load_state_dict(states[name])
