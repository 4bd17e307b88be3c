"""A method's own paper settings (optimizer, rollout, per-task hyperparameters), for fair comparisons.

Each RL algorithm class carries ``paper = PaperSettings(...)``: what its authors' published scripts use, with the
file each number comes from. The algorithm's config dataclass already holds the paper's *method* defaults (mu, clip,
KL); this adds what lives outside the method: learning rate, gradient clipping, rollout temperature, and the
per-task values of the authors' task scripts (e.g. d1's Sudoku script runs mu = 8 at temperature 0.3).

``dare compare`` uses it to give every method its own paper's *relative* settings on the embedded task: the
learning rate is the comparison's base rate times ``paper.lr / anchor.lr`` (the anchor is the default method), so a
method whose authors train 3x more gently than the default method's authors also does here; the gradient-norm
clip, temperature and task values are taken as published. Nothing here changes a loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class PaperSettings:
    lr: float  # the authors' learning rate (absolute; comparisons use ratios between methods)
    grad_clip: Optional[float]  # max gradient norm (None: none)
    temperature: float  # rollout sampling temperature
    source: str  # where the numbers come from (repository + file)
    # task -> {"algorithm": {...config fields}, "optim": {...}, "rollout": {...}}: the authors' task scripts
    per_task: dict = field(default_factory=dict)
    lora: bool = False  # the authors train LoRA adapters (reported; comparisons run full fine-tuning)

    def for_task(self, task: Optional[str]) -> dict:
        """``{"lr", "grad_clip", "temperature", "algorithm": {...}}`` for ``task`` (task values win)."""
        extra = dict(self.per_task.get(task or "", {}))
        return {"lr": extra.pop("lr", self.lr), "grad_clip": extra.pop("grad_clip", self.grad_clip),
                "temperature": extra.pop("temperature", self.temperature), "algorithm": extra.pop("algorithm", {}),
                **({"unknown": extra} if extra else {})}


def paper_overrides(cls, anchor, base_lr: float, task: Optional[str]) -> list[str]:
    """Dotted recipe overrides that give algorithm class ``cls`` its paper's settings relative to ``anchor`` (an
    algorithm class whose run uses ``base_lr``). Errors when either has no ``paper`` settings."""
    for c in (cls, anchor):
        if getattr(c, "paper", None) is None:
            raise ValueError(f"algorithm {c.name!r} declares no paper settings (class attribute `paper`)")
    mine, ref = cls.paper.for_task(task), anchor.paper.for_task(task)
    if "unknown" in mine:
        raise ValueError(f"{cls.name}.paper.per_task[{task!r}]: unknown key(s) {sorted(mine['unknown'])}")
    lr = base_lr * mine["lr"] / ref["lr"]
    out = [f"optim.lr={lr:.6g}", f"optim.grad_clip={mine['grad_clip'] if mine['grad_clip'] is not None else 'null'}",
           f"rollout.sampler.temperature={mine['temperature']}"]
    out += [f"algorithm.{k}={v}" for k, v in mine["algorithm"].items()]
    return out
