"""Stand-ins for the data and the rollout of a planned step, fed through the trainer's own data sources.

Shapes are the largest a recipe allows (every SFT row full, every completion ``gen_length`` long), token values
are arbitrary non-special ids, rewards alternate within a group so no group is filtered for zero variance."""
from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import torch

from ..trainer.rl import RolloutStage, rollout_share
from .simulate import real_data


def _tokens(n: int, vocab: int, avoid: set, offset: int) -> list[int]:
    """``n`` ordinary token ids (never a mask, pad or stop id)."""
    lo, hi = 16, max(32, min(vocab, min([v for v in avoid if v is not None and v > 32] or [vocab])))
    span = hi - lo
    return [lo + (offset * 7919 + 31 * i) % span for i in range(n)]


def schedule(sampler, adapter) -> tuple[int, int]:
    """(blocks, denoising steps per block) of the sampler's schedule for this model (the canvas sampler: one
    block of ``steps`` passes)."""
    if adapter.is_encoder_decoder:
        return 1, max(1, sampler.steps or 1)
    if adapter.is_block_causal:
        from ..rollout.block import block_schedule
        return sampler.gen_length // sampler.block_length, int(block_schedule(sampler).numel())
    from ..rollout.masked import masked_steps
    return masked_steps(sampler)


def special_ids(adapter) -> set:
    return {adapter.mask_token_id, adapter.pad_token_id, adapter.eos_token_id}


class PlanTokenizer:
    """What the loop asks of a tokenizer in a planned step (no vocabulary is needed: texts are never scored)."""

    def __init__(self, adapter, vocab_size: int):
        self.eos_token_id = adapter.eos_token_id if adapter.eos_token_id is not None else adapter.pad_token_id
        self.pad_token_id = adapter.pad_token_id if adapter.pad_token_id is not None else self.eos_token_id
        self.mask_token_id = adapter.mask_token_id
        self._n = vocab_size

    def __len__(self) -> int:
        return self._n

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def _row_parts(recipe, prompt_length: int) -> tuple[int, int]:
    """(prompt, answer) tokens of a full ``data.max_length`` row."""
    P = min(prompt_length, recipe.data.max_length - 1)
    return P, recipe.data.max_length - P


def sft_docs(recipe, adapter, vocab: int, prompt_length: int) -> list:
    """``train.batch_size`` documents of ``data.max_length`` tokens each (every packed row full)."""
    from ..trainer.data import SFTDoc
    P, A = _row_parts(recipe, prompt_length)
    avoid = special_ids(adapter)
    return [SFTDoc(i, _tokens(P, vocab, avoid, i), _tokens(A, vocab, avoid, i + 1)) for i in range(recipe.train.batch_size)]


def preference_pairs(recipe, adapter, vocab: int, prompt_length: int) -> list:
    """``train.batch_size`` pairs whose chosen and rejected rows are each ``data.max_length`` tokens."""
    from ..trainer.data import PreferencePair
    P, A = _row_parts(recipe, prompt_length)
    avoid = special_ids(adapter)
    return [PreferencePair(i, _tokens(P, vocab, avoid, i), _tokens(A, vocab, avoid, i + 1), _tokens(A, vocab, avoid, i + 2))
            for i in range(recipe.train.batch_size)]


def prompts(recipe, adapter, vocab: int, prompt_length: int) -> list:
    avoid = special_ids(adapter)
    return [SimpleNamespace(input_ids=_tokens(prompt_length, vocab, avoid, i), example={}, text="")
            for i in range(recipe.train.batch_size)]


