"""Tree-structured rollouts (d-TreeRPO): decode a shared trunk, branch at fixed schedule steps, continue each branch.

``generate_tree(model, prompts, config, branching=[b0, b1, ...], cut_steps=[s1, ...])`` is ``generate`` paused at
``s1`` with ``b0`` samples per prompt (the level-0 nodes), then ``resume`` of every node with ``b1`` continuations
paused at ``s2``, and so on; the last level runs to the end (the leaves). Every level is ONE batched call of the
ordinary rollout engine (same sampler, caches and step maps), so a tree with ``prod(branching)`` leaves costs the
trunk's steps once per node instead of once per leaf. A node's ``step_map`` extends its parent's: the tokens it
committed carry the steps it ran (``[parent's steps, its own steps)``).

Rows of level k are grouped by parent (``parents[k][r]`` = the row of level k-1 that row r continues; for level 0
the prompt index). A row that stopped before a cut (a stop token with ``block_stop`` / ``eos_early_stop``) is carried
to the next levels unchanged, so every tree keeps its shape.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..diffusion.noise import derive_seed
from .api import Rollout, generate, resume
from .config import SamplerConfig


@dataclass
class TreeRollout:
    levels: list[Rollout]  # levels[k]: the nodes after segment k (rows grouped by parent); the last = leaves
    parents: list[torch.Tensor]  # parents[k][r]: parent row (level k-1) of row r of level k; level 0: prompt index
    cut_steps: list[int]
    branching: list[int]

    @property
    def leaves(self) -> Rollout:
        return self.levels[-1]

    @property
    def nfe(self) -> int:
        """Batched model calls of the whole tree (one per denoising step of every level)."""
        return sum(level.nfe for level in self.levels)

    def ancestors(self, level: int, row: int) -> list[int]:
        """Rows of ``row``'s ancestors at levels 0..level-1 (then itself), top-down."""
        path = [row]
        for k in range(level, 0, -1):
            path.append(int(self.parents[k][path[-1]]))
        return path[::-1]


def _carry(parent: Rollout, n: int) -> Rollout:
    """``parent``'s rows repeated ``n`` times without decoding (every row already finished)."""
    N = parent.completion_ids.shape[0]
    idx = torch.arange(N, device=parent.completion_ids.device).repeat_interleave(n)
    seeds = [s for s in parent.seeds for _ in range(n)] if parent.seeds else parent.seeds
    return dataclasses.replace(parent.rows(idx), sample_index=torch.arange(n, device=idx.device).repeat(N), nfe=0,
                               seeds=seeds)


@torch.no_grad()
def generate_tree(model, prompts, config: SamplerConfig, branching: Sequence[int], cut_steps: Sequence[int],
                  seeds: Optional[Sequence[int]] = None, generator: Optional[torch.Generator] = None) -> TreeRollout:
    """Decode a tree per prompt: ``branching[k]`` children per node of level k-1 (``branching[0]`` per prompt),
    levels separated at the increasing schedule steps ``cut_steps`` (``len(branching) - 1`` of them)."""
    if len(cut_steps) != len(branching) - 1:
        raise ValueError(f"a tree of depth {len(branching)} needs {len(branching) - 1} cut steps, got {list(cut_steps)}")
    if any(b < 1 for b in branching):
        raise ValueError(f"branching factors must be >= 1, got {list(branching)}")
    if any(b <= a for a, b in zip(cut_steps, cut_steps[1:])) or (cut_steps and cut_steps[0] < 1):
        raise ValueError(f"cut_steps must be positive and increasing, got {list(cut_steps)}")
    cuts = list(cut_steps) + [None]
    level = generate(model, prompts, config, generator=generator, n=branching[0], seeds=seeds, until_step=cuts[0])
    levels, parents = [level], [level.prompt_index]
    for k in range(1, len(branching)):
        n = branching[k]
        if level.paused_at is None:  # every row finished before the cut: the subtree is copies
            child = _carry(level, n)
        else:
            row_seeds = [derive_seed(s, "tree-level", k) for s in level.seeds] if level.seeds else None
            child = resume(model, level, config, n=n, seeds=row_seeds, until_step=cuts[k])
        rows = level.completion_ids.shape[0]
        parents.append(torch.arange(rows, device=child.completion_ids.device).repeat_interleave(n))
        levels.append(child)
        level = child
    return TreeRollout(levels, parents, list(cut_steps), list(branching))
