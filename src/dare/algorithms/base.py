"""The algorithm hook interface and registry.

The training loop (``dare.trainer.loop``) is one workflow for every method::

    (1) rollout  (2) reward  (3) corruption + old-policy / reference log-probs  (4) advantage  (5) update

SFT and DPO/VRPO take the same path without (1)-(2) (``uses_rollout = False``). The loop never looks at an
algorithm's name: it calls the hooks below, each with a default, so a method is one file that overrides a few:

* ``corrupt(ctx, batch, iteration) -> list[View]``  -- the noise/mask sampler (forward corruption). It sees the
  whole batch, including the rollout's ``step_map`` / ``trajectory`` when present, and draws from
  ``ctx.generator(iteration, sample_uid, mc_index)`` so that old, reference and current policies score identical
  inputs and the ``mu`` inner iterations reuse the same noise. The loop calls it once per inner iteration and
  stores the views in ``batch["views"][iteration]``. ``reference_views`` (default: the same views) lets a method
  give the reference policy its own noise.
* ``log_likelihood(ctx, model, batch, views) -> LogLik`` -- the likelihood estimator: combines per-target
  log-probs of every view (``View.weight`` carries 1/t, complementary-mask weights, ...) into per-slot
  (token) or per-sequence values. ``mc_samples`` says how many forwards it uses per sample.
* ``advantages(ctx, batch) -> Tensor | None`` -- the advantage estimator (RL only).
* ``loss(ctx, batch, current, iteration) -> (loss, metrics)`` -- the objective of one micro-batch. Losses and
  metrics are *additive*: each micro-batch returns its share of the global value, normalised with the global
  counts in ``ctx.norms`` (from ``normalizers``, summed over micro-batches and ranks by the loop), so results
  do not depend on micro-batching or the number of processes.
* ``check_rollout(sampler, adapter)`` / ``collect(stage, ctx, prompts, model)`` -- RL only: a start-up check of the
  recipe's sampler (JustGRPO needs block length 1), and stages (1)-(2) for a method whose rollout is not G
  independent completions per prompt (d-TreeRPO's trees; default: the stage's group rollout).
* ``backward(ctx, model, batch, iteration, loss_scale) -> metrics`` -- runs the update's autograd for one
  micro-batch. The default builds one graph (``log_likelihood`` -> ``loss`` -> ``backward``); a method that
  needs more (VRPO's two-pass gradient, BGPO's per-MC-sample backward) overrides it, and the loop does not care.
* ``companions() -> list[Companion]`` and ``score_companions(ctx, batch, micro_batch_size)`` -- models trained
  alongside the policy with their own optimizer (TraceRL's value model). The trainer builds, shards, steps and
  checkpoints them; hooks reach them as ``ctx.companions[name]``; ``score_companions`` runs in stage (3), after the
  corruption and before any update (e.g. the value model's old values), and ``backward`` adds their losses.
* ``curates_prompts`` / ``select_prompts(ctx, model, prompts, uids) -> list[int]`` -- data curation (MDPO's ICFW): the
  RL trainer asks the method which training prompts to use before the first step and again after every pass over
  the chosen pool (each rank gets a share of the prompts; the model is gathered for decoding).

Batches are ``Batch`` objects: per-sample tensors with the sample dimension first, sliced consistently into
micro-batches by ``Batch.select``. Algorithm configs are dataclasses registered with their algorithm; the recipe's
``algorithm:`` section picks the dataclass from ``algorithm.name`` (so method-specific keys are validated).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch

from ..diffusion.corruption import apply_mask
from ..diffusion.logprob import DEFAULT_CHUNK, score_targets
from ..diffusion.noise import STREAM_CORRUPT, keyed_generator
from ..diffusion.uniform import uniform_replace
from ..models.masks import TokenLayout

# ----------------------------------------------------------------------------------------------------------
# Data containers
# ----------------------------------------------------------------------------------------------------------


def _select(value: Any, idx: torch.Tensor, size: int, key: str):
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != size:
            raise ValueError(f"batch field {key!r} has shape {tuple(value.shape)}; per-sample fields need {size} rows "
                             f"(put batch-level values in Batch.meta)")
        return value[idx.to(value.device)]
    if hasattr(value, "select") and not isinstance(value, (list, dict)):
        return value.select(idx)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # TokenLayout, rollout Trajectory, ...
        return dataclasses.replace(value, **{f.name: _select_or_keep(getattr(value, f.name), idx, size)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, dict):
        return {k: _select(v, idx, size, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        if value and all(isinstance(v, View) for v in value):
            return [v.select(idx) for v in value]
        if len(value) != size:
            raise ValueError(f"batch field {key!r} is a list of {len(value)} items, expected one per sample ({size})")
        return [value[i] for i in idx.tolist()]
    if value is None:
        return None
    raise TypeError(f"batch field {key!r}: cannot slice a {type(value).__name__} per sample")


def _select_or_keep(value: Any, idx: torch.Tensor, size: int):
    """Dataclass fields: per-sample tensors are sliced, anything else (sizes, names) is kept."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size:
        return value[idx.to(value.device)]
    return value