def _with_steps_per_block(sampler, adapter):
    """A probe sampler of the same shapes with 3 (or 2) steps in the first block, the probed step counts, and the
    share of a later step's FLOPs the real sampler runs: a block of one token (JustGRPO's left-to-right decoding of a
    block model) is probed as the smallest block of 3+ tokens that divides the answer, whose cached steps run that
    many queries (their FLOPs are scaled back by block_length / probed block; the first step is the prompt's)."""
    for spb, steps in ((3, (1, 2)), (2, (1,))):
        candidate = dataclasses.replace(sampler, steps=None, steps_per_block=spb)
        try:
            schedule(candidate, adapter)
            return candidate, steps, 1.0
        except ValueError:  # more steps than the block has tokens
            continue
    if adapter.is_block_causal:
        for width in range(3, 9):
            if sampler.gen_length % width == 0:
                wide = dataclasses.replace(sampler, block_length=width, steps=None, steps_per_block=3)
                return wide, (1, 2), sampler.block_length / width
    raise ValueError(f"dare plan cannot probe a rollout with block_length={sampler.block_length} and one step per block")


def _level(full, rows: torch.Tensor, per_prompt: int, cut, steps_per_block: int, mask_id: int):
    """Level of a simulated tree: rows ``rows`` (``per_prompt`` of each prompt) of the finished rollout ``full``,
    with the tokens written at schedule step ``cut`` or later masked again (``cut`` None: the leaves, finished)."""
    level = dataclasses.replace(full.rows(rows), sample_index=torch.arange(len(rows)) % per_prompt)
    if cut is None:
        return level
    later = level.step_map >= cut
    comp = level.completion_ids.masked_fill(later, mask_id)
    P = level.prompt_length
    return dataclasses.replace(level, completion_ids=comp, sequences=torch.cat([level.sequences[:, :P], comp], 1),
                               step_map=level.step_map.masked_fill(later, -1),
                               finished=torch.zeros(len(rows), dtype=torch.bool),
                               paused_at=divmod(cut, steps_per_block))  # (block, step in block), as generate's


