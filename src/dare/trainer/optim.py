"""AdamW and learning-rate schedules (linear warmup, then constant / linear / cosine / cosine with a floor)."""
from __future__ import annotations

import math

import torch


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters (is everything frozen?)")
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


class LRSchedule:
    """Multiplier of the base lr after ``step`` optimizer updates (a picklable callable for LambdaLR)."""

    def __init__(self, schedule: str, warmup: int, total: int, min_ratio: float = 0.0):
        if schedule not in ("constant", "cosine", "cosine_with_min_lr", "linear"):
            raise ValueError(f"unknown lr schedule {schedule!r}")
        self.schedule, self.warmup, self.total = schedule, int(warmup), max(int(total), 1)
        self.min_ratio = min_ratio if schedule == "cosine_with_min_lr" else 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.schedule == "linear":
            return 1.0 - progress
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * cos


def build_scheduler(optimizer, cfg, total_updates: int):
    fn = LRSchedule(cfg.schedule, cfg.warmup_steps, total_updates, cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def grad_norm_and_clip(params, max_norm) -> float:
    """Total gradient norm (before clipping), clipping to ``max_norm`` when set; works on FSDP DTensor grads."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm else float("inf"), foreach=None)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    return float(total)
