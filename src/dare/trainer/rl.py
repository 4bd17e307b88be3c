"""Stages (1) rollout and (2) reward of the RL loop, and the prompt source they start from.

Each data-parallel rank takes whole prompts of the step's global batch (round-robin) and generates all
``group_size`` completions of each itself, so group statistics (advantages, the zero-variance filter) never cross
ranks (the ranks of a sequence-parallel group share their prompts: each decodes a contiguous share and the group
exchanges the rollouts). Every random draw is
keyed: prompt j of step s is sampled with seed ``hash(run seed, "rollout", s, j)`` (the rollout engine derives the
per-completion generators from it), so a sample's random draws do not depend on the rank or batch it lands in
(its float rounding does: docs/samplers.md), and a resumed run
regenerates exactly the rollouts it would have. Rewards come from ``dare.rewards.score_batch`` on the decoded
completions (each example's task default unless ``reward.name`` / ``reward.terms`` is set); every sample's example
carries ``"rollout"`` (its token and distinct-step counts, for DiRL's speed rewards).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from ..algorithms.base import Services, StepContext
from ..algorithms.batch import Batch, RLBatch
from ..diffusion.noise import STREAM_ROLLOUT, derive_seed
from ..rewards.speed import rollout_info
from .data import EpochSampler

log = logging.getLogger(__name__)


class PromptSource:
    """Per-step prompts of this rank (a ``Batch`` of prompt token lists and their examples).

    An algorithm that curates its data (``Algorithm.curates_prompts``: MDPO's ICFW) restricts the prompts to a
    *pool* (``set_pool``) chosen at step ``curated_at``; the pool is walked by its own seeded epoch sampler and is
    re-chosen after one pass over it (``curation_due``). The pool is part of the checkpoint (``state_dict``)."""

    def __init__(self, prompted: list, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        if batch_size % world:
            raise ValueError(f"train.batch_size={batch_size} prompts must be divisible by the {world} data-parallel "
                             f"ranks (distributed.nproc x nnodes / sequence_parallel; each generates whole groups)")
        self.prompted, self.rank, self.world, self.batch_size, self.seed = prompted, rank, world, batch_size, seed
        self.sampler = EpochSampler(len(prompted), batch_size, seed)
        self.pool: Optional[list[int]] = None  # None: every prompt
        self.curated_at: Optional[int] = None
        self._pool_sampler = None

    # --- curated pools --------------------------------------------------------------------------------------
    def curation_due(self, step: int) -> bool:
        """Never curated yet, or one pass over the current pool (the whole data when the last pool was empty) done."""
        if self.curated_at is None:
            return True
        size = len(self.pool) if self.pool is not None else len(self.prompted)
        return step >= self.curated_at + -(-size // self.batch_size)

    def set_pool(self, indices: Optional[list[int]], step: int) -> None:
        """Train on ``indices`` of the prompts from ``step`` on (None or empty: every prompt)."""
        self.pool = sorted(int(i) for i in indices) if indices else None
        self.curated_at = int(step)
        self._pool_sampler = (EpochSampler(len(self.pool), self.batch_size, derive_seed(self.seed, "pool", step))
                              if self.pool else None)

    def state_dict(self) -> dict:
        return {"pool": self.pool, "curated_at": self.curated_at}

    def load_state_dict(self, state: dict) -> None:
        if state.get("curated_at") is not None:
            self.set_pool(state.get("pool"), state["curated_at"])

    @classmethod
    def from_recipe(cls, recipe, tokenizer, env, budget=None) -> "PromptSource":
        """``budget`` (``dare.data.prompts.PromptBudget``): prompts too long for the model follow ``on_bad_row``."""
        from ..data import build_prompts, load_examples
        ds = recipe.data.dataset
        if ds is None:
            raise ValueError("RL needs data.dataset: a dare.data source of prompts (name/path/hf, template, ...)")
        prompted = build_prompts(load_examples(ds), tokenizer, ds, budget)
        if not prompted:
            raise ValueError(f"data.dataset {ds.describe()}: no usable prompts")
        return cls(prompted, recipe.train.batch_size, recipe.train.seed, env.dp_rank, env.dp_size)

    def batch(self, step: int) -> Batch:
        if self._pool_sampler is not None:
            idx = [self.pool[i] for i in self._pool_sampler.indices(step - self.curated_at)]
        else:
            idx = self.sampler.indices(step)
        mine = list(range(self.rank, len(idx), self.world))  # positions in the step's global prompt list
        items = [self.prompted[idx[j]] for j in mine]
        return Batch(uid=torch.tensor(mine, dtype=torch.long), prompt_tokens=[p.input_ids for p in items],
                     examples=[p.example for p in items])


def rollout_share(prompts: int, sp) -> tuple[int, int]:
    """The prompts ``[start, stop)`` this rank decodes of its group's ``prompts`` (all of them without sequence
    parallelism). The first ranks take one more when N does not divide them (rank 0, which ``dare plan`` plans, is
    the busiest)."""
    if sp is None:
        return 0, prompts
    q, extra = divmod(prompts, sp.size)
    start = sp.rank * q + min(sp.rank, extra)
    return start, start + q + (sp.rank < extra)


def _moved(value, device):
    """A rollout (or its trajectory) with every tensor field on ``device``."""
    import dataclasses
    changes = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = v.to(device)
        elif dataclasses.is_dataclass(v):
            changes[f.name] = _moved(v, device)
    return dataclasses.replace(value, **changes)


def _gathered_in_group(parts: list, sp, device) -> list:
    """Every rank's rollouts of the sequence-parallel group, in rank order (the group's prompts in order). They
    travel pickled on the CPU: a pickled CUDA tensor would come back on the sender's device."""
    import torch.distributed as dist
    everyone = [None] * sp.size
    dist.all_gather_object(everyone, [_moved(r, "cpu") for r in parts], group=sp.group)
    return [_moved(r, device) for rank_parts in everyone for r in rank_parts]