class SimulatedRollout(RolloutStage):
    """The recipe's rollout stage with the decoding loop replaced by its largest forwards.

    A decoding loop's length depends on the model's outputs, which a planned (fake) model does not have, so the
    stage runs the sampler's own code for its first ``probe_steps`` denoising steps (``generate(until_step=...)``:
    the step that holds the most memory is the first one of a decode for every sampler with a cache — the
    prefix / dual cache's full refresh, the exact block cache's prompt-storing step — and every uncached step of
    a masked model has the same shape) on one ``rollout.micro_batch_size`` chunk, then hands the loop completions
    of full length for its first ``kept_prompts`` prompts (the planner scales the FLOPs of the rest).
    ``on_probe(steps)`` wraps each probed ``generate`` for the planner."""

    def __init__(self, recipe, tokenizer, env, vocab: int, on_probe, kept_prompts: int):
        super().__init__(recipe, tokenizer, env)
        self.vocab, self.on_probe, self.kept = vocab, on_probe, kept_prompts
        self.decode_share = 1.0  # the decode's row-steps over the probed width's (a tree's trunk is shared)
        self.tree_prompts = 0  # prompts a simulated tree rollout has handed out so far
        self.step_share = 1.0  # a later decoding step's FLOPs over the probed one's (a widened one-token block)
        self.handed_rows = 0  # rows of the group rollout handed to the loop (``decode``)
        self.extra_rows = 0  # rows of the other decodes a method asked for (``generate``: pass@k, ICFW)

    def _probe_config(self, sampler):
        # Pausing is refused with per-block state it cannot carry over; none of it changes a forward's shape.
        # The probe records nothing (pausing refuses records too): no recorded plan counted a record's work.
        return dataclasses.replace(sampler, rcr=False, editing_threshold=None)

    def decode(self, prompts, seeds, model, sampler, hints=None, record=None):
        # Inpainting hints (IGPO's second round) fix tokens without changing a forward's shape: planned as plain.
        from ..collectives import gathered_for_inference
        if model.adapter.is_encoder_decoder:
            # The canvas sampler's passes stop adaptively and cannot pause (``steps_per_block``): plan the rest of
            # the step, and say that the decode itself is missing from the rollout's peak and FLOPs.
            from ..models.planning import active
            sim = active()
            if sim is not None:
                sim.assume("rollout: the canvas sampler cannot pause, so its decoding forwards are not planned "
                           "(the rollout phase is the gathered weights only: a lower bound)")
            with gathered_for_inference(model), real_data():
                return self._completed(prompts, model, sampler, record=record)
        start, stop = rollout_share(len(seeds), self.env.sequence_group())  # a sequence-parallel group splits them
        self._probe(prompts["prompt_tokens"][start:stop], seeds[start:stop], model, sampler, self.group)
        with real_data():
            out = self._completed(prompts, model, sampler, record=record)
        self.handed_rows += out.completion_ids.shape[0]
        return out

    def generate(self, model, prompt_tokens, sampler, n: int, seeds: list[int], attention_mask=None, record=None):
        """Another decode a method asks for (``Services.generate``: d-OPSD's pass@k retries, MDPO's ICFW curation):
        its first steps run at the requested width for the peak (not recorded as the rollout's probe), its rows are
        counted as extra rows of the step's decode (``extra_rows``: the planner adds their share of the rollout's
        FLOPs), and every row gets a full-length completion, as ``decode``'s."""
        if torch.is_tensor(prompt_tokens):  # left-padded ids + mask (a batch's prompts)
            mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(prompt_tokens, dtype=torch.bool)
            with real_data():
                prompt_tokens = [row[m].tolist() for row, m in zip(prompt_tokens, mask)]
        rows = list(prompt_tokens)
        if rows and not model.adapter.is_encoder_decoder:
            self._probe(rows, list(seeds), model, sampler, n, counted=False)
        self.extra_rows += len(rows) * n
        with real_data():
            return self._completed({"prompt_tokens": rows}, model, sampler, len(rows), n, record=record)

    def _probe(self, prompt_tokens, seeds, model, sampler, width: int, counted: bool = True):
        """The decode's first steps on one ``rollout.micro_batch_size`` chunk, ``width`` rows per prompt (``counted``:
        as the rollout's probe, whose FLOPs the planner scales to the whole decode)."""
        from ..collectives import gathered_for_inference
        from ..rollout import generate
        chunk = min(self.recipe.rollout.micro_batch_size or len(seeds), len(seeds))
        probe = self._probe_config(sampler)
        steps = (1, 2)
        if schedule(probe, model.adapter)[1] < 3:
            # The probe pauses inside the first block (its commits are lost on fake logits, so no block finishes):
            # with fewer than 3 scheduled steps per block, schedule 3 (or 2) of the same shapes for the probe.
            probe, steps, self.step_share = _with_steps_per_block(probe, model.adapter)
        with gathered_for_inference(model):
            for n_steps in steps:
                with self.on_probe(n_steps) if counted else contextlib.nullcontext():
                    generate(model, prompt_tokens[:chunk], probe, n=width, seeds=seeds[:chunk], until_step=n_steps)

    def decode_tree(self, prompt_tokens, seeds, model, sampler, branching, cut_steps):
        """d-TreeRPO's tree: a tree's levels pause and resume the sampler (its commits are lost on fake logits, so no
        block would finish): probe its widest level, the leaves (their first step refreshes every leaf's cache),
        once, and hand the loop trees of full-length completions for the kept prompts (None once they are out).
        Its decoding FLOPs are the leaves' decode scaled by the row-steps the tree runs (``decode_share``)."""
        import math
        from ..rollout.tree import TreeRollout
        leaves = math.prod(branching)
        blocks, spb = schedule(sampler, model.adapter)
        if self.tree_prompts == 0:
            from ..models.planning import active
            sim = active()
            if sim is not None:
                sim.assume("rollout: a tree's levels are planned as the leaves' decode from its first step (every "
                           "position masked; the leaves resume at a cut with fewer: an upper bound)")
            self._probe(prompt_tokens, seeds, model, sampler, leaves)
            bounds = [0, *cut_steps, blocks * spb]
            rows = [math.prod(branching[:k + 1]) for k in range(len(branching))]
            self.decode_share = sum(r * (b - a) for r, a, b in zip(rows, bounds, bounds[1:])) / (leaves * bounds[-1])
        take = min(len(prompt_tokens), self.kept - self.tree_prompts)
        if take <= 0:
            return None
        self.tree_prompts += take
        with real_data():
            full = self._completed({"prompt_tokens": prompt_tokens}, model, sampler, take, leaves)
            comp = full.completion_ids
            for k, cut in enumerate(cut_steps):  # a leaf's tokens before cut k are those of its level-k ancestor
                per_leaf = math.prod(branching[k + 1:])
                first = torch.arange(len(comp)) // per_leaf * per_leaf  # the first leaf under the same ancestor
                comp = torch.where(full.step_map < cut, comp[first], comp)
            full = dataclasses.replace(full, completion_ids=comp,
                                       sequences=torch.cat([full.sequences[:, :full.prompt_length], comp], 1))
            levels, parents = [], []
            for k in range(len(branching)):
                per_prompt, per_leaf = math.prod(branching[:k + 1]), math.prod(branching[k + 1:])
                level = _level(full, torch.arange(take * per_prompt) * per_leaf, per_prompt,
                               cut_steps[k] if k < len(cut_steps) else None, spb, model.adapter.mask_token_id)
                levels.append(level)
                parents.append(level.prompt_index if k == 0 else torch.arange(take * per_prompt) // branching[k])
            return TreeRollout(levels, parents, list(cut_steps), list(branching))

    def _completed(self, prompts, model, sampler, kept=None, group=None, record=None):
        """A finished rollout of the kept prompts: every completion ``gen_length`` ordinary tokens, with the records
        ``record`` asks for."""
        from ..rollout.result import Rollout
        kept, group = kept or self.kept, group or self.group
        ids = torch.tensor(prompts["prompt_tokens"][:kept], dtype=torch.long).repeat_interleave(group, 0)
        N, P, G = ids.shape[0], ids.shape[1], sampler.gen_length
        avoid = special_ids(model.adapter)
        comp = torch.tensor([_tokens(G, self.vocab, avoid, 1000 + r) for r in range(N)], dtype=torch.long)
        stop = model.adapter.eos_token_id if model.adapter.eos_token_id is not None else model.adapter.pad_token_id
        blocks, spb = schedule(sampler, model.adapter)
        steps_total = blocks * spb
        trajectory = self._trajectory(comp, steps_total, model) if record is not None and record.trajectory else None
        # Distinct entropies per position, so an entropy-ranked step selection (EGSPO) picks as many steps as real.
        entropy = torch.linspace(2.0, 0.1, G).repeat(N, 1) if record is not None and record.entropy else None
        return Rollout(sequences=torch.cat([ids, comp], 1), attention_mask=torch.ones(N, P + G, dtype=torch.long),
                       prompt_length=P, completion_ids=comp, completion_mask=torch.ones(N, G, dtype=torch.long),
                       step_map=(torch.arange(G) * steps_total // G).repeat(N, 1), nfe=steps_total,
                       prompt_index=torch.arange(N) // group, trajectory=trajectory, entropy_map=entropy,
                       sample_index=torch.arange(N) % group, num_steps=torch.full((N,), steps_total),
                       seeds=None, stop_token_ids=(stop,))

    @staticmethod
    def _trajectory(comp, S: int, model):
        from ..rollout.result import Trajectory
        N, G = comp.shape
        revealed = (torch.arange(G)[None, :] < (torch.arange(S)[:, None] * G // S))  # [S, G] before step s
        states = torch.where(revealed[None], comp[:, None, :], torch.tensor(model.adapter.mask_token_id))
        return Trajectory(states=states, x0=comp[:, None, :].expand(N, S, G).clone(),
                          confidence=torch.full((N, S, G), 0.5, dtype=torch.float32),
                          num_steps=torch.full((N,), S), valid=torch.ones(N, S, dtype=torch.bool))

    def score(self, completions, examples) -> torch.Tensor:
        with real_data():
            return (torch.arange(len(completions)) % 2).float()  # alternating: every group has reward variance

    def score_ids(self, completion_ids, examples, stop_token_ids) -> torch.Tensor:
        return self.score([""] * completion_ids.shape[0], examples).to(completion_ids.device)
