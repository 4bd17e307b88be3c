"""Says when an RL run learns nothing from its reward: every completion of a step scored the same.

For a method whose advantage is relative to its group (``algorithm.group_need()`` asks for 2 or more completions per
prompt), a step whose rewards are all equal (``reward_std`` 0 over the whole batch) has a zero advantage everywhere:
the update moves the policy only through its KL or regulariser terms, if any. A tiny model on a task it never solves
does exactly that (reward 0.0 at every step, grad norm 0), silently. ``RewardWatch`` warns once a run of such steps
reaches ``patience`` (and once more if it goes on to the end), and at the end of a run that never had a step with two
different rewards.
"""
from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger("dare.trainer.loop")

ADVICE = ("train on a task the model can sometimes solve (an easier split, a warm-started checkpoint: "
          "docs/quickstart.md), or raise rollout.group_size / the sampling temperature")


class RewardWatch:
    def __init__(self, group_relative: bool, patience: int = 5):
        self.enabled, self.patience = group_relative, max(1, patience)
        self.flat_since: Optional[int] = None  # first step of the current run of equal-reward steps
        self.warned = False
        self.signal_seen = False
        self.steps = 0

    def step(self, done: int, metrics: dict) -> None:
        """``done``: steps finished (1-based); ``metrics``: the step's (``reward_std``, ``reward_mean``)."""
        if not self.enabled or "reward_std" not in metrics:
            return
        self.steps += 1
        if metrics["reward_std"] > 0.0:
            self.signal_seen, self.flat_since, self.warned = True, None, False
            return
        if self.flat_since is None:
            self.flat_since = done
        if not self.warned and done - self.flat_since + 1 >= self.patience:
            self.warned = True
            log.warning("steps %d-%d: every completion scored the same reward (%.3g), so the group-relative "
                        "advantages are zero and these updates learn nothing from the reward; %s",
                        self.flat_since, done, metrics.get("reward_mean", float("nan")), ADVICE)

    def finish(self) -> None:
        if self.enabled and self.steps and not self.signal_seen:
            log.warning("the run ended without a step whose completions scored differently (%d steps): it learned "
                        "nothing from the reward; %s", self.steps, ADVICE)