def _pad_left(t: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)


def _pad_steps(t: torch.Tensor, steps: int) -> torch.Tensor:
    """A trajectory field ``[N, S(, G)]`` padded to ``steps`` along S (``[N]`` fields pass unchanged)."""
    if t.dim() == 1:
        return t
    pad = (0, 0, 0, steps - t.shape[1]) if t.dim() == 3 else (0, steps - t.shape[1])
    return torch.nn.functional.pad(t, pad)


# Rollout fields that every chunk of one step shares (checked equal, kept once). ``_merge`` re-pads or sums a few
# fields itself; every other field must be a per-row tensor (or None in every chunk): a field of another kind is an
# error there, never chunk 0's value.
_SHARED_FIELDS = ("stop_token_ids", "paused_at")


def _merge(parts: list, pad_id: int):
    """Concatenate rollouts of several generate() calls (prompts re-padded to a common width). Generic over the
    fields of ``Rollout``: per-row tensors are concatenated, so a field added to it is merged without a change here."""
    if len(parts) == 1:
        return parts[0]
    import dataclasses
    P = max(r.prompt_length for r in parts)
    merged = {
        "sequences": torch.cat([torch.cat([_pad_left(r.prompt_ids, P, pad_id), r.completion_ids], 1) for r in parts]),
        "attention_mask": torch.cat([torch.cat([_pad_left(r.prompt_mask, P, 0), r.attention_mask[:, r.prompt_length:]],
                                               1) for r in parts]),
        "prompt_length": P,
        "nfe": sum(r.nfe for r in parts),
        "seeds": sum((r.seeds or [] for r in parts), []) or None,
    }
    offsets, off = [], 0
    for r in parts:
        offsets.append(off)
        off += int(r.prompt_index.max()) + 1
    merged["prompt_index"] = torch.cat([r.prompt_index + o for r, o in zip(parts, offsets)])
    merged["trajectory"] = None
    if parts[0].trajectory is not None:
        S = max(r.trajectory.states.shape[1] for r in parts)
        merged["trajectory"] = type(parts[0].trajectory)(**{
            f.name: torch.cat([_pad_steps(getattr(r.trajectory, f.name), S) for r in parts])
            for f in dataclasses.fields(parts[0].trajectory)})
    for f in dataclasses.fields(parts[0]):
        if f.name in merged:
            continue
        values = [getattr(r, f.name) for r in parts]
        if f.name in _SHARED_FIELDS:
            if any(v != values[0] for v in values[1:]):
                raise ValueError(f"rollout chunks disagree on {f.name}: {values}")
            merged[f.name] = values[0]
        elif all(v is None for v in values):
            merged[f.name] = None
        elif all(isinstance(v, torch.Tensor) for v in values):
            merged[f.name] = torch.cat(values)
        else:
            raise TypeError(f"cannot merge Rollout.{f.name} across rollout chunks: give it a rule in trainer/rl.py")
    return dataclasses.replace(parts[0], **merged)


