"""How many tokens each denoising step commits, and the EOSER confidence scale per step.

Four schedules, all vectorised over rows:

* ``even_split`` -- LLaDA's ``get_num_transfer_tokens`` (also SDAR's and LLaDA2's, over the block length):
  ``n // steps`` per step, the first ``n % steps`` steps one more;
* ``time_grid_count`` -- Dream's eps time grid: at step i of T, ``int(m * (1 - s/t))`` of the m masks left,
  with ``t, s = linspace(1, eps, T+1)[i:i+2]`` in float32 (exactly the reference arithmetic), all on the last;
* ``ass_split`` -- CJ-GRPO's ascending step size: ``floor(log2 n)`` steps committing 1, 2, 4, ..., the
  remainder on the last step (n = 128: 1, 2, 4, 8, 16, 32, 65); ``ass_block_steps`` groups those steps into
  CJ-GRPO's variable-size blocks (its ``block_num``).
"""
from __future__ import annotations

import math

import torch


def even_split(counts: torch.Tensor, steps: int) -> torch.Tensor:
    """[R] token counts -> [R, steps] per-step counts (base + 1 on the first ``count % steps`` steps)."""
    counts = counts.long()
    base = counts // steps
    rem = counts % steps
    idx = torch.arange(steps, device=counts.device)
    return base[:, None] + (idx[None, :] < rem[:, None]).long()


def linear_split(counts: torch.Tensor, steps: int) -> torch.Tensor:
    """[R] token counts -> [R, steps] per-step counts of RND1's linear schedule. The masks left after step j are
    ``(M * ((steps - j) / steps)).long()`` with the rate a Python float times an integer tensor (float32 arithmetic),
    exactly the reference's ``(total_masked * rate).long()``; the last step takes the rest."""
    counts = counts.long()
    left = [counts] + [(counts * ((steps - j) / steps)).long() for j in range(1, steps)] + [torch.zeros_like(counts)]
    return torch.stack([a - b for a, b in zip(left[:-1], left[1:])], dim=1)


def ass_num_steps(n: int) -> int:
    """Number of ASS steps for ``n`` tokens: floor(log2 n) (at least one)."""
    if n <= 0:
        raise ValueError(f"ASS schedule needs a positive token count, got {n}")
    return max(1, int(math.floor(math.log2(n))))


def ass_split(n: int, device=None) -> torch.Tensor:
    """[S] per-step counts of the ascending step-size schedule for ``n`` tokens (sums to ``n``)."""
    s = ass_num_steps(n)
    out = torch.tensor([2 ** i for i in range(s)], dtype=torch.long, device=device)
    out[-1] = n - (2 ** (s - 1) - 1)
    return out


def ass_block_steps(n: int, blocks: int) -> list[int]:
    """How many of the ``floor(log2 n)`` ASS steps each of CJ-GRPO's ``blocks`` blocks takes (its ``block_num``,
    ``get_block_sizes`` in ``cj_grpo_trainer_eoser_ass.py``): the first block takes steps 0 .. S - blocks, every
    later block exactly one step, so the blocks hold 2^(S-blocks+1) - 1, 2^(S-blocks+1), ..., 2^(S-2) tokens and
    the last one the final step's 2^(S-1) + 1 + (n - 2^S). The per-step counts are those of ``ass_split(n)``."""
    s = ass_num_steps(n)
    if not 1 <= blocks <= s:
        raise ValueError(f"ass_blocks={blocks} must be between 1 and floor(log2 gen_length)={s} (one ASS step per "
                         f"later block)")
    return [s - blocks + 1] + [1] * (blocks - 1)


def time_grid(steps: int, eps: float, device=None) -> torch.Tensor:
    """Dream's ``linspace(1, eps, steps + 1)`` (float32, as the reference builds it)."""
    return torch.linspace(1, eps, steps + 1, device=device)


def time_grid_count(masks: torch.Tensor, step: int, steps: int, grid: torch.Tensor) -> torch.Tensor:
    """Dream's per-step count for [R] current mask counts (int()-floored; the last step takes all)."""
    if step >= steps - 1:
        return masks.long()
    frac = 1 - grid[step + 1] / grid[step]
    return (masks.float() * frac).floor().long()


def time_grid_split(masks: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """[R] initial mask counts -> [R, steps] Dream counts (each step commits exactly its count, so the
    count sequence is known up front; this equals recomputing it from the live mask count)."""
    grid = time_grid(steps, eps, device=masks.device)
    left = masks.long().clone()
    out = []
    for i in range(steps):
        k = time_grid_count(left, i, steps, grid)
        out.append(k)
        left = left - k
    return torch.stack(out, dim=1)


def eoser_gamma(step: torch.Tensor, total_steps: int, gamma_min: float, gamma_max: float, schedule: str) -> torch.Tensor:
    """EOSER scale for the confidence of a predicted stop token at global step(s) ``step`` of ``total_steps``.

    Linear (``even``): gamma_min + (gamma_max - gamma_min) * s / (S - 1), so exactly gamma_min at step 0.
    ASS: gamma_min + (gamma_max - gamma_min) * (2^(s+1) - 1) / 2^S (the reference's ``ass_sampling``).
    """
    step = torch.as_tensor(step)
    if total_steps <= 1:
        return torch.full(step.shape, gamma_max, dtype=torch.float64, device=step.device)
    s = step.double().clamp(0, total_steps - 1)
    if schedule == "ass":
        t = (torch.pow(2.0, s + 1) - 1) / 2.0 ** total_steps
    else:
        t = s / (total_steps - 1)
    return gamma_min + (gamma_max - gamma_min) * t
