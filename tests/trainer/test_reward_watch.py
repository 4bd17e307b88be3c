"""An RL run that learns nothing from its reward says so (issue 40: the tour's RL example logged reward 0.0 and grad
norm 0.0 at every step without a word), and Ctrl-C names the checkpoint a rerun resumes from."""
import logging

import pytest

from dare.trainer.loop import Trainer
from dare.trainer.reward_watch import RewardWatch
from tests.trainer.test_rl_loop import d1_recipe


def _flat(step, mean=0.0):
    return {"reward_mean": mean, "reward_std": 0.0}


def test_equal_rewards_over_patience_steps_warn_once_per_run_of_them(caplog):
    watch = RewardWatch(group_relative=True, patience=3)
    with caplog.at_level(logging.WARNING, logger="dare"):
        for done in range(1, 6):
            watch.step(done, _flat(done))
        watch.step(6, {"reward_mean": 0.5, "reward_std": 0.1})  # a signal: the next run of equal steps warns anew
        for done in range(7, 9):
            watch.step(done, _flat(done))
        watch.finish()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("steps 1-3: every completion scored the same reward (0)")


def test_a_run_that_never_sees_two_rewards_says_so_at_its_end(caplog):
    watch = RewardWatch(group_relative=True, patience=10)
    with caplog.at_level(logging.WARNING, logger="dare"):
        for done in range(1, 4):
            watch.step(done, _flat(done, 1.0))
        watch.finish()
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith(
        "the run ended without a step whose completions scored differently (3 steps): it learned nothing")
    quiet = RewardWatch(group_relative=False, patience=1)  # d-OPSD: no advantage from the reward
    with caplog.at_level(logging.WARNING, logger="dare"):
        caplog.clear()
        quiet.step(1, _flat(1))
        quiet.finish()
    assert not caplog.records


def test_the_trainer_warns_on_a_flat_reward_and_ctrl_c_names_the_checkpoint(tmp_path, caplog):
    trainer = Trainer(d1_recipe(tmp_path / "flat", "train.steps=6"))
    trainer.train_step = lambda step: {"loss": 0.0, "reward_mean": 0.0, "reward_std": 0.0}
    with caplog.at_level(logging.WARNING, logger="dare"):
        trainer.run()
    assert "steps 1-5: every completion scored the same reward (0)" in caplog.text
    assert "the run ended without a step whose completions scored differently (6 steps)" in caplog.text

    caplog.clear()
    trainer = Trainer(d1_recipe(tmp_path / "stop", "train.steps=6", "train.save_every=2"))

    def step(i):
        if i == 3:
            raise KeyboardInterrupt
        return {"loss": 0.0, "reward_mean": 0.5, "reward_std": 0.5}
    trainer.train_step = step
    with caplog.at_level(logging.WARNING, logger="dare"), pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert "interrupted after step 3 of 6; the last checkpoint is" in caplog.text
    assert "step-2: the same command resumes from it (train.resume=auto)" in caplog.text
