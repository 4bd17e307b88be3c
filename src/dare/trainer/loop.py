"""The training executor behind ``dare train``: one loop for SFT, LoRA, DPO/VRPO and RL.

Each step, read top to bottom (``Trainer.train_step``):

  (1) rollout   (2) reward         -- RL only (``algo.uses_rollout``), in ``dare.trainer.rl``
  (3) corruption + old-policy / reference log-probs   -- ``stages.prepare``
  (4) advantage                    -- ``algo.advantages`` (None for SFT / DPO)
  (5) update: ``algo.inner_iterations`` optimizer updates, each over every micro-batch (``stages.update``)

The loop never branches on an algorithm or model name: it reads the algorithm's declared fields (``data_kind``,
``uses_rollout``, ``needs_reference`` ...) and the model's ``adapter``. Around the stages it owns data, FSDP2
sharding, gradient clipping, NaN/inf skipping, the LR schedule, atomic checkpoints with exact resume, logs and the
final export.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

import torch

from ..algorithms.base import Services, StepContext
from ..algorithms.registry import build_algorithm
from ..config.core import to_dict
from . import stages
from .assemble import assemble
from .checkpoint import CheckpointError, CheckpointManager
from .data import PreferenceSource, SFTSource, load_preference_pairs, load_sft_docs
from ..models.sequence_parallel import sharding_sequences
from .distributed import DistEnv, set_grad_sync
from .logs import MetricsLogger
from .model_setup import export_pretrained, load_policy
from .optim import grad_norm_and_clip
from .reference import CopyReference
from .run_folder import RecipeChanged, RunFolderBusy, RunLock, check_resume, fingerprint

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. too many non-finite steps); the message says what to change."""


def _check_max_length(recipe, model) -> None:
    from ..data.prompts import PromptBudget
    budget = PromptBudget.for_model(model, 0)
    if budget is not None and recipe.data.max_length > budget.tokens:
        raise ValueError(f"data.max_length={recipe.data.max_length} exceeds the model's {budget.tokens} positions")


def _sft_source(recipe, tokenizer, env, model):
    _check_max_length(recipe, model)
    docs = load_sft_docs(recipe.data, tokenizer)
    return SFTSource(docs, recipe.data, recipe.train.batch_size, recipe.train.seed, tokenizer.eos_token_id, env.dp_rank, env.dp_size)


def _preference_source(recipe, tokenizer, env, model):
    _check_max_length(recipe, model)
    pairs = load_preference_pairs(recipe.data, tokenizer)
    return PreferenceSource(pairs, recipe.train.batch_size, recipe.train.seed, tokenizer.eos_token_id, env.dp_rank, env.dp_size)


def _prompt_source(recipe, tokenizer, env, model):
    from ..data.prompts import PromptBudget
    from .rl import PromptSource
    budget = PromptBudget.for_model(model, recipe.rollout.sampler.gen_length, "rollout.sampler.gen_length")
    return PromptSource.from_recipe(recipe, tokenizer, env, budget)


# Data sources by the algorithm's declared ``data_kind``.
DATA_SOURCES: dict[str, Callable] = {"sft": _sft_source, "preference": _preference_source, "prompts": _prompt_source}


