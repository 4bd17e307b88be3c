"""The decoding buffer shared by both samplers, the per-step bookkeeping, and prompt batching.

The buffer ``x [N, W]`` holds every row's prompt and completion in *buffer columns*; each row's
completion starts at column ``gen_start[row]`` (masked models: the padded prompt width P for every row;
block models: wherever the row's absolute-position blocks put it). Commits go through ``commit`` so
that ``step_map`` (the row's own denoising step at which each token was written) and the optional
trajectory are recorded in one place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from ..diffusion.noise import derive_seed
from .result import Trajectory


# --- prompts ---------------------------------------------------------------------------------------
@dataclass
class PromptBatch:
    ids: torch.Tensor  # [M, P] left-padded
    mask: torch.Tensor  # [M, P] bool
    lengths: torch.Tensor  # [M]


def make_prompt_batch(prompts, attention_mask: Optional[torch.Tensor], pad_id: int, device) -> PromptBatch:
    """Token-id lists of any lengths, or a padded LongTensor plus its attention mask -> left-padded batch."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2:
            raise ValueError(f"prompts tensor must be [batch, length], got shape {tuple(prompts.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(prompts, dtype=torch.bool)
        if attention_mask.shape != prompts.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match prompts {tuple(prompts.shape)}")
        rows = [p[m.bool()].tolist() for p, m in zip(prompts.cpu(), attention_mask.cpu())]
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask is only used with a padded prompts tensor")
        rows = []
        for i, p in enumerate(prompts):
            p = p.tolist() if isinstance(p, torch.Tensor) else list(p)
            if not all(isinstance(t, int) for t in p):
                raise ValueError(f"prompt {i} must be a list of token ids (ints)")
            rows.append(p)
    if not rows:
        raise ValueError("no prompts given")
    for i, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"prompt {i} is empty")
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), P), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, P - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, P - len(r):] = True
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    return PromptBatch(ids.to(device), mask.to(device), lengths.to(device))


def sample_generators(num_prompts: int, n: int, generator: Optional[torch.Generator],
                      seeds: Optional[Sequence[int]], device) -> tuple[list[torch.Generator], list[int]]:
    """One generator per sample, seeded from (prompt seed, sample index).

    ``seeds`` gives each prompt its seed (so a prompt's samples do not depend on its place in the batch);
    otherwise prompt seeds derive from one base seed drawn from ``generator`` (0 without one).
    """
    if seeds is not None:
        seeds = [int(s) for s in seeds]
        if len(seeds) != num_prompts:
            raise ValueError(f"seeds has {len(seeds)} entries for {num_prompts} prompts (one seed per prompt)")
    else:
        base = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)) if generator is not None else 0
        seeds = [derive_seed(base, "rollout-prompt", i) for i in range(num_prompts)]
    dev = torch.device(device)
    gens, sample_seeds = [], []
    for i in range(num_prompts):
        for j in range(n):
            s = derive_seed(seeds[i], "rollout-sample", j)
            sample_seeds.append(s)
            gens.append(torch.Generator(device=dev).manual_seed(s))
    return gens, sample_seeds