def _to(value: Any, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, View):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _to(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], View):
        return [v.to(device) for v in value]
    return value


@dataclass
class View:
    """One corrupted model input (one forward pass) and the positions whose log-probability it scores.

    ``targets``/``labels``/``weight`` are ``[B, L]`` over the scored part of the input (``L`` can be shorter than
    ``input_ids``: a block-diffusion ``[x_t ; x_0]`` input scores its first half). ``score_index [B, K]`` maps the
    ``[B, L]`` log-probs to the estimator's K slots (e.g. the completion positions of an RL sample); None keeps
    the ``[B, L]`` grid. ``info`` holds per-sample extras such as the timestep ``t``.
    """
    input_ids: torch.Tensor
    targets: torch.Tensor
    labels: torch.Tensor
    weight: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    layout: Any = None
    score_index: Optional[torch.Tensor] = None
    info: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor) -> "View":
        n = self.size
        kw = {f.name: _select(getattr(self, f.name), idx, n, f"view.{f.name}") for f in dataclasses.fields(self)}
        return View(**kw)

    def to(self, device) -> "View":
        return View(**{f.name: _to(getattr(self, f.name), device) for f in dataclasses.fields(self)})


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


def score_views(model, views: list[View], chunk_size: Optional[int] = DEFAULT_CHUNK,
                with_entropy: bool = False) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``(logp, entropy)`` [B, L] of each view's targets (``score_targets``), all views in one forward when they
    have one shape and gradients flow (without gradients, one forward per view: a replay's dozens of views batched
    would multiply the scoring's activations). Why one forward: a parameter that several forwards of one loss use gets its gradient from
    autograd only once all of them are differentiated, so each forward's partial gradient waits in autograd's
    buffer meanwhile; under FSDP2 those are the *unsharded* gradients of every layer at once (LLaDA2.0-mini
    Coupled-GRPO's three views held 32.5 GiB of them per GPU, ``dare plan``), and FSDP2 reduce-scatters zeros for the
    earlier forwards. One batched forward also all-gathers each layer once instead of once per view. The forward's
    values are the same bits; the weight gradients sum over one GEMM instead of several (differences ~1e-7)."""
    if len(views) < 2 or not torch.is_grad_enabled() or not _one_forward(views):
        return [score_targets(model, v.input_ids, v.targets, v.labels, attention_mask=v.attention_mask,
                              position_ids=v.position_ids, layout=v.layout, chunk_size=chunk_size,
                              with_entropy=with_entropy) for v in views]

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


class Batch:
    """Per-sample fields of one step (tensors ``[B, ...]``, lists of B items, per-iteration dicts of those).

    ``uid`` (long ``[B]``) is required: the global sample id used to key noise. ``meta`` holds batch-level values
    that are not sliced.
    """

    def __init__(self, uid: torch.Tensor, meta: Optional[dict] = None, **fields):
        self.fields: dict[str, Any] = {"uid": uid.long(), **fields}
        self.meta: dict[str, Any] = dict(meta or {})

    @property
    def size(self) -> int:
        return int(self.fields["uid"].shape[0])

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: str):
        try:
            return self.fields[key]
        except KeyError:
            raise KeyError(f"batch has no field {key!r} (fields: {', '.join(sorted(self.fields))})") from None

    def __setitem__(self, key: str, value) -> None:
        self.fields[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def select(self, idx) -> "Batch":
        idx = torch.as_tensor(idx, dtype=torch.long)
        n = self.size
        out = Batch.__new__(Batch)
        out.fields = {k: _select(v, idx, n, k) for k, v in self.fields.items()}
        out.meta = dict(self.meta)
        return out

    def split(self, micro_batch_size: int) -> list["Batch"]:
        n = self.size
        return [self.select(torch.arange(s, min(n, s + micro_batch_size))) for s in range(0, n, max(1, micro_batch_size))]

    def to(self, device) -> "Batch":
        out = Batch.__new__(Batch)
        out.fields = {k: _to(v, device) for k, v in self.fields.items()}
        out.meta = dict(self.meta)
        return out


def concat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-micro-batch results (right-padding with zeros when widths differ)."""
    width = max(p.shape[1] for p in parts) if parts[0].dim() > 1 else None
    if width is not None:
        parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
    return torch.cat(parts, dim=0)


@dataclass
class LogLik:
    """A likelihood estimate: ``value [B, K]`` (K token slots, or K = 1 for a sequence-level estimate), fp32."""
    value: torch.Tensor
    entropy: Optional[torch.Tensor] = None


@dataclass
class StepContext:
    """What hooks may know about the current step. ``norms`` are global (all ranks, all micro-batches)."""
    step: int
    seed: int
    adapter: Any
    norms: dict = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    chunk_size: Optional[int] = DEFAULT_CHUNK
    want_entropy: bool = False
    services: dict = field(default_factory=dict)  # tokenizer, reward scorer, ... for hooks that need them
    companions: dict = field(default_factory=dict)  # name -> model trained alongside the policy (``Companion``)

    def generator(self, *key) -> torch.Generator:
        """The corruption generator for ``key`` = (iteration, sample_uid, mc_index, ...) at this step."""
        return keyed_generator(self.seed, STREAM_CORRUPT, self.step, *key)

    def corrupt(self, ids: torch.Tensor, corrupted: torch.Tensor, uids, *key, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``ids`` with the ``corrupted`` positions replaced the way the model's family corrupts: by the mask token
        (masked diffusion) or by uniform random tokens (DiffusionGemma), drawn for sample ``uid`` from
        ``generator(*key, uid, "uniform")`` over its ``valid`` positions. The same key gives the same tokens, so
        old, reference and current policies score identical inputs (views are built once per iteration anyway)."""
        if self.adapter.noise != "uniform":
            return apply_mask(ids, corrupted, self.adapter.mask_token_id)
        gens = [self.generator(*key, int(u), "uniform") for u in (uids.tolist() if torch.is_tensor(uids) else uids)]
        return uniform_replace(ids, corrupted, self.adapter.vocab_size, gens, valid)


# ----------------------------------------------------------------------------------------------------------
# Algorithm base class and registry
# ----------------------------------------------------------------------------------------------------------

ALGORITHMS: dict[str, type["Algorithm"]] = {}


@dataclass
class Companion:
    """A model an algorithm trains alongside the policy (TraceRL's value model), with its own AdamW learning rate
    (the other optimizer settings and the LR schedule are the recipe's). ``build(policy)`` makes it from the
    policy as configured (LoRA, gradient checkpointing), before FSDP sharding; the trainer shards it the same way."""
    name: str
    build: Callable[[Any], torch.nn.Module]
    lr: float


@dataclass
class AlgorithmConfig:
    """Base of every algorithm section; ``name`` selects the dataclass (see ``resolve_config_type``)."""
    name: str = "sft"

    def group_need(self) -> tuple[int, str]:
        """(fewest completions per prompt the method can learn from, why). The recipe checks
        ``rollout.group_size`` against it, so a group-relative advantage never trains silently on zeros."""
        return 1, ""

    @classmethod
    def resolve_config_type(cls, data: dict) -> type:
        from . import load_builtin_algorithms
        load_builtin_algorithms()
        from ..config.core import ConfigError
        name = data.get("name")
        if name is None:
            raise ConfigError(f"algorithm.name is required; one of: {', '.join(sorted(ALGORITHMS))}")
        try:
            return get_algorithm(str(name)).config_class
        except ValueError as e:
            raise ConfigError(f"algorithm.name: {e}") from e


def register_algorithm(cls: type["Algorithm"]) -> type["Algorithm"]:
    """Class decorator: make ``cls`` available as ``algorithm.name: <cls.name>`` in recipes."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in ALGORITHMS and ALGORITHMS[cls.name] is not cls:
        raise ValueError(f"algorithm {cls.name!r} is registered twice ({ALGORITHMS[cls.name].__name__}, {cls.__name__})")
    ALGORITHMS[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type["Algorithm"]:
    from . import load_builtin_algorithms
    load_builtin_algorithms()
    if name not in ALGORITHMS:
        import difflib
        close = difflib.get_close_matches(name, list(ALGORITHMS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown algorithm {name!r}.{hint} Registered: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]


def build_algorithm(config: AlgorithmConfig) -> "Algorithm":
    cls = get_algorithm(config.name)
    if not isinstance(config, cls.config_class):
        raise TypeError(f"algorithm {config.name!r} needs a {cls.config_class.__name__}, got {type(config).__name__}")
    return cls(config)


class Algorithm:
    """Base class: override the hooks your method changes (see module docstring)."""
    name: ClassVar[str] = ""
    config_class: ClassVar[type] = AlgorithmConfig
    # Which data the loop feeds: "sft" (prompt/response), "preference" (prompt/chosen/rejected), "prompts" (RL).
    data_kind: ClassVar[str] = "sft"
    # RL methods: the loop generates completions and scores them before the hooks run.
    uses_rollout: ClassVar[bool] = False
    # Attention kinds the method's math is defined for ("bidirectional": LLaDA, LLaDA-MoE, Dream; "block_causal":
    # SDAR, SDAR-MoE, LLaDA2; "encoder_decoder": DiffusionGemma, uniform noise). The README's support matrix is
    # generated from it.
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal")
    # Why the method is undefined for a kind it does not support (shown by ``dare algorithms --matrix`` and errors).
    undefined: ClassVar[dict[str, str]] = {}
    # RL methods: the authors' optimizer / rollout / per-task settings (``dare.algorithms.paper``), used by
    # ``dare compare`` to give each method its own paper's relative settings. None for methods without rollouts.
    paper: ClassVar[Optional["PaperSettings"]] = None

    def __init__(self, config: AlgorithmConfig):
        self.config = config

    def check_model(self, adapter) -> None:
        """A clear error when the model's attention kind is not in ``supports`` (the loop calls it at start-up)."""
        if adapter.attention not in self.supports:
            from .matrix import families_of
            why = self.undefined.get(adapter.attention)
            raise ValueError(f"algorithm {self.name!r} supports {self.supports} attention; this model is "
                             f"{adapter.attention!r} (supported families: {', '.join(families_of(self.supports))})"
                             + (f". Undefined for it: {why}" if why else ""))

    def check_rollout(self, sampler, adapter) -> None:
        """A clear error when the recipe's ``rollout.sampler`` cannot produce what the method trains on (the loop calls
        it at start-up, after ``check_model``; RL methods only). Default: any sampler."""

    def collect(self, stage, ctx: "StepContext", prompts: "Batch", model) -> tuple["Batch", dict]:
        """Stages (1) rollout and (2) reward: the RL batch and its metrics. Default: ``group_size`` independent
        completions per prompt (``dare.trainer.rl.RolloutStage.collect``); a method with another rollout shape
        (d-TreeRPO's trees) builds its batch here with the stage's sampler, seeds and reward scorer."""
        return stage.collect(ctx, prompts, model)

    # --- what the loop must prepare -------------------------------------------------------------------
    @property
    def inner_iterations(self) -> int:
        """Optimizer updates per batch (``mu``); each has its own corruption (views)."""
        return 1

    @property
    def needs_old_logp(self) -> bool:
        """Score the views with the pre-update policy before any update (PPO ratio with mu > 1)."""
        return False

    @property
    def needs_reference(self) -> bool:
        """Score the views with the reference policy (KL penalty, DPO)."""
        return False

    @property
    def reference_sync(self) -> tuple[int, float]:
        """(every N steps, alpha): mix the policy into a frozen-copy reference, ``ref <- a * policy + (1 - a) * ref``."""
        return 0, 1.0

    @property
    def mc_samples(self) -> int:
        """Forward passes the likelihood estimator uses per sample (documentation and cost accounting)."""
        return 1

    def normalizers(self, batch: Batch) -> dict[str, float]:
        """Local counts the loss divides by; the loop sums them over ranks into ``ctx.norms``."""
        return {"samples": float(batch.size)}

    # --- hooks ----------------------------------------------------------------------------------------
    def corrupt(self, ctx: StepContext, batch: Batch, iteration: int) -> list[View]:
        raise NotImplementedError(f"{type(self).__name__} must implement corrupt()")

    def reference_views(self, ctx: StepContext, batch: Batch, iteration: int) -> list[View]:
        """The views the reference policy scores. Default: the policy's own (shared, antithetic noise)."""
        return batch["views"][iteration]

    def log_likelihood(self, ctx: StepContext, model, batch: Batch, views: list[View], *, with_entropy: bool = False) -> LogLik:
        """Default estimator: ``sum_v weight_v * logp_v`` over the views, mapped to slots by ``score_index``."""
        total = ent_total = None
        for v, (logp, ent) in zip(views, score_views(model, views, ctx.chunk_size, with_entropy)):
            w = v.weight if v.weight is not None else v.targets.float()
            contrib = logp * w
            if v.score_index is not None:
                contrib = contrib.gather(1, v.score_index)
                ent = ent.gather(1, v.score_index) if ent is not None else None
            total = contrib if total is None else total + contrib
            if ent is not None:
                ent_total = ent / len(views) if ent_total is None else ent_total + ent / len(views)
        return LogLik(total, ent_total)

    def advantages(self, ctx: StepContext, batch: Batch) -> Optional[torch.Tensor]:
        return None

    def companions(self) -> list[Companion]:
        """Models trained alongside the policy (see ``Companion``); none by default."""
        return []

    def score_companions(self, ctx: StepContext, batch: Batch, micro_batch_size: int) -> None:
        """Stage (3) for the companions: score the batch's views before any update (no-op by default)."""

    @property
    def curates_prompts(self) -> bool:
        """Whether the RL trainer asks ``select_prompts`` which training prompts to use (MDPO's ICFW)."""
        return False

    def select_prompts(self, ctx: StepContext, model, prompts: list, uids: list[int]) -> list[int]:
        """Positions in ``prompts`` (objects with ``input_ids`` and ``example``; ``uids`` their global indices) to train
        on until the next curation. Runs with the model gathered for decoding (``dare.rollout.generate``)."""
        raise NotImplementedError(f"{type(self).__name__} curates prompts but does not implement select_prompts()")

    def loss(self, ctx: StepContext, batch: Batch, current: LogLik, iteration: int):
        raise NotImplementedError(f"{type(self).__name__} must implement loss()")

    def backward(self, ctx: StepContext, model, batch: Batch, iteration: int, loss_scale: float = 1.0) -> dict[str, float]:
        """One micro-batch of the update. ``loss_scale`` undoes the data-parallel gradient averaging."""
        views = batch["views"][iteration]
        current = self.log_likelihood(ctx, model, batch, views, with_entropy=ctx.want_entropy)
        loss, metrics = self.loss(ctx, batch, current, iteration)
        (loss * loss_scale).backward()
        out = {"loss": float(loss.detach())}
        out.update({k: float(v) for k, v in metrics.items()})
        return out
