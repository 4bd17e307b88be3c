"""Every shipped RL example recipe (recipes/rl/*.yaml) sees a reward signal at its first step: each starts from a
shipped lazy-Sudoku SFT checkpoint on the task it sometimes solves, so its group-relative advantages are not all zero
(issue 40: a random tiny model scored 0 at every step and learned nothing, with a warning)."""
from pathlib import Path

import pytest
import yaml

from dare.trainer.loop import Trainer
from dare.trainer.recipe import load_recipe
from tests.algorithms.toy_task import single_thread

ROOT = Path(__file__).resolve().parents[2]
RL_RECIPES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "recipes/rl").glob("*.yaml"))


@pytest.mark.integration
@pytest.mark.parametrize("recipe", RL_RECIPES)
def test_a_shipped_rl_recipe_sees_a_reward_signal_at_its_first_step(recipe, tmp_path, caplog):
    """One step of the recipe as shipped (its model, data, sampler, group and batch; reward scored in-process)."""
    run = ["train.steps=1", f"train.output_dir={tmp_path}", "train.export=false", "train.save_every=0",
           "reward.workers=0", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]
    shipped = yaml.safe_load((ROOT / recipe).read_text())["model"]["path"]
    assert not shipped.startswith("tiny:"), "an example recipe starts from a checkpoint that earns a reward"
    # the checkpoint path is relative to the repository root (where the README runs dare), not to pytest's folder
    r = load_recipe(ROOT / recipe, [*run, f"model.path={ROOT / shipped}"])
    with single_thread():
        (step,) = Trainer(r).run()
    assert step["reward_mean"] > 0 and step["reward_std"] > 0, step  # completions scored differently
    assert step["grad_norm"] > 0, step
    assert not [m for m in caplog.messages if "learned nothing" in m or "learn nothing" in m]