class RolloutStage:
    def __init__(self, recipe, tokenizer, env):
        self.recipe, self.tokenizer, self.env = recipe, tokenizer, env
        self.group = recipe.rollout.group_size
        self.run_unit = None  # ``Services.run_unit`` (the planner sets its replay's)
        if self.group < 1:
            raise ValueError(f"rollout.group_size must be >= 1, got {self.group}")

    def score(self, completions: list[str], examples: list[dict]) -> torch.Tensor:
        from ..rewards import score_batch
        rc = self.recipe.reward
        results = score_batch(rc.spec, completions, examples, timeout=rc.timeout, workers=rc.workers)
        if results and all(r.reason is not None and "error:" in r.reason for r in results):
            # A reward that cannot score any completion (e.g. reward.name=math on sudoku rows) would train on zeros.
            raise ValueError(f"reward {rc.spec!r} failed on all {len(results)} completions of this step, e.g. "
                             f"{results[0].reason}; check reward.name / reward.terms against the data's task")
        return torch.tensor([r.score for r in results], dtype=torch.float32)

    def score_ids(self, completion_ids: torch.Tensor, examples: list[dict], stop_token_ids) -> torch.Tensor:
        """Reward of completions given as token ids ``[N, G]`` (cut at their first stop token)."""
        from ..rollout import decode_completions
        stops = torch.tensor(list(stop_token_ids), device=completion_ids.device)
        stop = torch.isin(completion_ids, stops)
        G = completion_ids.shape[1]
        first = torch.where(stop.any(1), stop.float().argmax(1), torch.full((completion_ids.shape[0],), G, device=stop.device))
        mask = torch.arange(G, device=stop.device)[None] <= first[:, None]
        texts = decode_completions(self.tokenizer, completion_ids.cpu(), mask.cpu(), stop_token_ids)
        return self.score(texts, examples).to(completion_ids.device)

    def prompt_seeds(self, ctx: StepContext, prompts: Batch) -> list[int]:
        """The rollout seed of every prompt of the step (keyed by run seed, step and the prompt's uid)."""
        return [derive_seed(ctx.seed, STREAM_ROLLOUT, ctx.step, u) for u in prompts["uid"].tolist()]

    def metrics(self, rewards: torch.Tensor, completion_mask: torch.Tensor, nfe: int, rollout_time: float,
                reward_time: float) -> dict:
        """Rollout metrics of the step (reward mean / std and completion length over every rank)."""
        n = float(rewards.numel())
        sums = self.env.all_reduce_sums({"reward_sum": float(rewards.sum()), "reward_sq": float((rewards ** 2).sum()),
                                         "n": n, "len_sum": float(completion_mask.float().sum())})
        mean = sums["reward_sum"] / max(sums["n"], 1.0)
        return {"reward_mean": mean, "reward_std": max(sums["reward_sq"] / max(sums["n"], 1.0) - mean ** 2, 0.0) ** 0.5,
                "completion_len": sums["len_sum"] / max(sums["n"], 1.0), "rollout_time": rollout_time,
                "reward_time": reward_time, "nfe": float(nfe)}

    def score_completion_ids(self, batch: RLBatch, completion_ids: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
        """Reward of arbitrary completions of the batch's samples (e.g. MDPO's intermediate predictions)."""
        examples = [batch.examples[int(i)] for i in sample_index.tolist()]
        return self.score_ids(completion_ids, examples, batch.stop_token_ids)

    def services(self, tokenizer=None) -> Services:
        """Everything RL hooks may ask of the trainer (``ctx.services``: ``dare.algorithms.Services``), from this
        stage's own methods, so a subclass (the planner's ``SimulatedRollout``) serves the hooks its own decoding."""
        from ..collectives import gathered_for_inference
        return Services(tokenizer=tokenizer, rollout_sampler=self.recipe.rollout.sampler, group_size=self.group,
                        rollout_micro_batch_size=self.recipe.rollout.micro_batch_size,
                        dataset=self.recipe.data.dataset, device=self.env.device, collect=self.collect,
                        decode=self.decode, decode_tree=self.decode_tree, generate=self.generate,
                        gathered=gathered_for_inference, prompt_seeds=self.prompt_seeds, score_texts=self.score,
                        score_ids=self.score_ids, score_completions=self.score_completion_ids,
                        rollout_metrics=self.metrics, all_reduce_sums=self.env.all_reduce_sums,
                        run_unit=self.run_unit)

    def generate(self, model, prompt_tokens, sampler, n: int, seeds: list[int], attention_mask=None, record=None):
        """One decode of ``prompt_tokens`` on this rank alone (``dare.rollout.generate``); the caller holds the
        weights gathered (``Services.gathered``)."""
        from ..rollout import generate
        return generate(model, prompt_tokens, sampler, n=n, seeds=seeds, attention_mask=attention_mask, record=record)

    def decode(self, prompts: Batch, seeds: list[int], model, sampler, hints: Optional[torch.Tensor] = None,
               record=None):
        """(1) ``group_size`` completions of every prompt, ``rollout.micro_batch_size`` prompts per ``generate``.

        The ranks of a sequence-parallel group share their prompts: each decodes a contiguous 1/N of them and the
        group exchanges the rollouts, so every rank holds the whole batch (decoding is not sequence-parallel, and
        would otherwise be repeated N times). ``hints [prompts x group_size, gen_length]``: inpainting hints of every
        sample (``dare.rollout.generate``); ``record`` what the rollout records (``dare.rollout.Record``). With no
        prompts it still joins the collectives (FSDP's weight gathering) and returns None, so a rank with nothing to
        decode never leaves the others waiting."""
        from ..rollout import generate
        from ..collectives import gathered_for_inference
        sp = self.env.sequence_group()
        start, stop = rollout_share(len(seeds), sp)
        chunk = self.recipe.rollout.micro_batch_size or max(stop - start, 1)
        G = self.group

        def rows(s):
            return None if hints is None else hints[s * G:min(s + chunk, stop) * G]
        with gathered_for_inference(model):  # ranks decode different numbers of steps: no collectives inside
            parts = [generate(model, prompts["prompt_tokens"][s:min(s + chunk, stop)], sampler, n=G,
                              seeds=seeds[s:min(s + chunk, stop)], hints=rows(s), record=record)
                     for s in range(start, stop, chunk)]
        if sp is not None:
            parts = _gathered_in_group(parts, sp, self.env.device)
        if not parts:
            return None
        return _merge(parts, model.adapter.pad_token_id if model.adapter.pad_token_id is not None else model.adapter.eos_token_id)

    def decode_tree(self, prompt_tokens, seeds: list[int], model, sampler, branching, cut_steps):
        """A tree rollout of ``prompt_tokens`` (``dare.rollout.generate_tree``: d-TreeRPO), weights gathered once.
        A stage hook like ``decode``, so a planned step (``dare.plan``) can put its widest forwards in its place."""
        from ..rollout import generate_tree
        from ..collectives import gathered_for_inference
        with gathered_for_inference(model):
            return generate_tree(model, prompt_tokens, sampler, branching, cut_steps, seeds=seeds)

    def collect(self, ctx: StepContext, prompts: Batch, model, sampler=None, record=None) -> tuple[RLBatch, dict]:
        """(1) generate ``group_size`` completions per prompt (with ``sampler``, default the recipe's, recording
        ``record``), (2) score them; returns the RL batch."""
        sampler = sampler or self.recipe.rollout.sampler
        t0 = time.perf_counter()
        ro = self.decode(prompts, self.prompt_seeds(ctx, prompts), model, sampler, record=record)
        t1 = time.perf_counter()
        prompt_of = ro.prompt_index.cpu()
        # Each sample's own copy of its example, with the rollout's numbers for rewards that read them (DiRL's speed).
        info = rollout_info(ro.completion_mask, ro.step_map, sampler.block_length)
        examples = [{**prompts["examples"][int(i)], "rollout": inf} for i, inf in zip(prompt_of, info)]
        texts = ro.texts(self.tokenizer)
        rewards = self.score(texts, examples)
        t2 = time.perf_counter()
        dev = ro.completion_ids.device
        group = prompts["uid"].cpu()[prompt_of]
        sample = ro.sample_index.cpu() if ro.sample_index is not None else torch.arange(len(prompt_of)) % self.group
        batch = RLBatch.from_rollout(ro, uid=(group * self.group + sample).long(), group=group,
                                     rewards=rewards.to(dev), examples=examples, completions=texts)
        return batch, self.metrics(rewards, ro.completion_mask, ro.nfe, t1 - t0, t2 - t1)
