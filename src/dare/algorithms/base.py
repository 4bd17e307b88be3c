"""The algorithm hook interface.

The training loop (``dare.trainer.loop``) is one workflow for every method::

    (1) rollout  (2) reward  (3) prepare: state, corruption, old-policy / reference log-probs  (4) advantage
    (5) update

SFT and DPO/VRPO take the same path without (1)-(2) (``uses_rollout = False``). The loop never looks at an
algorithm's name: it calls the hooks below, each with a default, so a method is one file that overrides a few.
RL hooks read a typed ``RLBatch`` (``dare.algorithms.batch``: every field says its shape and the stage that fills
it) and *return* what they compute; the loop stores it in the batch. Shapes: B samples, P prompt and Lc completion
positions, K likelihood slots (usually Lc; 1 for a sequence-level estimate).

* ``prepare(ctx, batch) -> state | None`` -- per-batch data the method derives once before any corruption (the
  replay plan of the rollout's step map, MDPO's per-step rewards); stored as ``batch.state`` (a dataclass of
  per-sample tensors, sliced with the micro-batches).
* ``corrupt(ctx, batch, iteration) -> list[View]`` -- the noise/mask sampler. It draws from
  ``ctx.generator(iteration, sample_uid, mc_index)`` so that old, reference and current policies score identical
  inputs and the ``mu`` inner iterations reuse the same noise. The loop calls it once per inner iteration (once in
  all when ``deterministic_views``: a trajectory replay draws nothing) and stores ``batch.views[iteration]``.
  ``reference_views`` (default: the same views) lets a method give the reference policy its own noise.
* ``log_likelihood(ctx, model, batch, views) -> LogLik`` -- the likelihood estimator: combines per-target
  log-probs of every view (``View.weight`` carries 1/t, complementary-mask weights, ...) into ``value [B, K]``.
  ``mc_samples`` says how many forward rows it uses per sample.
* ``frozen_models`` / ``score_frozen(ctx, batch, lend, micro_batch_size) -> scores | None`` -- stage (3), after the
  views: a method's own no-grad passes over the batch with the modules ``frozen_models`` names, each lent by the
  trainer as ``with lend(name) as module`` ("policy": the current weights before this step's updates; "reference":
  the reference policy, i.e. the LoRA-disabled base or a frozen copy of the initial model; a companion's name: that
  model before its update), for what it needs besides the views' log-likelihoods (EGSPO-SA: the greedy one-step
  denoise of every trained state; d-OPSD: its self-future teacher; TraceRL: the value model's old values; IGPO: the
  entropies of its hint positions). Stored as ``batch.frozen`` and kept for every inner iteration. Default: no pass.
  ``batch.state`` has one writer, ``prepare``; ``batch.frozen`` one, ``score_frozen``.
* ``advantages(ctx, batch) -> Advantages | None`` -- the advantage estimator (RL only): values and the active mask.
* ``loss(ctx, batch, current, iteration) -> (loss, metrics)`` -- the objective of one micro-batch, a thin adapter
  over ``dare.algorithms.losses``. Losses and metrics are *additive*: each micro-batch returns its share of the
  global value, normalised with the global counts in ``ctx.norms`` (from ``normalizers``, summed over
  micro-batches and ranks by the loop), so results do not depend on micro-batching or the number of processes.
* ``backward(ctx, model, batch, iteration, loss_scale) -> metrics`` -- the update's autograd for one micro-batch.
  The default builds one graph (``log_likelihood`` -> ``loss`` -> ``backward``); methods that need one graph per
  view use ``dare.algorithms.common.scoring.backward_each_view``.
* ``check_rollout(sampler, adapter)`` / ``collect(ctx, prompts, model)`` -- RL only: a start-up check of the
  recipe's sampler, and stages (1)-(2) for a method whose rollout is not G independent completions per prompt
  (d-TreeRPO's trees).
* ``curates_prompts`` / ``select_prompts(ctx, model, prompts, uids) -> list[int]`` -- data curation (MDPO's ICFW).

Hooks ask the trainer for everything else (decoding, rewards, collectives, the data source) through
``ctx.services`` (``Services``), which the trainer and the planner both implement.

Algorithm configs are dataclasses registered with their algorithm; the recipe's ``algorithm:`` section picks the
dataclass from ``algorithm.name`` (so method-specific keys are validated).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Optional

import torch

from ..diffusion.corruption import apply_mask
from ..diffusion.logprob import DEFAULT_CHUNK
from ..diffusion.noise import STREAM_CORRUPT, keyed_generator
from ..diffusion.uniform import uniform_replace
from ..rollout.config import Record
from .batch import Advantages, LogLik, RLBatch, View
from .common.scoring import score_views
from .registry import ALGORITHMS, get_algorithm


# What a config field's value multiplies in a step's cost (``cost``): its inner iterations, the estimator's MC samples
# (forwards per sample), or the trained steps per completion. Tests shrink these fields for CPU runs, the paper grid
# sets the MC samples to its unified count, and docs name them, all by this metadata: no list of field names.
COST_KINDS = ("iterations", "mc_samples", "trained_steps")


def cost(default: int, kind: str):
    """A config field whose value multiplies a step's cost (``kind`` one of ``COST_KINDS``), e.g.
    ``num_mc: int = cost(16, "mc_samples")``. A subclass that changes the default declares it with ``cost`` again."""
    if kind not in COST_KINDS:
        raise ValueError(f"cost kind must be one of {COST_KINDS}, got {kind!r}")
    return field(default=default, metadata={"cost": kind})


def cost_knobs(config_class, *kinds: str) -> dict[str, str]:
    """``{field name: cost kind}`` of ``config_class``'s cost fields (of ``kinds`` only, when given)."""
    import dataclasses
    return {f.name: f.metadata["cost"] for f in dataclasses.fields(config_class)
            if "cost" in f.metadata and (not kinds or f.metadata["cost"] in kinds)}


