"""DiRL's decoding-speed rewards (``speed``, ``speed_cosine``), fed by the rollout's step map."""
import math

import pytest
import torch

from dare.config.core import ConfigError
from dare.trainer.recipe import RewardSection
from dare.rewards import get_reward, score_batch
from dare.rewards.speed import rollout_info

CD = {"task": "countdown", "ground_truth": {"numbers": [30, 100, 93], "target": 23}}
RIGHT, WRONG = "<answer>30 - (100 - 93)</answer>", "<answer>30 + 100 - 93</answer>"


def with_rollout(tokens, steps, block=4):
    return {**CD, "rollout": {"tokens": tokens, "steps": steps, "block_length": block}}


def dirl_speed_reward(correct: bool, tokens: int, steps: int, block: int) -> float:
    """``SpeedReward.__call__`` of OpenMOSS/DiRL train/orm.py, restated for one completion."""
    speed = tokens / steps
    t = max(0, min(speed - 1, block - 1))
    lo, hi = (1.0, 0.5) if correct else (-0.5, 0.0)  # cosfn(t, T, min_value, max_value)
    return hi - (hi - lo) * (1 - math.cos(t * math.pi / (block - 1))) / 2


def test_rollout_info_counts_completion_tokens_and_their_distinct_steps():
    step_map = torch.tensor([[0, 0, 1, 1, 2, 5, -1, -1], [3, 2, 1, 0, 0, 0, 0, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]).bool()
    assert rollout_info(mask, step_map, 4) == [{"tokens": 5, "steps": 3, "block_length": 4},
                                              {"tokens": 8, "steps": 5, "block_length": 4}]


@pytest.mark.parametrize("tokens,steps", [(8, 8), (8, 4), (12, 5), (8, 2), (8, 1)])
def test_speed_terms_follow_dirl(tokens, steps):
    for text, correct in ((RIGHT, True), (WRONG, False)):
        ex = with_rollout(tokens, steps)
        expected = dirl_speed_reward(correct, tokens, steps, 4)
        assert get_reward("speed_cosine")(text, ex) == pytest.approx(expected, abs=1e-12)
        # eval_api.py's speed_reward: len(step_map) / len(set(step_map)) / block_size when correct, else 0
        assert get_reward("speed")(text, ex) == pytest.approx(tokens / steps / 4 if correct else 0.0)
    # the cosine endpoints: slow (1 token per step) and full-block speed
    assert get_reward("speed_cosine")(RIGHT, with_rollout(8, 8)) == pytest.approx(0.5)
    assert get_reward("speed_cosine")(RIGHT, with_rollout(8, 2)) == pytest.approx(1.0)
    assert get_reward("speed_cosine")(WRONG, with_rollout(8, 2)) == pytest.approx(-0.5)


def test_weighted_with_the_task_reward_and_missing_rollout_is_an_item_error():
    res = score_batch({"auto": 1.0, "speed": 0.5}, [RIGHT, WRONG], [with_rollout(8, 4), with_rollout(8, 4)], workers=0)
    assert [r.score for r in res] == [pytest.approx(1.0 + 0.5 * 0.5), pytest.approx(0.1)]  # 0.1: countdown's format credit
    res = score_batch("speed", [RIGHT], [CD], workers=0)
    assert res[0].score == 0.0 and "step map" in res[0].reason


def test_recipe_terms():
    assert RewardSection().spec == "auto"
    assert RewardSection(name="countdown").spec == "countdown"
    assert RewardSection(terms={"speed_cosine": 1.0}).spec == {"speed_cosine": 1.0}
    with pytest.raises(ValueError, match="both set"):
        RewardSection(name="math", terms={"speed": 1.0})
    from dare.trainer.recipe import load_recipe
    with pytest.raises((ConfigError, ValueError), match="expected float"):
        load_recipe(None, ["model.path=tiny:sdar", "algorithm.name=dirl", "reward.terms={speed: fast}"])