class Trainer:
    def __init__(self, recipe, env: Optional[DistEnv] = None):
        self.recipe = recipe
        self.env = (env or DistEnv.from_env(recipe.distributed.backend)).use_sequence_parallel(
            recipe.distributed.sequence_parallel)
        if self.env.distributed and self.env.is_main:
            log.info("%d processes on %d node(s), %s sharding", self.env.world_size, self.env.nodes,
                     recipe.distributed.sharding)
        self.run_dir = Path(recipe.train.output_dir)
        self.ckpt = CheckpointManager(self.run_dir, self.env, recipe.train.keep_checkpoints)
        self.lock = RunLock(self.run_dir, "dare train")
        try:
            self._resume_from = self._claim_run_folder()  # before any model loads: a wrong folder fails at once
            self._build()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_parts(cls, recipe, env: DistEnv, algo, built, tokenizer, source, rollout=None) -> "Trainer":
        """A trainer over parts built elsewhere, with no run folder, logger or checkpoints: ``train_step`` runs
        exactly as in ``run`` (``dare plan`` simulates steps with it, ``phase`` marking each stage)."""
        self = cls.__new__(cls)
        self.recipe, self.env, self.algo, self.tokenizer, self.source, self.rollout = recipe, env, algo, tokenizer, source, rollout
        self._adopt(built)
        self.start_step, self.bad_steps = 0, 0
        return self

    def _adopt(self, built) -> None:
        """Take the models, optimizers and precision context that ``assemble`` built."""
        self.model, self.reference, self.companions = built.model, built.reference, built.companions
        self.optimizer, self.scheduler, self.fsdp, self._autocast = built.optimizer, built.scheduler, built.fsdp, built.autocast

    # Stages of a step run inside ``self.phase(name)`` ("rollout", "score", "update"): a no-op in training; the
    # planner measures memory and FLOPs per stage through it.
    phase = staticmethod(lambda name: contextlib.nullcontext())

    def _build(self) -> None:
        recipe = self.recipe
        self.algo = build_algorithm(recipe.algorithm)
        model, self.tokenizer = load_policy(recipe.model)
        self._adopt(assemble(recipe, self.env, self.algo, model))
        kind = self.algo.data_kind
        if kind not in DATA_SOURCES:
            raise ValueError(f"algorithm {self.algo.name!r} declares data_kind {kind!r}; known: {', '.join(DATA_SOURCES)}")
        self.source = DATA_SOURCES[kind](recipe, self.tokenizer, self.env, model)
        self.rollout = None
        if self.algo.uses_rollout:
            from .rl import RolloutStage
            self.rollout = RolloutStage(recipe, self.tokenizer, self.env)
        lg = recipe.logging
        self.logger = MetricsLogger(self.run_dir, self.env.is_main, lg.tensorboard, lg.wandb, lg.wandb_project, to_dict(recipe))
        self.start_step, self.bad_steps = 0, 0
        self._resume()

    # --- resume -----------------------------------------------------------------------------------------
    def _ref_module(self):
        sync_every = self.algo.reference_sync[0]
        return self.reference.module if isinstance(self.reference, CopyReference) and sync_every else None

    def _claim_run_folder(self) -> Optional[Path]:
        """Lock the run folder and pick the checkpoint to resume (verified, with the recipe's fingerprint checked).
        Rank 0 decides; every rank gets the same answer (or the same error)."""
        decision: tuple = ("ok", None)
        if self.env.is_main:
            try:
                self.lock.acquire()
                path = self.ckpt.resolve(self.recipe.train.resume)
                if path is None and self.recipe.train.resume == "never" and self.ckpt.latest() is not None:
                    raise ValueError(f"train.resume=never, but {self.ckpt.root} holds checkpoints of an earlier run; use "
                                     f"a new train.output_dir (or delete them, or resume with train.resume=auto)")
                if path is not None:
                    state = self.ckpt.read_state(path)
                    changes = check_resume(self.recipe, state, path)
                    if changes:
                        log.warning("resuming %s with a changed recipe (train.allow_recipe_change=true): %s",
                                    path, "; ".join(changes))
                decision = ("ok", str(path) if path is not None else None)
            except ValueError as e:
                decision = ("error", type(e).__name__, str(e))
            except OSError as e:
                decision = ("error", "ValueError", f"run folder {self.run_dir}: {e}")
        decision = self.env.broadcast_object(decision)
        if decision[0] == "error":
            errors = {c.__name__: c for c in (CheckpointError, RecipeChanged, RunFolderBusy)}
            raise errors.get(decision[1], ValueError)(decision[2])
        return Path(decision[1]) if decision[1] is not None else None

    def _resume(self) -> None:
        path = self._resume_from
        if path is None:
            if self.env.is_main:
                self.logger.truncate_after(0)
            return
        state = self.ckpt.load(path, self.model, self.optimizer, self._ref_module(), self.companions.checkpoint_items())
        self.scheduler.load_state_dict(state["scheduler"])
        if self.companions:
            self.companions.load_scheduler_states(state.get("companion_schedulers", {}))
        if self.algo.curates_prompts:
            self.source.load_state_dict(state.get("prompt_pool", {}))
        self.start_step, self.bad_steps = int(state["step"]), int(state.get("bad_steps", 0))
        self.logger.truncate_after(self.start_step)
        log.info("resumed from %s at step %d", path, self.start_step)

    def close(self) -> None:
        """Release the run folder (the end of ``run`` does it; a process that dies releases it too)."""
        self.lock.release()

    # --- one step -----------------------------------------------------------------------------------------
    def step_context(self, step: int) -> StepContext:
        services = (self.rollout.services(self.tokenizer) if self.rollout is not None else
                    Services(tokenizer=self.tokenizer, device=self.env.device, all_reduce_sums=self.env.all_reduce_sums))
        return StepContext(step=step, seed=self.recipe.train.seed, adapter=self.model.adapter, rank=self.env.dp_rank,
                           world_size=self.env.dp_size, chunk_size=self.recipe.train.chunk_size,
                           want_entropy=self.algo.uses_rollout, services=services,
                           companions=self.companions.modules())

    def curate_prompts(self, ctx: StepContext) -> dict:
        """Ask the algorithm which training prompts to use (MDPO's ICFW); every rank tests a share of them."""
        from ..collectives import gathered_for_inference
        source = self.source
        share = list(range(self.env.rank, len(source.prompted), self.env.world_size))
        with self._autocast(), gathered_for_inference(self.model):  # decoding: no collectives inside
            kept = self.algo.select_prompts(ctx, self.model, [source.prompted[i] for i in share], share)
        chosen = torch.zeros(len(source.prompted), device=self.env.device)
        chosen[[share[i] for i in kept]] = 1.0
        if self.env.distributed:
            import torch.distributed as dist
            dist.all_reduce(chosen)
        pool = chosen.nonzero().flatten().tolist()
        if not pool:
            log.warning("step %d: the algorithm selected no training prompt; training on all %d until the next "
                        "selection", ctx.step + 1, len(source.prompted))
        source.set_pool(pool, ctx.step)
        return {"curated_prompts": float(len(pool))}

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        micro = self.recipe.train.micro_batch_size
        ctx = self.step_context(step)
        metrics: dict[str, float] = {}
        if self.algo.curates_prompts and self.source.curation_due(step):
            metrics.update(self.curate_prompts(ctx))
        batch = self.source.batch(step).to(self.env.device)
        if self.rollout is not None:  # (1) rollout, (2) reward
            with self.phase("rollout"), self._autocast():
                batch, rollout_metrics = self.algo.collect(ctx, batch, self.model)
            metrics.update(rollout_metrics)
        t_prepare = time.perf_counter()
        with self.phase("score"), self._autocast(), sharding_sequences(self.env.sequence_group()):
            stages.prepare(self.algo, ctx, batch, self.model, self.reference, micro)  # (3)
        metrics["prepare_time"] = time.perf_counter() - t_prepare  # corruption + old / reference / companion scoring
        batch.advantages = self.algo.advantages(ctx, batch)  # (4)
        ctx.norms = self.env.all_reduce_sums(self.algo.normalizers(batch))
        sums: dict[str, float] = defaultdict(float)
        n_it = self.algo.inner_iterations
        t_update = time.perf_counter()

        def grad_sync(flag: bool) -> None:  # FSDP: reduce gradients on the last micro-batch only
            set_grad_sync(self.model, flag)
            self.companions.set_grad_sync(flag)

        for it in range(n_it):  # (5)
            with self.phase("update"):
                # Losses are scaled by the data-parallel size: FSDP averages gradients over every rank, which turns
                # that into the sum the additive losses need (sequence_parallel.py: a group counts once).
                with self._autocast(), sharding_sequences(self.env.sequence_group()):
                    m = stages.update(self.algo, ctx, self.model, batch, it, micro, float(self.env.dp_size),
                                      grad_sync if self.fsdp and self.recipe.distributed.grad_sync == "last" else None)
                m = self.env.all_reduce_sums(m)
                grad_norm, applied = self._optimizer_step(step, m.get("loss", float("nan")), m)
            m["grad_norm"] = grad_norm
            for k, v in m.items():
                sums[k] += v / n_it
            if not applied:
                metrics["skipped"] = 1.0
                break
        metrics.update(sums)
        metrics["update_time"] = time.perf_counter() - t_update  # forward + backward + optimizer, every inner iteration
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        metrics["step_time"] = time.perf_counter() - t0
        sync_every, alpha = self.algo.reference_sync
        if sync_every and (step + 1) % sync_every == 0 and self.reference is not None:
            self.reference.sync(self.model, alpha)
        return metrics

    def _optimizer_step(self, step: int, loss: float, metrics: dict) -> tuple[float, bool]:
        grad_norm = grad_norm_and_clip(self.model.parameters(), self.recipe.optim.grad_clip)
        companion_norms = self.companions.clip(self.recipe.optim.grad_clip)
        metrics.update({f"{name}_grad_norm": v for name, v in companion_norms.items()})
        if math.isfinite(loss) and math.isfinite(grad_norm) and all(math.isfinite(v) for v in companion_norms.values()):
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.companions.step()
            return grad_norm, True
        self.optimizer.zero_grad(set_to_none=True)
        self.companions.zero_grad()
        self.bad_steps += 1
        limit = self.recipe.train.max_bad_steps
        what = ("loss" if not math.isfinite(loss) else "gradient norm" if not math.isfinite(grad_norm)
                else "companion gradient norm")
        log.warning("step %d: non-finite %s (loss %s, grad norm %s); update skipped (%d of at most %d)",
                    step + 1, what, loss, grad_norm, self.bad_steps, limit)
        if self.bad_steps > limit:
            intact = self.ckpt.latest_intact()
            raise TrainingError(f"aborting at step {step + 1}: {self.bad_steps} non-finite losses/gradients "
                                f"(train.max_bad_steps={limit}). Lower optim.lr, enable optim.grad_clip, or use a "
                                f"higher-precision model.dtype; "
                                + (f"the last intact checkpoint is {intact}" if intact is not None else
                                   "no checkpoint was written before it"))
        return grad_norm, False

    # --- checkpoints, eval ----------------------------------------------------------------------------------
    def _params_finite(self) -> bool:
        ok = True
        for p in self.model.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if not bool(torch.isfinite(t).all()):
                ok = False
                break
        return self.env.all_true(ok and self.companions.params_finite())

    def save_checkpoint(self, steps_done: int) -> Path:
        if not self._params_finite():  # never persist a NaN state
            raise TrainingError(f"step {steps_done}: parameters are not finite; refusing to write a checkpoint")
        state = {"step": steps_done, "scheduler": self.scheduler.state_dict(), "bad_steps": self.bad_steps,
                 "recipe": to_dict(self.recipe), "fingerprint": fingerprint(self.recipe)}
        if self.companions:
            state["companion_schedulers"] = self.companions.scheduler_states()
        if self.algo.curates_prompts:
            state["prompt_pool"] = self.source.state_dict()
        path = self.ckpt.save(steps_done, self.model, self.optimizer, state, self._ref_module(),
                              self.companions.checkpoint_items())
        if self.recipe.logging.plot:
            self.logger.plot()
        return path

    def periodic_eval(self, steps_done: int) -> dict:
        """Evaluate on ``eval.benchmarks`` with ``dare.eval.evaluate``; returns ``eval/<benchmark>`` scores.

        Every rank runs the same evaluation with its parameters gathered once (``gathered_for_inference``: decode
        lengths are data-dependent, so no collective may run inside the decoding loop); rank 0 writes
        ``eval/step-N/`` (per-sample JSONL, results.json, results.md)."""
        from ..eval import RunOptions, evaluate
        from ..collectives import gathered_for_inference
        ec = self.recipe.eval
        opts = RunOptions(limit=ec.limit, batch_size=ec.batch_size, template=ec.template, seed=self.recipe.train.seed,
                          resume=False, progress=False, reward_timeout=self.recipe.reward.timeout,
                          reward_workers=self.recipe.reward.workers)
        out = self.run_dir / "eval" / f"step-{steps_done}" if self.env.is_main else None
        was_training = self.model.training
        self.model.eval()
        try:
            with gathered_for_inference(self.model):  # decode lengths differ across ranks: no collectives inside
                results = evaluate(self.model, self.tokenizer, list(ec.benchmarks), ec.sampler, output_dir=out,
                                   model_name=f"step-{steps_done}", options=opts)
        finally:
            self.model.train(was_training)
        return {f"eval/{name}": float(s["score"]) for name, s in results["benchmarks"].items()}

    # --- run ----------------------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        from tqdm import tqdm

        from .reward_watch import RewardWatch
        tc = self.recipe.train
        history = []
        bar = tqdm(total=tc.steps, initial=self.start_step, desc=f"dare train {self.algo.name}", unit="step",
                   disable=not (self.env.is_main and self.recipe.logging.progress), dynamic_ncols=True)
        group_need = getattr(self.recipe.algorithm, "group_need", None)
        watch = RewardWatch(self.algo.uses_rollout and group_need is not None and group_need()[0] > 1)
        last_saved = self.start_step if self.start_step else None
        done = self.start_step
        quiet = contextlib.ExitStack()
        if not bar.disable:  # log lines above the bar, not glued onto it
            from tqdm.contrib.logging import logging_redirect_tqdm
            quiet.enter_context(logging_redirect_tqdm())
        try:
            for step in range(self.start_step, tc.steps):
                metrics = self.train_step(step)
                done = step + 1
                if tc.eval_every and done % tc.eval_every == 0:
                    metrics.update(self.periodic_eval(done))
                if done % tc.log_every == 0 or done == tc.steps:
                    self.logger.log(done, metrics)
                history.append({"step": done, **metrics})
                if self.env.is_main:
                    watch.step(done, metrics)
                bar.update(1)
                shown = {"loss": f"{metrics.get('loss', float('nan')):.4f}"}
                if "reward_mean" in metrics:  # RL: a GRPO-type loss sits near 0; the reward is what moves
                    shown["reward"] = f"{metrics['reward_mean']:.3f}"
                bar.set_postfix(shown)
                if tc.save_every and done % tc.save_every == 0:
                    self.save_checkpoint(done)
                    last_saved = done
            if last_saved != tc.steps:
                self.save_checkpoint(tc.steps)
            if tc.export:
                from ..models.decoding import recipe_decoding
                export_pretrained(self.model, self.tokenizer, self.run_dir / "export", self.env, self.recipe.lora,
                                  decoding=recipe_decoding(self.recipe))
            if self.env.is_main:
                watch.finish()
        except KeyboardInterrupt:
            if self.env.is_main:
                latest = self.ckpt.latest_intact()
                log.warning("interrupted after step %d of %d; %s", done, tc.steps,
                            f"the last checkpoint is {latest}: the same command resumes from it (train.resume=auto)"
                            if latest is not None else "no checkpoint was written yet: a new run starts from step 0")
            raise
        finally:
            quiet.close()
            bar.close()
            self.logger.close()
            self.close()
        return history