def _sums_here(values: dict) -> dict:
    return dict(values)


@dataclass
class Services:
    """Everything a method may ask of the trainer: ``ctx.services``. A hook uses nothing else of the trainer (no
    ``dare.rollout`` decoding of its own, no trainer object: tests/algorithms/test_services.py holds it), so the
    training loop and the planner (``dare.plan``, whose rollout stage decodes on fake tensors) serve the same hooks.
    The RL trainer fills every field (``dare.trainer.rl.RolloutStage.services``); None where a run has no such thing
    (SFT and DPO have no sampler and no reward).

    Decoding (RL), each one typed request -- prompts, the sampler's decoding settings (``dare.rollout.SamplerConfig``)
    and what to record besides the completions (``record``: a ``dare.rollout.Record``, the trajectory and the commit
    entropies; ``hints``; pause points are ``cut_steps``): ``collect(ctx, prompts, model, sampler=None, record=None)
    -> (RLBatch, metrics)`` the default stages (1)-(2), ``group_size`` completions per prompt scored by the recipe's
    reward; ``decode(prompts, seeds, model, sampler, hints=None, record=None) -> Rollout`` stage (1) alone (the ranks
    of a sequence-parallel group share the prompts; ``hints`` inpainting tokens); ``decode_tree(prompt_tokens, seeds,
    model, sampler, branching, cut_steps)`` a tree rollout (d-TreeRPO); ``generate(model, prompt_tokens, sampler, n,
    seeds, attention_mask=None, record=None)`` one decode on this rank alone, inside ``gathered(model)`` (the weights
    gathered once, however many decodes follow: every rank must enter it); ``prompt_seeds(ctx, prompts)`` the keyed
    rollout seed of every prompt.

    Rewards: ``score_texts(texts, examples) -> [N]``; ``score_ids(ids [N, G], examples, stop_token_ids) -> [N]`` (cut
    at the first stop token); ``score_completions(batch, ids [N, Lc], sample_index [N]) -> [N]`` other completions of
    the batch's samples (MDPO's and EGSPO's intermediate predictions); ``rollout_metrics(rewards, completion_mask,
    nfe, rollout_time, reward_time)`` the step's reward / length metrics over every rank.

    Settings: ``tokenizer``; ``rollout_sampler`` the recipe's ``rollout.sampler``; ``group_size`` completions per
    prompt; ``rollout_micro_batch_size`` prompts per decoding call.

    Collectives and data: ``all_reduce_sums({name: float}) -> {name: sum over ranks}``; ``device``; ``dataset`` the
    recipe's ``data.dataset`` (IGPO reads its template for reference solutions).

    ``run_unit(key, unit) -> unit()``: how ``common.scoring.backward_each_view`` runs one view's forward + backward
    (None: in place; the planner replays a unit of shapes it has measured: ``dare.plan.replay``)."""
    tokenizer: Any = None
    rollout_sampler: Any = None  # the recipe's ``rollout.sampler`` (a ``dare.rollout.SamplerConfig``)
    group_size: int = 1
    rollout_micro_batch_size: Optional[int] = None  # prompts per decoding call (``rollout.micro_batch_size``; None: all)
    dataset: Any = None
    device: Any = None
    collect: Optional[Callable[..., tuple]] = None
    decode: Optional[Callable[..., Any]] = None
    decode_tree: Optional[Callable[..., Any]] = None
    generate: Optional[Callable[..., Any]] = None
    gathered: Optional[Callable[[Any], Any]] = None
    prompt_seeds: Optional[Callable[..., list]] = None
    score_texts: Optional[Callable[[list, list], torch.Tensor]] = None
    # reward of token ids ``[N, G]`` (cut at their first stop token) for data rows ``examples`` -> ``[N]``
    score_ids: Optional[Callable[[torch.Tensor, list, Any], torch.Tensor]] = None
    # reward of other completions ``[N, Lc]`` of the batch's samples ``sample_index [N]`` (MDPO's predictions) -> [N]
    score_completions: Optional[Callable[[RLBatch, torch.Tensor, torch.Tensor], torch.Tensor]] = None
    rollout_metrics: Optional[Callable[..., dict]] = None
    all_reduce_sums: Callable[[dict], dict] = _sums_here  # one process: the sums are its own values
    run_unit: Optional[Callable[[Any, Callable[[], tuple]], tuple]] = None


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
    services: Services = field(default_factory=Services)
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