# --- the buffer --------------------------------------------------------------------------------------
@dataclass
class DecodeState:
    x: torch.Tensor  # [N, W] tokens
    valid: torch.Tensor  # [N, W] bool: real tokens (False = padding)
    pos: torch.Tensor  # [N, W] position ids
    is_prompt: torch.Tensor  # [N, W] bool
    gen_start: torch.Tensor  # [N] first completion column
    gen_length: int
    mask_id: int
    stop_ids: torch.Tensor  # [S] long
    gens: Optional[list[torch.Generator]]
    record: bool = False
    step_map: torch.Tensor = None  # [N, W] long, -1 = never written
    row_steps: torch.Tensor = None  # [N] denoising steps taken by each row
    # [N] model forwards each row took part in: its own NFE, independent of which other rows shared a batch (a
    # cache refresh or a block's storing first step counts like a denoising step; rows already done count nothing).
    row_nfe: torch.Tensor = None
    finished: torch.Tensor = None  # [N] bool
    nfe: int = 0
    entropy_map: Optional[torch.Tensor] = None  # [N, W] float32 when the sampler records entropies (``Record.entropy``)
    _traj: list = field(default_factory=list)
    # Pause / resume (``generate(until_step=...)``, ``resume``): schedule points (block counted from the first
    # generated block, step within the block). Decoding starts at ``start`` and stops before ``pause``.
    start: tuple = (0, 0)
    pause: Optional[tuple] = None
    paused_at: Optional[tuple] = None
    # Inpainting hints (``generate(hints=...)``): [N, W] bool, True where a completion column holds a token given
    # before decoding. Hints are committed context like the prompt: never eligible, never re-masked or edited.
    hint: Optional[torch.Tensor] = None

    def __post_init__(self):
        N, W = self.x.shape
        self.step_map = torch.full((N, W), -1, dtype=torch.long, device=self.x.device)
        self.row_steps = torch.zeros(N, dtype=torch.long, device=self.x.device)
        self.row_nfe = torch.zeros(N, dtype=torch.long, device=self.x.device)
        self.finished = torch.zeros(N, dtype=torch.bool, device=self.x.device)

    @property
    def N(self) -> int:
        return self.x.shape[0]

    def row_gens(self, rows: torch.Tensor) -> Optional[list[torch.Generator]]:
        if self.gens is None:
            return None
        return [self.gens[i] for i in rows.tolist()]

    def count_forward(self, rows: torch.Tensor, calls: int = 1) -> None:
        """Record ``calls`` batched model forwards over batch rows ``rows``."""
        self.nfe += calls
        self.row_nfe[rows] += calls

    def should_pause(self, block: int, step: int) -> bool:
        """True (and remember where) when the schedule point (block, step) is at or past ``pause``."""
        if self.pause is None or (block, step) < tuple(self.pause):
            return False
        self.paused_at = (block, step)
        return True

    def fixed(self, rows: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
        """Bool ``[len(rows), c1 - c0]``: columns no decoding step may change (prompt tokens and hints)."""
        out = self.is_prompt[rows, c0:c1]
        return out if self.hint is None else out | self.hint[rows, c0:c1]

    def place_hints(self, hints: torch.Tensor) -> None:
        """Write ``hints [N, gen_length]`` (token ids, -1 = none) into the completion columns before decoding."""
        cols = self.completion_cols()
        given = hints >= 0
        self.x.scatter_(1, cols, torch.where(given, hints, self.x.gather(1, cols)))
        self.hint = torch.zeros_like(self.is_prompt).scatter_(1, cols, given)

    def block_start_masks(self, rows: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
        """Masked positions of block [c0, c1) when it started: those still masked plus those written since (a
        resumed block has already committed some)."""
        return ((self.x[rows, c0:c1] == self.mask_id) | (self.step_map[rows, c0:c1] >= 0)).sum(1)

    def active(self) -> torch.Tensor:
        return (~self.finished).nonzero().flatten()

    def completion_cols(self, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        start = self.gen_start if rows is None else self.gen_start[rows]
        return start[:, None] + torch.arange(self.gen_length, device=start.device)

    def completion(self, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.x if rows is None else self.x[rows]
        return x.gather(1, self.completion_cols(rows))

    # --- writes -----------------------------------------------------------------------------------
    def commit(self, rows: torch.Tensor, c0: int, new_block: torch.Tensor, written: torch.Tensor,
               x0: Optional[torch.Tensor] = None, score: Optional[torch.Tensor] = None,
               predicted: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None) -> None:
        """Write block ``[c0, c0+L)`` of ``rows``: ``new_block`` is the block after this step, ``written``
        the positions that received a token (their step_map entry becomes the row's current step).
        ``x0``/``score``/``predicted`` describe the step's predictions for the trajectory; ``entropy [n, L]`` the
        predictive entropies of the written positions (kept in ``entropy_map`` when it is recorded)."""
        L = new_block.shape[1]
        if self.entropy_map is not None and entropy is not None:
            em = self.entropy_map[rows, c0:c0 + L]
            self.entropy_map[rows, c0:c0 + L] = torch.where(written, entropy.to(em.dtype), em)
        if self.record:
            self._record(rows, c0, x0, score, predicted)
        self.x[rows, c0:c0 + L] = new_block
        steps = self.row_steps[rows][:, None].expand(-1, L)
        sm = self.step_map[rows, c0:c0 + L]
        sm = torch.where(written, steps, sm)
        sm = torch.where(new_block == self.mask_id, torch.full_like(sm, -1), sm)  # re-masked (RCR)
        self.step_map[rows, c0:c0 + L] = sm
        self.row_steps[rows] += 1

    def _record(self, rows, c0, x0, score, predicted) -> None:
        L = x0.shape[1]
        state = self.x[rows].clone()
        pred = state.clone()
        pred[:, c0:c0 + L] = torch.where(predicted, x0, pred[:, c0:c0 + L])
        conf = torch.zeros(state.shape, dtype=torch.float32, device=state.device)
        conf[:, c0:c0 + L] = torch.where(predicted, score.float(), torch.zeros_like(score, dtype=torch.float32))
        cols = self.completion_cols(rows)
        self._traj.append((rows.clone(), self.row_steps[rows].clone(), state.gather(1, cols),
                           pred.gather(1, cols), conf.gather(1, cols)))

    def finish_rows_with_stop(self, rows: torch.Tensor, final_only: bool) -> None:
        """Mark rows finished whose completion holds a stop token (``final_only``: with no mask before it)."""
        if rows.numel() == 0 or self.stop_ids.numel() == 0:
            return
        comp = self.completion(rows)
        stop = torch.isin(comp, self.stop_ids)
        if final_only:
            stop &= (comp == self.mask_id).long().cumsum(1) == 0
        self.finished[rows] |= stop.any(1)

    def trajectory(self):
        if not self.record:
            return None
        N, G = self.N, self.gen_length
        S = int(self.row_steps.max().item()) if N else 0
        dev = self.x.device
        states = torch.full((N, S, G), self.mask_id, dtype=torch.long, device=dev)
        preds = torch.full((N, S, G), self.mask_id, dtype=torch.long, device=dev)
        conf = torch.zeros((N, S, G), dtype=torch.float32, device=dev)
        for rows, steps, st, pr, cf in self._traj:
            states[rows, steps] = st
            preds[rows, steps] = pr
            conf[rows, steps] = cf
        valid = torch.arange(S, device=dev)[None] < self.row_steps[:, None]
        return Trajectory(states=states, x0=preds, confidence=conf, num_steps=self.row_steps.clone(), valid=valid)


def cache_rows(cache, idx: torch.Tensor):
    """A copy of ``cache`` holding only batch rows ``idx``, for steps whose new keys/values are scratch (a
    denoising step that stores nothing): rows whose block is finished need not run while others finish."""
    sub = type(cache)(cache.num_layers, cache.capacity_hint)
    sub.k = [None if k is None else k.index_select(0, idx) for k in cache.k]
    sub.v = [None if v is None else v.index_select(0, idx) for v in cache.v]
    sub.length = cache.length
    return sub


def make_stop_ids(config_stop_ids: Sequence[int], adapter, device) -> torch.Tensor:
    ids = list(config_stop_ids) if config_stop_ids else list(adapter.all_stop_ids)
    return torch.tensor(sorted(set(int(i) for i in ids)), dtype=torch.long, device=device)


def expand_prompts(batch: PromptBatch, n: int) -> tuple[PromptBatch, torch.Tensor]:
    """Repeat every prompt ``n`` times (samples of one prompt are adjacent)."""
    idx = torch.arange(batch.ids.shape[0], device=batch.ids.device).repeat_interleave(n)
    return PromptBatch(batch.ids[idx], batch.mask[idx], batch.lengths[idx]), idx


PromptsLike = Union[Sequence[Sequence[int]], torch.Tensor]
