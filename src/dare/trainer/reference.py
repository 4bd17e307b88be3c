"""The reference policy: the LoRA-disabled base (no second copy) or a frozen copy, optionally synced to the policy.

``scoring()`` is a context manager yielding the module to score with (under ``no_grad``); the loop and the stages
never know which kind they hold.
"""
from __future__ import annotations

import contextlib
import copy

import torch

from ..models.lora import adapters_disabled


class LoraDisabledReference:
    kind = "lora_disabled"

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy

    @contextlib.contextmanager
    def scoring(self):
        with torch.no_grad(), adapters_disabled(self.policy):
            yield self.policy

    @property
    def module(self):
        return None  # nothing to checkpoint: the base weights are frozen and come from the model source

    def sync(self, policy, alpha: float) -> None:
        raise ValueError("reference sync needs reference.mode: copy (the LoRA-disabled base is the frozen base model)")


class CopyReference:
    kind = "copy"

    def __init__(self, model: torch.nn.Module):
        self.model = model
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.model.eval()

    @classmethod
    def from_policy(cls, policy: torch.nn.Module) -> "CopyReference":
        model = copy.deepcopy(policy)
        if hasattr(model, "fuse_projections"):  # deepcopy gives every view its own storage
            model.fuse_projections()
        return cls(model)

    @contextlib.contextmanager
    def scoring(self):
        with torch.no_grad():
            yield self.model

    @property
    def module(self):
        return self.model

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        """``theta_ref <- alpha * theta + (1 - alpha) * theta_ref`` (d1's sync_ref_model), shard by shard."""
        ref_params = dict(self.model.named_parameters())
        for name, p in policy.named_parameters():
            r = ref_params[name]
            rl = r.to_local() if hasattr(r, "to_local") else r
            pl = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
            rl.mul_(1.0 - alpha).add_(pl.to(rl.dtype), alpha=alpha)


def build_reference(mode: str, policy: torch.nn.Module, lora_enabled: bool):
    """``auto``: LoRA-disabled base with LoRA, else a frozen copy (made before any sharding, then sharded alike)."""
    if mode == "auto":
        mode = "lora_disabled" if lora_enabled else "copy"
    if mode == "lora_disabled":
        if not lora_enabled:
            raise ValueError("reference.mode: lora_disabled needs lora.enabled: true")
        return LoraDisabledReference(policy)
    return CopyReference.from_policy(policy)
