"""The tiny random model a test runs a method's recipe on.

``recipes/rl/*.yaml`` start from the shipped lazy-Sudoku SFT checkpoints, so a user's run sees a reward from its first
step (40-token Sudoku answers). The tests that run those recipes keep what they were written for: a random tiny model
of the checkpoint's family (hidden 64, 2 layers) on Countdown, 16 completion tokens decoded at the recipe's own tokens
per step. A test's own overrides come after these and win.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_GEN = 16  # completion tokens of the tiny runs
TINY_RANDOM = ("model.tiny_sizes={hidden_size: 64, num_layers: 2}",
               "data.dataset={name: countdown, template: compact, limit: 256, shuffle_seed: 0}")


def tiny_random(recipe: str | Path, family: str | None = None) -> list[str]:
    """Overrides that put ``recipe`` (a path, absolute or relative to the repository) on ``tiny:<family>`` (default:
    the family of the recipe's checkpoint). A recipe already on a tiny model keeps its settings (and gets ``family``)."""
    from dare.models.families.base import detect_family
    from dare.models.loading import read_config
    from dare.trainer.recipe import load_recipe
    r = load_recipe(ROOT / recipe)
    if r.model.path.startswith("tiny:"):
        return [f"model.path=tiny:{family}"] if family else []
    family = family or detect_family(read_config(ROOT / r.model.path)).name
    out = [f"model.path=tiny:{family}", *TINY_RANDOM]
    s = r.rollout.sampler
    if s.gen_length != TINY_GEN:
        out.append(f"rollout.sampler.gen_length={TINY_GEN}")
        one_block = s.block_length == s.gen_length
        if one_block:  # one block stays one block
            out.append(f"rollout.sampler.block_length={TINY_GEN}")
        elif TINY_GEN % s.block_length:
            raise ValueError(f"{recipe}: block_length {s.block_length} does not divide the tiny runs' {TINY_GEN} tokens")
        if one_block and s.steps_per_block:
            raise ValueError(f"{recipe}: steps_per_block with one block: say how the tiny runs scale it")
        if s.steps:  # the recipe's tokens per step
            steps = s.steps * TINY_GEN // s.gen_length
            if steps < 1 or s.steps * TINY_GEN % s.gen_length:
                raise ValueError(f"{recipe}: {s.steps} steps for {s.gen_length} tokens do not scale to {TINY_GEN}")
            out.append(f"rollout.sampler.steps={steps}")
    return out
