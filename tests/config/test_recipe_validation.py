"""Recipe values that used to be accepted and then failed late, trained on nothing, or were silently changed."""
import logging
from dataclasses import dataclass

import pytest

from dare.algorithms import get_algorithm, load_builtin_algorithms, register_algorithm
from dare.algorithms import ALGORITHMS
from dare.algorithms.sft import SFT, SFTConfig
from dare.config import ConfigError
from dare.trainer.recipe import load_recipe
from dare.rollout import SamplerConfig
from tests.trainer.helpers import ROOT

D1 = ROOT / "recipes/d1_tiny.yaml"


def rl_methods(group_relative: bool = True):
    """The built-in RL methods whose default config needs a group (``group_need`` > 1: a group-relative advantage),
    or, with ``group_relative=False``, those that learn from a lone completion (d-OPSD: no advantage at all)."""
    load_builtin_algorithms()
    return sorted(name for name, cls in ALGORITHMS.items() if cls.uses_rollout and not name.startswith("test_")
                  and (cls.config_class().group_need()[0] > 1) == group_relative)


@pytest.mark.parametrize("name", rl_methods(group_relative=False))
def test_methods_without_a_group_advantage_train_on_a_group_of_one(name):
    recipe = load_recipe(D1, [f"algorithm={{name: {name}}}", "rollout.group_size=1"])
    assert recipe.rollout.group_size == 1 and recipe.algorithm.group_need() == (1, "")


def test_only_methods_without_an_advantage_learn_from_a_lone_completion():
    from dare.algorithms.base import Algorithm
    for name in rl_methods(group_relative=False):  # the advantages hook is the base's: no advantage at all
        assert ALGORITHMS[name].advantages is Algorithm.advantages, name


@pytest.mark.parametrize("name", rl_methods())
def test_group_relative_methods_refuse_a_group_of_one(name):
    # Every built-in RL method's default advantage is group-relative: with one completion per prompt it was 0, and
    # the run trained on loss 0 / grad 0 with exit code 0.
    with pytest.raises(ConfigError, match=rf"rollout.group_size=1: algorithm '{name}' needs at least 2 completions per prompt"):
        load_recipe(D1, [f"algorithm={{name: {name}}}", "rollout.group_size=1"])
    load_recipe(D1, [f"algorithm={{name: {name}}}", "rollout.group_size=2"])


def test_the_group_requirement_comes_from_the_algorithm_not_its_name():
    load_recipe(D1, ["rollout.group_size=1", "algorithm.advantage=none"])  # raw rewards: a group of one is fine
    with pytest.raises(ConfigError, match="softmaxes over the prompt's group"):  # wd1's weights need a group anyway
        load_recipe(D1, ["algorithm={name: wd1, advantage: none}", "rollout.group_size=1"])

    @dataclass
    class PairwiseConfig(SFTConfig):
        name: str = "test_pairwise"

        def group_need(self):
            return 3, "it compares three completions"

    @register_algorithm
    class Pairwise(SFT):
        name = "test_pairwise"
        config_class = PairwiseConfig

    assert get_algorithm("test_pairwise") is Pairwise
    with pytest.raises(ConfigError, match="needs at least 3 completions per prompt \\(it compares three completions\\)"):
        load_recipe(D1, ["algorithm={name: test_pairwise}", "rollout.group_size=2"])


@pytest.mark.parametrize("override,pattern", [
    ("reward.name=maht", "unknown reward 'maht'. Did you mean 'math'"),
    ("reward.terms={countdown: 1.0, formatt: 0.5}", "unknown reward 'formatt'. Did you mean 'format'"),
    ("reward.terms={countdown: .nan}", "weight of 'countdown' must be a finite number"),
    ("optim.lr=.inf", "optim.lr must be a positive finite number, got inf"),
    ("optim.lr=.nan", "optim.lr must be a positive finite number, got nan"),
    ("optim.lr=1e999", "optim.lr must be a positive finite number"),
    ("optim.grad_clip=-1", "optim.grad_clip must be a positive finite number"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1"),
    ("eval.limit=0", "eval.limit .* must be >= 1"),
    ("reward.timeout=0", "reward.timeout must be a positive number"),
])
def test_bad_values_fail_at_recipe_load(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_recipe(D1, [override])


def test_reward_weights_are_the_scoring_spec():
    recipe = load_recipe(D1, ["reward.terms={sudoku: 1.0, format: 0.5}"])
    assert recipe.reward.spec == {"sudoku": 1.0, "format": 0.5}
    assert load_recipe(D1, []).reward.spec == "auto" and load_recipe(D1, ["reward.name=sudoku"]).reward.spec == "sudoku"
    with pytest.raises(ConfigError, match="reward.terms are both set"):
        load_recipe(D1, ["reward.name=sudoku", "reward.terms={format: 1.0}"])


def test_steps_beyond_gen_length_are_reported_once(caplog):
    with caplog.at_level(logging.WARNING, logger="dare.rollout.config"):
        for _ in range(3):
            SamplerConfig(gen_length=8, block_length=8, steps=13)
        SamplerConfig(gen_length=8, block_length=8, steps=8)
    notes = [r.getMessage() for r in caplog.records if "steps=13 > gen_length=8" in r.getMessage()]
    assert notes == ["sampler steps=13 > gen_length=8: every step commits at least one token, so decoding takes at most 8 steps"]
