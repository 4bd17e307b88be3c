"""The toy learning task shared by the algorithm tests: the '7' reward, the single-thread fixture and
``learns_toy_reward`` (a tiny model trained a few steps must raise that reward).

Importing this module registers the reward ``mc_test_sevens``; a test module that imports ``one_thread`` gets the
autouse fixture, so all of its tests run single-threaded.
"""
import contextlib
from pathlib import Path

import pytest
import torch

from dare.rewards import REWARDS, register_reward
from dare.trainer.loop import Trainer
from dare.trainer.recipe import load_recipe
from tests.algorithms.helpers import is_block_family
from tests.threads import TEST_THREADS
from tests.tiny_rl import tiny_random

ROOT = Path(__file__).resolve().parents[2]

if "mc_test_sevens" not in REWARDS:
    @register_reward("mc_test_sevens")
    def _sevens(completion, example):
        """A toy reward with signal for a tiny random model: the fraction of '7' characters."""
        return completion.count("7") / max(len(completion), 1)


@contextlib.contextmanager
def single_thread():
    """Tiny models are dominated by threading overhead: one intra-op thread is as fast alone and far faster when the
    machine is shared (measured 3 ms vs 100+ ms per forward under load with 2 threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_thread():
    """Every test of a module that imports this fixture runs single-threaded."""
    with single_thread():
        yield


def learns_toy_reward(tmp_path, name, family, *overrides, recipe=None, sampler=None):
    """15 steps of the recipe on the toy '7' reward; the mean reward must rise by more than 0.3 (it starts near 0.03).

    ``recipe``: a recipe path relative to the repository (default ``recipes/rl/<name>.yaml``); ``sampler``: the
    rollout sampler as a YAML mapping (default: 8 tokens, the family's tiny block, 8 steps at temperature 1).
    Returns the per-step mean rewards."""
    block = 4 if is_block_family(family) else 8
    sampler = sampler or f"{{gen_length: 8, block_length: {block}, steps: 8, temperature: 1.0}}"
    recipe = recipe or f"recipes/rl/{name}.yaml"
    recipe = load_recipe(ROOT / recipe, [
        *tiny_random(recipe, family), "train.steps=15", "train.batch_size=4", "train.micro_batch_size=16",
        "rollout.group_size=8", f"rollout.sampler={sampler}",
        "reward.name=mc_test_sevens", "reward.workers=0", "data.dataset.limit=64", f"train.output_dir={tmp_path}",
        "optim.lr=3e-3", "optim.weight_decay=0.0", "train.export=false", "train.save_every=0",
        "logging.progress=false", "logging.tensorboard=false", "logging.plot=false", *overrides])
    with single_thread():
        rewards = [h["reward_mean"] for h in Trainer(recipe).run()]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards
    return rewards
