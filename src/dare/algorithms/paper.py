"""A method's own paper settings (optimizer, rollout, per-task hyperparameters), for fair comparisons.

Each RL algorithm class carries ``paper = PaperSettings(...)``: what its authors' published scripts use, with the
file each number comes from. The algorithm's config dataclass already holds the paper's *method* defaults (mu, clip,
KL); this adds what lives outside the method: learning rate, gradient clipping, rollout temperature, and the
per-task values of the authors' task scripts (e.g. d1's Sudoku script runs mu = 8 at temperature 0.3).

``dare compare`` uses it to give every method its own paper's *relative* settings on the embedded task: the
learning rate is the comparison's base rate times ``paper.lr / anchor.lr`` (the anchor is the default method), so a
method whose authors train 3x more gently than the default method's authors also does here; the gradient-norm
clip, temperature and task values are taken as published. What the comparison measured on its tiny models (a
documented factor on a method's relative lr) is the comparison's own data (``dare.comparison.departures``), passed in
as ``lr_factor``. Nothing here changes a loss.
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
    # Whether the authors published their training code: then the method has a loss-parity case (its loss against
    # theirs, docs/loss_parity.md; tests/algorithms/test_loss_parity.py requires one).
    published_code: bool
    # task -> {"lr", "grad_clip", "temperature", "algorithm": {...config fields}}: the authors' task scripts
    per_task: dict = field(default_factory=dict)
    # attention kind (bidirectional / block_causal) -> {"algorithm": {...}}: settings the authors use per model kind
    per_attention: dict = field(default_factory=dict)
    # sampler fields of the authors' decoding that are part of the method (e.g. CJ-GRPO's EOSER + ASS)
    sampler: dict = field(default_factory=dict)
    # The authors' LoRA adapters ({"r", "alpha"} on every attention and MLP projection; embeddings and LM head frozen),
    # or None for full fine-tuning. Part of the method's stabilisation: without it, on the tiny models, SPG and wd1
    # rewrite the answer format within 20 updates (docs/comparison.md).
    lora: Optional[dict] = None

    def for_task(self, task: Optional[str], attention: Optional[str] = None) -> dict:
        """``{"lr", "grad_clip", "temperature", "algorithm": {...}}`` for ``task`` and the model's attention kind
        (task values win over the general ones; attention values add algorithm fields)."""
        extra = dict(self.per_task.get(task or "", {}))
        algo = {**self.per_attention.get(attention or "", {}).get("algorithm", {}), **extra.pop("algorithm", {})}
        return {"lr": extra.pop("lr", self.lr), "grad_clip": extra.pop("grad_clip", self.grad_clip),
                "temperature": extra.pop("temperature", self.temperature), "algorithm": algo,
                **({"unknown": extra} if extra else {})}


@dataclass(frozen=True)
class GridAdjust:
    """A method's departures from the paper grid's unified settings (``scripts/make_paper_recipes.py``), with the
    reason: what its recipes need that the unified rollout and its own config defaults do not give."""
    why: str
    algorithm: dict = field(default_factory=dict)  # fixed algorithm keys
    per_task: dict = field(default_factory=dict)  # task -> algorithm keys
    per_kind: dict = field(default_factory=dict)  # attention kind -> algorithm keys
    single_block: bool = False  # masked models: one block of gen_length (the method needs every position predicted)
    sampler: dict = field(default_factory=dict)
    merge_blocks_on: tuple = ()  # attention kinds where algorithm.shrink = steps per block (one transition per block)
    rollout_micro_batch: int = 0  # single-block masked models: prompts per generate() call per rank (0: all at once)
    micro_batch_divisor: int = 1  # train.micro_batch_size = the task's / this (a method that batches its draws)


@dataclass(frozen=True)
class LrDeparture:
    """What ``dare compare`` measured for a method on the tiny shipped checkpoints: a factor on its paper-relative lr
    (it oscillated, collapsed or left the reference in one step at its paper's ratio there). An outcome of the
    comparison, not a property of the method: the comparison applies it (``dare.comparison.departures``) and the
    method's doc prints the note after its paper settings."""
    factor: float  # on the method's paper-relative lr
    note: str  # what was measured at the paper ratio and at the factor (the doc prints it)
    checkpoints: tuple[str, ...]  # the shipped SFT checkpoints (quickstart assets) the experiment ran on
    doc: str  # where the experiment is written up (repository path)


def own(cls, attribute: str):
    """The manifest entry ``attribute`` (``paper``, ``grid``, ``departure``) that algorithm class ``cls`` declares
    itself, or None: a subclass (EGSPO-SA of EGSPO) does not inherit its parent's grid adjustment or departure."""
    return vars(cls).get(attribute)


def paper_overrides(cls, anchor, base_lr: float, task: Optional[str], attention: Optional[str] = None,
                    lr_factor: float = 1.0) -> list[str]:
    """Dotted recipe overrides that give algorithm class ``cls`` its paper's settings relative to ``anchor`` (an
    algorithm class whose run uses ``base_lr``) on ``task`` with a model of ``attention`` kind; ``lr_factor`` scales
    the relative lr (a caller's documented departure, e.g. ``dare.comparison.departures.lr_factor``). Errors when
    either has no ``paper`` settings."""
    for c in (cls, anchor):
        if getattr(c, "paper", None) is None:
            raise ValueError(f"algorithm {c.name!r} declares no paper settings (class attribute `paper`)")
    mine, ref = cls.paper.for_task(task, attention), anchor.paper.for_task(task, attention)
    if "unknown" in mine:
        raise ValueError(f"{cls.name}.paper.per_task[{task!r}]: unknown key(s) {sorted(mine['unknown'])}")
    lr = base_lr * mine["lr"] / ref["lr"] * lr_factor
    out = [f"optim.lr={lr:.6g}", f"optim.grad_clip={mine['grad_clip'] if mine['grad_clip'] is not None else 'null'}",
           f"rollout.sampler.temperature={mine['temperature']}"]
    out += [f"algorithm.{k}={v}" for k, v in mine["algorithm"].items()]
    out += [f"rollout.sampler.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in cls.paper.sampler.items()]
    if cls.paper.sampler.get("schedule") == "ass":  # ASS fixes its own step count (floor(log2 block) per block)
        out += ["rollout.sampler.steps=null", "rollout.sampler.steps_per_block=null"]
    if cls.paper.lora:
        # the reference stays a frozen copy of the starting model (reference syncs need one; lora_disabled would too
        # at the start, but not after a sync)
        out += ["lora.enabled=true", f"lora.r={cls.paper.lora['r']}", f"lora.alpha={cls.paper.lora['alpha']}",
                "reference.mode=copy"]
    return out


def paper_markdown(cls) -> str:
    """The method doc's paragraph on its paper settings: docs/algorithms/<name>.md holds it between paper-settings
    markers, followed by the comparison's departure note if it has one (written by ``python scripts/generate.py``;
    its ``--check`` in the test suite keeps the two equal)."""
    p = cls.paper
    clip = "none" if p.grad_clip is None else f"{p.grad_clip:g}"
    text = (f"**Paper settings** (`{cls.__name__}.paper`, used by `dare compare`): lr {p.lr:g}, grad-norm clip {clip}, "
            f"rollout temperature {p.temperature:g}, "
            + (f"LoRA r {p.lora['r']}, alpha {p.lora['alpha']:g} on every projection." if p.lora else "full fine-tuning."))
    if p.sampler:
        text += " Decoding: " + ", ".join(f"`{k}` {v}" for k, v in p.sampler.items()) + "."
    for kind, values in sorted(p.per_attention.items()):
        text += f" On {kind} models: " + ", ".join(f"`{k}` {v:g}" for k, v in values.get("algorithm", {}).items()) + "."
    for task, values in sorted(p.per_task.items()):
        parts = [f"{k} {v:g}" for k, v in values.items() if k != "algorithm"]
        parts += [f"`{k}` {v:g}" for k, v in values.get("algorithm", {}).items()]
        text += f" {task.capitalize()} script: {', '.join(parts)}."
    text += f" Source: {p.source}."
    return text