@dataclass
class Companion:
    """A model an algorithm trains alongside the policy (TraceRL's value model), with its own AdamW learning rate
    (the other optimizer settings and the LR schedule are the recipe's). ``build(policy)`` makes it from the
    policy as configured (LoRA, gradient checkpointing), before FSDP sharding; the trainer shards it the same way."""
    name: str
    build: Callable[[Any], torch.nn.Module]
    lr: float


# ``lend(name)``: a context manager that lends the module ``name`` (see ``Algorithm.frozen_models``) under no_grad.
Lend = Callable[[str], ContextManager[torch.nn.Module]]


def lend_modules(**modules: torch.nn.Module) -> Lend:
    """A ``Lend`` over fixed modules (tests, drivers without a trainer): ``lend_modules(policy=model)("policy")``."""
    @contextlib.contextmanager
    def lend(name: str):
        if name not in modules:
            raise KeyError(f"no module {name!r} to lend (lent: {', '.join(sorted(modules))})")
        with torch.no_grad():
            yield modules[name]
    return lend


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
        from ..config.core import ConfigError
        from .registry import load_builtin_algorithms
        load_builtin_algorithms()
        name = data.get("name")
        if name is None:
            raise ConfigError(f"algorithm.name is required; one of: {', '.join(sorted(ALGORITHMS))}")
        try:
            return get_algorithm(str(name)).config_class
        except ValueError as e:
            raise ConfigError(f"algorithm.name: {e}") from e


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
    paper: ClassVar[Optional["PaperSettings"]] = None  # noqa: F821 (dare.algorithms.paper)
    # The rest of its manifest (``dare.algorithms.paper``), each declared on the class itself (not inherited): its
    # departures from the paper grid's unified settings (scripts/make_paper_recipes.py), and the factor ``dare
    # compare`` measured on its paper-relative lr on the tiny checkpoints (None: its paper's ratio works there).
    grid: ClassVar[Optional["GridAdjust"]] = None  # noqa: F821
    departure: ClassVar[Optional["LrDeparture"]] = None  # noqa: F821
    # The corruption draws nothing (a replay of the rollout's trace): every inner iteration scores the views of the
    # first, which the prepare stage then scores once.
    deterministic_views: ClassVar[bool] = False
    # The inner iterations divide the step's work between them (each trains its own share of the selected steps or
    # recorded states) instead of repeating it on fresh noise: ``dare plan`` then runs the real count of them (it
    # plans repeating iterations as two and scales).
    iterations_split_work: ClassVar[bool] = False

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

    @property
    def record(self) -> Record:
        """What the method's rollouts record besides their completions (``dare.rollout.Record``: MDPO's trajectory,
        EGSPO's commit entropies): a request of the method, not a setting of the recipe's sampler. Default: nothing."""
        return Record()

    def collect(self, ctx: StepContext, prompts, model) -> tuple[RLBatch, dict]:
        """Stages (1) rollout and (2) reward: the RL batch and its metrics. Default: ``group_size`` independent
        completions per prompt recording ``self.record`` (``ctx.services.collect``); a method with another rollout
        shape (d-TreeRPO's trees) builds its batch here from the services' decoding, seeds and reward scoring."""
        return ctx.services.collect(ctx, prompts, model, record=self.record)

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
        """Forward rows the likelihood estimator uses per sample (documentation and cost accounting)."""
        return 1

    def normalizers(self, batch) -> dict[str, float]:
        """Local counts the loss divides by (``{"tokens": ..., "seqs": ...}``: floats of this rank's batch, after the
        advantages); the loop sums them over micro-batches and ranks into ``ctx.norms``."""
        return {"samples": float(batch.size)}

    # --- hooks ----------------------------------------------------------------------------------------
    def prepare(self, ctx: StepContext, batch):
        """Per-batch state derived once before any corruption (stage 3), stored as ``batch.state`` (its one writer:
        what a ``collect`` records of its rollout rides the batch's rollout fields, e.g. ``hint_mask`` or ``tree``).

        Args: ``batch`` the whole step's batch on this rank (``RLBatch`` for RL). Returns a dataclass whose tensors are
        per sample (first dimension B, sliced with the micro-batches; other fields are kept), or None."""
        return None

    def corrupt(self, ctx: StepContext, batch, iteration: int) -> list[View]:
        """The forward inputs of inner iteration ``iteration``: one ``View`` per forward, each ``input_ids [B, L]``
        with ``targets`` / ``labels`` / ``weight`` ``[B, L']`` and ``score_index [B, K]`` into the estimator's K slots.
        Draws come from ``ctx.generator(iteration, uid, ...)`` (or ``ctx.corrupt``), never from global RNGs."""
        raise NotImplementedError(f"{type(self).__name__} must implement corrupt()")

    def reference_views(self, ctx: StepContext, batch, iteration: int) -> list[View]:
        """The views the reference policy scores. Default: the policy's own (shared, antithetic noise)."""
        return batch.views[iteration]

    def log_likelihood(self, ctx: StepContext, model, batch, views: list[View], *, with_entropy: bool = False) -> LogLik:
        """Default estimator: ``sum_v weight_v * logp_v`` over the views, mapped to slots by ``score_index``.

        Returns ``value [B, K]`` (K = the slots of ``score_index``, else the views' ``[B, L]`` grid) and, with
        ``with_entropy``, the mean entropy of the same slots over the views."""
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

    def advantages(self, ctx: StepContext, batch) -> Optional[Advantages]:
        """Stage (4), on the whole step's batch: ``Advantages(values [B] / [B, S] / [B, Lc], active [B])`` (a subclass
        carries more, e.g. wd1's group weights); None for methods without advantages (SFT, DPO)."""
        return None

    def companions(self) -> list[Companion]:
        """Models trained alongside the policy (see ``Companion``); none by default."""
        return []

    @property
    def frozen_models(self) -> tuple[str, ...]:
        """The modules ``score_frozen`` borrows in stage (3), by name: "policy" (the current weights, before this
        step's updates), "reference" (the reference policy, built for it as for a KL penalty: the LoRA-disabled base
        or a frozen copy of the initial model) or a companion's name (``companions()``). Empty: no such pass."""
        return ()

    def score_frozen(self, ctx: StepContext, batch, lend: "Lend", micro_batch_size: int):
        """Stage (3), after the views are drawn and before the old / reference log-probs: the method's own no-grad
        scoring of the batch with the modules ``frozen_models`` names, each borrowed as ``with lend(name) as
        module`` (one at a time: a LoRA-disabled reference is the policy's own weights with the adapters off).
        Returns what the method reads later as ``batch.frozen`` (a dataclass of per-sample tensors, sliced with the
        micro-batches), or None. It runs once per batch, so what it returns serves every inner iteration. Under FSDP
        every rank must run the same number of forwards."""
        return None

    @property
    def curates_prompts(self) -> bool:
        """Whether the RL trainer asks ``select_prompts`` which training prompts to use (MDPO's ICFW)."""
        return False

    def select_prompts(self, ctx: StepContext, model, prompts: list, uids: list[int]) -> list[int]:
        """Positions in ``prompts`` (objects with ``input_ids`` and ``example``; ``uids`` their global indices) to train
        on until the next curation. Runs with the model gathered for decoding (``ctx.services.generate``)."""
        raise NotImplementedError(f"{type(self).__name__} curates prompts but does not implement select_prompts()")

    def loss(self, ctx: StepContext, batch, current: LogLik, iteration: int):
        """``(loss, metrics)`` of one micro-batch: ``current.value [B, K]`` from ``log_likelihood`` of the same
        micro-batch's views; the loss is a 0-dim tensor (its share of the step's loss, normalised by ``ctx.norms``),
        metrics a dict of floats (additive shares too)."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss()")

    def backward(self, ctx: StepContext, model, batch, iteration: int, loss_scale: float = 1.0) -> dict[str, float]:
        """One micro-batch of the update. ``loss_scale`` undoes the data-parallel gradient averaging."""
        current = self.log_likelihood(ctx, model, batch, batch.views[iteration], with_entropy=ctx.want_entropy)
        loss, metrics = self.loss(ctx, batch, current, iteration)
        (loss * loss_scale).backward()
        out = {"loss": float(loss.detach())}
        out.update({k: float(v) for k, v in metrics.items()})
        return out
