"""``plan_recipe``: one training step of a recipe at full size, run by the trainer's own code on fake tensors.

The model is built from its config.json on the meta device, wrapped by ``dare.trainer.assemble`` (LoRA,
checkpointing, reference, companions, FSDP2 on a fake process group of the recipe's world size, optimizer) and
materialised as fake tensors; ``Trainer.from_parts(...).train_step`` then runs one step whose stages are
measured per phase (``Trainer.phase``): peak memory of rank 0 by category (``FSDPMemTracker`` / ``MemTracker``)
and FLOPs (``torch.utils.flop_counter``'s formulas, ``_FlopCount``). The optimizer state is created first (a zero-gradient step), so the step
is a steady-state step. With ``simulate=False`` the same code runs on real tensors (the validation of a plan).

To stay fast, a planned step does less work than a real one where repetitions are identical in memory, and scales
their FLOPs back (``Plan.scaled``): at most two micro-batches per rank in scoring and update (the first without and
the last with gradient reduction, as the trainer does), at most two inner iterations in scoring and one in the
update (iterations that repeat their work on fresh noise; a method whose iterations divide the step's work between
them runs its real count; what scoring runs once per step is counted once), one rollout chunk of
``rollout.micro_batch_size`` prompts probed for its first two denoising steps. ``PlanOptions(reduced=False)`` runs
the whole step instead, nothing scaled: with ``simulate=False``, the check of these reductions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from .gpus import GIB, get_gpu
from .models import empty_in_place
from .trackers import _optimizers, _snapshot, _tracker

PHASES = ("rollout", "score", "update")


@dataclass
class PlanOptions:
    gpus: Optional[int] = None  # world size (default: the recipe's distributed.nproc x nodes)
    gpu: str = "h100"
    gpu_memory: Optional[int] = None  # bytes per GPU (default: the GPU's nominal memory)
    nodes: Optional[int] = None  # machines the GPUs are spread over (default: the recipe's distributed.nnodes)
    prompt_length: int = 256  # RL prompt tokens; SFT / DPO prompt part of each row
    margin: float = 0.10  # fraction of the GPU kept free for what is not modelled (allocator fragmentation)
    reserved_bytes: int = 2 * GIB  # CUDA context, NCCL buffers, kernel workspaces
    train_mfu: float = 0.40  # fraction of the dense bf16 peak reached by scoring and updates
    rollout_mfu: float = 0.10  # decoding steps are small and memory-bound
    target: str = "cuda"  # the optimizer's implementation follows the target device's default (foreach on CUDA)
    simulate: bool = True  # False: real tensors (validation)
    replay: bool = True  # repeated no-grad scoring forwards of the same shapes simulated once (plan/replay.py)
    model: Optional[torch.nn.Module] = None  # a real model (simulate=False); default: built from the config
    reduced: bool = True  # False: the whole step as training runs it, nothing scaled (the check of the reductions)


@dataclass
class PhasePlan:
    name: str
    peak_bytes: int = 0
    breakdown: dict = field(default_factory=dict)
    flops: float = 0.0  # per GPU for one full step (scaled back from the planned work)
    seconds: float = 0.0
    kv_cache_bytes: int = 0


@dataclass
class Plan:
    recipe: str
    model: str
    config_source: str
    family: str
    parameters: int
    trainable: int
    world: int
    nodes: int
    gpu: str
    gpu_memory: int
    budget: int
    steps: int
    phases: list[PhasePlan]
    scaled: dict
    assumptions: dict
    error: Optional[str] = None

    @property
    def peak_bytes(self) -> int:
        return max([p.peak_bytes for p in self.phases] or [0])

    @property
    def peak_phase(self) -> Optional[str]:
        return max(self.phases, key=lambda p: p.peak_bytes).name if self.phases else None

    @property
    def flops_per_step(self) -> float:
        return sum(p.flops for p in self.phases)

    @property
    def seconds_per_step(self) -> float:
        return sum(p.seconds for p in self.phases)

    @property
    def hours(self) -> float:
        return self.steps * self.seconds_per_step / 3600.0

    @property
    def fits(self) -> bool:
        return self.error is None and self.peak_bytes <= self.budget

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(peak_bytes=self.peak_bytes, peak_phase=self.peak_phase, flops_per_step=self.flops_per_step,
                 seconds_per_step=self.seconds_per_step, hours=self.hours, fits=self.fits)
        return d


# ---------------------------------------------------------------------------------------------------------------
# the reduced recipe that is simulated
# ---------------------------------------------------------------------------------------------------------------
def planned_recipe(recipe, world: int, algo):
    """(recipe to simulate, FLOP scale per phase, rollout prompts kept per rank).

    Inner iterations that repeat the step's work on fresh noise are planned as two (the score phase's per-iteration
    scoring is scaled by ``mu / 2`` in ``plan_recipe``, the update runs one); a method whose iterations divide the
    work between them (``Algorithm.iterations_split_work``: EGSPO's steps, d-OPSD's states) is planned at its real
    count, since two of its iterations hold ``mu / 2`` times the work of two real ones."""
    micro = recipe.train.micro_batch_size
    algo_cfg = recipe.algorithm
    n_it = getattr(algo_cfg, "inner_iterations", 1)
    it_planned = n_it if algo.iterations_split_work else min(n_it, 2)
    if n_it != it_planned:
        algo_cfg = dataclasses.replace(algo_cfg, inner_iterations=it_planned)
    if algo.uses_rollout:
        per_rank = recipe.train.batch_size // max(world, 1)
        rows = per_rank * recipe.rollout.group_size
        kept_prompts = min(per_rank, max(1, -(-2 * micro // recipe.rollout.group_size)))
        kept_rows = kept_prompts * recipe.rollout.group_size
        batch = recipe.train.batch_size
    else:
        rows = -(-recipe.train.batch_size // max(world, 1))
        kept_rows = min(rows, 2 * micro)
        kept_prompts = None
        batch = kept_rows * world
    micro_scale = math.ceil(rows / micro) / math.ceil(kept_rows / micro)
    # the update runs one inner iteration (``_PhaseMeter`` ends the step at the second: same memory); the score
    # phase's scale is completed by ``plan_recipe`` once it knows which part of the scoring ran per iteration
    scale = {"score": micro_scale, "update": micro_scale * n_it}
    train = dataclasses.replace(recipe.train, batch_size=batch)
    planned = dataclasses.replace(recipe, algorithm=algo_cfg, train=train)
    return planned, scale, kept_prompts


@contextlib.contextmanager
def _iteration_scoring(meter, out: list):
    """Appends ``(iteration, FLOPs)`` of each inner iteration's views the score phase scores (``stages.score_iteration``:
    under the policy before the update, under the reference). Iterations with the same views are scored once."""
    from ..trainer import stages
    original = stages.score_iteration

    def counted(algo, ctx, model, batch, it, *args, **kwargs):
        if meter.current != "score":
            return original(algo, ctx, model, batch, it, *args, **kwargs)
        before = meter.counter.get_total_flops()
        try:
            return original(algo, ctx, model, batch, it, *args, **kwargs)
        finally:
            out.append((it, meter.counter.get_total_flops() - before))
    stages.score_iteration = counted
    try:
        yield
    finally:
        stages.score_iteration = original


def _score_flops(measured: float, iterations: list, ratio: float) -> float:
    """The score phase's FLOPs with ``ratio`` (real / planned inner iterations) applied to the per-iteration scoring
    only when the planned iterations scored views of their own: what runs once per step (the method's prepare and
    frozen passes, companions, views shared by every iteration) runs once in training too."""
    per_iteration = sum(f for _, f in iterations)
    fresh = any(it > 0 for it, _ in iterations)
    return measured - per_iteration + per_iteration * (ratio if fresh else 1.0)


def decode_flops(f_first: float, f_step: float, sampler, adapter, prompt_length: int) -> float:
    """FLOPs of a whole decode from its first forward and a later (cached) one, by the schedule's step count.

    Threshold / factor decoding may stop a block early: this counts every scheduled step (an upper bound)."""
    from .data import schedule
    blocks, spb = schedule(sampler, adapter)
    if adapter.is_encoder_decoder:
        return f_first * blocks * spb
    if adapter.is_block_causal:
        B = sampler.block_length
        if sampler.cache in ("block", "dual"):  # dual: some steps feed a sub-block only (an upper bound)
            return f_first + (blocks * spb - 1) * f_step
        # uncached: every step reruns the sequence so far; a forward's work grows with its length
        return sum(spb * f_first * (prompt_length + (b + 1) * B) / (prompt_length + B) for b in range(blocks))
    if sampler.cache in ("prefix", "dual"):
        return blocks * f_first + blocks * (spb - 1) * f_step
    return blocks * spb * f_first


# ---------------------------------------------------------------------------------------------------------------
# measurement (the memory trackers: plan/trackers.py)
# ---------------------------------------------------------------------------------------------------------------
class _FlopCount:
    """FLOPs of the ops dispatched inside (torch.utils.flop_counter's formulas). Not ``FlopCounterMode``: its module
    tracking keeps activations alive that activation checkpointing frees (measured: 9 -> 46 MB at the peak of an
    8-layer model), which would put its own memory into the plan."""

    def __init__(self):
        self.total = 0

    def get_total_flops(self) -> int:
        return self.total

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                formula = flop_registry.get(func._overloadpacket)
                if formula is not None:
                    counter.total += int(formula(*args, **kwargs, out_val=out))
                return out
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


class _StepPlanned(Exception):
    """Raised by the meter once every distinct stage of the step has run."""


class _PhaseMeter:
    """``Trainer.phase`` for a planned step: per phase the peak of rank 0 (since the phase began) and FLOPs."""

    def __init__(self, tracker, whole_step: bool = False):
        self.tracker, self.whole_step = tracker, whole_step
        self.results: dict[str, PhasePlan] = {}
        self.probes: dict[int, float] = {}
        self.kv_bytes = 0
        self.current: Optional[str] = None

    def _reset_peak(self) -> None:
        t = self.tracker
        t._peak_mem = {dev: snap["Total"] for dev, snap in t._curr_mem_snap.items()}
        t._peak_mem_snap = {dev: dict(snap) for dev, snap in t._curr_mem_snap.items()}

    @contextlib.contextmanager
    def __call__(self, name: str):
        if name == "update" and name in self.results and not self.whole_step:
            raise _StepPlanned  # further inner iterations repeat the first one's memory; their FLOPs are scaled
        self._reset_peak()
        self.current = name
        counter = self.counter = _FlopCount()
        with counter:
            yield
        res = self.results.setdefault(name, PhasePlan(name))
        peak = max(self.tracker._peak_mem.values() or [0])
        if peak >= res.peak_bytes:
            res.peak_bytes = int(peak)
            res.breakdown = _snapshot(next(iter(self.tracker._peak_mem_snap.values()), {}))
        res.flops += float(counter.get_total_flops())
        self.current = None

    @contextlib.contextmanager
    def probe(self, steps: int):
        """One probed ``generate(until_step=steps)`` of the rollout: its FLOPs and the KV cache it allocated."""
        from ..models.cache import KVCache
        caches = []
        original = KVCache.__init__

        def init(cache, *a, **k):
            original(cache, *a, **k)
            caches.append(cache)
        counter = _FlopCount()
        KVCache.__init__ = init
        try:
            with counter:
                yield
        finally:
            KVCache.__init__ = original
        self.probes[steps] = float(counter.get_total_flops())
        kv = sum(t.untyped_storage().nbytes() for c in caches for t in (*c.k, *c.v) if t is not None)
        self.kv_bytes = max(self.kv_bytes, kv)


def _prime_optimizers(built) -> None:
    """A zero-gradient step creates the optimizer states, so the planned step is a steady-state step."""
    for opt in _optimizers(built):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _process_group(world: int):
    """A fake process group of ``world`` ranks (this process is rank 0); none needed for one process."""
    import torch.distributed as dist
    if world <= 1 or dist.is_initialized():
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fake_placement(sim):
    from ..trainer.assemble import Placement

    def materialize(module, sharded: bool) -> None:
        with sim.fake:
            if sharded:
                module.to_empty(device="cpu")  # FSDP2 materialises its sharded parameters itself
            else:
                empty_in_place(module)
                if hasattr(module, "fuse_projections"):
                    module.fuse_projections()  # as load_model does: q/k/v share one buffer outside FSDP
    return Placement(place=lambda module: module, materialize=materialize)


def _sources(recipe, algo, tokenizer, env, adapter, vocab: int, prompt_length: int):
    from ..trainer.data import PreferenceSource, SFTSource
    from ..trainer.rl import PromptSource
    from . import data
    kind, seed, bs = algo.data_kind, recipe.train.seed, recipe.train.batch_size
    if kind == "sft":
        return SFTSource(data.sft_docs(recipe, adapter, vocab, prompt_length), recipe.data, bs, seed,
                         tokenizer.eos_token_id, env.dp_rank, env.dp_size)
    if kind == "preference":
        return PreferenceSource(data.preference_pairs(recipe, adapter, vocab, prompt_length), bs, seed,
                                tokenizer.eos_token_id, env.dp_rank, env.dp_size)
    if kind == "prompts":
        return PromptSource(data.prompts(recipe, adapter, vocab, prompt_length), bs, seed, env.dp_rank, env.dp_size)
    raise ValueError(f"dare plan: no planned data for data_kind {kind!r}")


def plan_recipe(recipe, options: Optional[PlanOptions] = None, name: str = "") -> Plan:
    """Plan one steady-state step of ``recipe`` on ``options.gpus`` GPUs (see the module docstring)."""
    from ..algorithms.registry import build_algorithm
    from ..trainer.assemble import Placement, assemble
    from ..trainer.distributed import DistEnv
    from ..trainer.loop import Trainer
    from ..trainer.rl import rollout_share
    from .data import PlanTokenizer, SimulatedRollout
    from .models import meta_model
    from .replay import replaying
    from .simulate import Simulation

    opts = options or PlanOptions()
    nodes = opts.nodes or recipe.distributed.nnodes
    world = opts.gpus or recipe.distributed.nproc * nodes
    if world % nodes:
        raise ValueError(f"{world} GPUs do not split over {nodes} nodes")
    gpu = get_gpu(opts.gpu)
    memory = opts.gpu_memory or gpu.memory_bytes
    budget = int(memory * (1.0 - opts.margin)) - opts.reserved_bytes
    dp = world // recipe.distributed.sequence_parallel  # a sequence-parallel group shares its data
    if opts.reduced:
        planned, scale, kept_prompts = planned_recipe(recipe, dp, build_algorithm(recipe.algorithm))
    else:
        planned, scale, kept_prompts = recipe, {}, recipe.train.batch_size // max(dp, 1)
    algo = build_algorithm(planned.algorithm)
    iteration_ratio = getattr(recipe.algorithm, "inner_iterations", 1) / getattr(planned.algorithm, "inner_iterations", 1)
    scored_iterations: list = []
    if opts.model is not None:
        model, source_desc = opts.model, "the given model"
    else:
        model, source_desc = meta_model(planned.model)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.arch.vocab_size
    plan = Plan(recipe=name, model=planned.model.path, config_source=source_desc, family=model.family,
                parameters=params, trainable=0, world=world, nodes=nodes, gpu=gpu.name, gpu_memory=memory,
                budget=budget, steps=recipe.train.steps, phases=[], scaled=scale, assumptions={})
    sim = Simulation(cuda_kernels=opts.target == "cuda") if opts.simulate else None
    with _process_group(world):
        import torch.distributed as dist
        if dist.is_initialized():  # a real process group (validation under torchrun) or the fake one
            rank, world = dist.get_rank(), dist.get_world_size()
            plan.world = world
            backend = dist.get_backend()
        else:
            rank, backend = 0, None
        env = DistEnv(rank, world, rank, torch.device("cpu"), backend, world // nodes).use_sequence_parallel(
            planned.distributed.sequence_parallel)
        placement = _fake_placement(sim) if sim is not None else Placement.on_device(env.device)
        built = assemble(planned, env, algo, model, placement)
        plan.trainable = sum(p.numel() for p in built.model.parameters() if p.requires_grad)  # DTensor: global numel
        if opts.target == "cuda":  # what torch.optim picks on CUDA tensors (CPU tensors take the per-tensor loop)
            for opt in _optimizers(built):
                for group in opt.param_groups:
                    group["foreach"] = True
        tokenizer = PlanTokenizer(model.adapter, vocab)
        source = _sources(planned, algo, tokenizer, env, model.adapter, vocab, opts.prompt_length)
        tracker = _tracker(built, built.fsdp)
        meter = _PhaseMeter(tracker, whole_step=not opts.reduced)
        rollout = None
        if algo.uses_rollout:
            rollout = SimulatedRollout(planned, tokenizer, env, vocab, meter.probe, kept_prompts)
        trainer = Trainer.from_parts(planned, env, algo, built, tokenizer, source, rollout)
        trainer.phase = meter
        steps_taken = []
        built.optimizer.register_step_post_hook(lambda *a: steps_taken.append(1))
        try:
            models = [built.model, getattr(built.reference, "module", None), *built.companions.modules().values()]
            with (sim if sim is not None else contextlib.nullcontext()), tracker, \
                    replaying(meter, tracker, models, enabled=opts.replay and sim is not None) as replay, \
                    _iteration_scoring(meter, scored_iterations):
                if rollout is not None and replay is not None:
                    rollout.run_unit = replay.unit  # the methods' per-view units (``Services.run_unit``)
                _prime_optimizers(built)
                primed = len(steps_taken)
                try:
                    trainer.train_step(0)
                except _StepPlanned:
                    pass
                if len(steps_taken) == primed:
                    raise RuntimeError("the planned step skipped its optimizer step (a non-finite loss or gradient "
                                       "norm), so its peak would be missing")
        except Exception as e:  # a stage the simulation cannot run: say which and why, keep what was measured
            plan.error = f"{meter.current or 'step'}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if sim is not None:
            if rollout is not None and rollout.extra_rows:
                sim.assume(f"rollout: the method's other decodes (pass@k retries, ICFW curation) counted as "
                           f"{rollout.extra_rows} rows beside the group rollout's {rollout.handed_rows}; how many follows "
                           "the planned rewards, which alternate 0 / 1 within a group")
            plan.assumptions = dict(sim.assumptions)
    for name_ in PHASES:
        res = meter.results.get(name_)
        if res is None or (name_ == "score" and res.flops == 0):  # nothing to score (SFT): no phase
            continue
        if name_ == "rollout" and meter.probes:
            f1 = meter.probes.get(1, 0.0)
            f2 = (max(meter.probes[2] - f1, 0.0) if 2 in meter.probes else f1) * rollout.step_share
            start, stop = rollout_share(planned.train.batch_size // env.dp_size, env.sequence_group())
            chunk = planned.rollout.micro_batch_size or (stop - start)
            chunks = math.ceil((stop - start) / chunk)
            # Decodes a method asked for besides the group rollout (pass@k retries, ICFW curation: ``generate``)
            # cost their rows' share of it.
            extra = rollout.extra_rows / rollout.handed_rows if rollout.handed_rows else 0.0
            res.flops = chunks * decode_flops(f1, f2, planned.rollout.sampler, model.adapter, opts.prompt_length) \
                * rollout.decode_share * (1.0 + extra)
            res.kv_cache_bytes = meter.kv_bytes
            res.seconds = res.flops / (opts.rollout_mfu * gpu.bf16_flops)
        else:
            measured = res.flops
            if name_ == "score":
                res.flops = _score_flops(measured, scored_iterations, iteration_ratio)
            res.flops *= scale.get(name_, 1.0)
            if name_ == "score" and scale and measured:  # the whole factor, as the report shows it
                scale["score"] = res.flops / measured
            res.seconds = res.flops / (opts.train_mfu * gpu.bf16_flops)
        plan.phases.append(res)
    return plan
