"""DiRL's decoding-speed rewards (Zhu et al. 2025; ``OpenMOSS/DiRL``: ``train/orm.py`` ``SpeedReward``,
``eval/eval_api.py``), fed by the rollout's step map.

``speed = tokens / distinct decoding steps``: the completion's tokens (up to and including the first stop token)
divided by the number of distinct denoising steps that wrote them -- 1 when every step commits one token, up to
the block length with parallel (threshold) decoding. A reward reads only ``(completion, example)``, so the RL
trainer attaches the rollout's numbers to every example it scores (``rollout_info``):
``example["rollout"] = {"tokens": n, "steps": k, "block_length": B}``.

* ``speed``: ``speed / B`` when the answer is correct, else 0 (``eval_api.py``'s ``speed_reward``), in (0, 1].
* ``speed_cosine``: the correctness-shaped cosine of ``SpeedReward`` (DiRL's ``reward_funcs: speed``), with
  ``t = clamp(speed - 1, 0, B - 1)`` and ``cos(t) = s - (s - e) (1 - cos(pi t / (B - 1))) / 2`` (s at t = 0, e at B - 1): a correct answer
  earns 0.5 at speed 1 rising to 1.0 at speed B, a wrong one 0.0 falling to -0.5 (fast wrong answers are
  penalised). It already contains the correctness signal, so DiRL uses it *instead of* the accuracy reward.

Correct = the example's task reward (``reward_for_task``: math, countdown, ...) is >= 1.0, as DiRL's
``acc_reward >= 1.``. Weight them in a recipe with ``reward.terms`` (e.g. ``{speed_cosine: 1.0}`` or
``{auto: 1.0, speed: 0.5}``).
"""
from __future__ import annotations

import math
from typing import Optional

from .registry import get_reward, register_reward, reward_for_task, task_of

# SpeedReward's defaults (speed_{min,max}_speed_value_{correct,wrong}); speed_max_len = the rollout's block size.
CORRECT_SLOW, CORRECT_FAST = 0.5, 1.0
WRONG_SLOW, WRONG_FAST = 0.0, -0.5


def rollout_info(completion_mask, step_map, block_length: int) -> list[dict]:
    """Per sample ``{"tokens", "steps", "block_length"}`` from a rollout's ``completion_mask`` / ``step_map``
    tensors (``[N, G]``; step -1 = never written). (No torch import here: reward workers do not load torch.)"""
    mask = completion_mask.bool() & (step_map >= 0)
    out = []
    for m, steps in zip(mask.cpu(), step_map.cpu()):
        out.append({"tokens": int(m.sum()), "steps": int(steps[m].unique().numel()), "block_length": int(block_length)})
    return out


def decoding_speed(example: dict) -> tuple[float, int]:
    """(tokens per distinct step, block length) of the rollout attached to ``example``."""
    info: Optional[dict] = example.get("rollout") if isinstance(example, dict) else None
    if not info:
        raise KeyError("the speed rewards need the rollout's step map (example['rollout'] = {tokens, steps, "
                       "block_length}); the RL trainer attaches it to every sample it scores")
    steps = max(int(info["steps"]), 1)
    return max(int(info["tokens"]), 1) / steps, max(int(info["block_length"]), 1)


def is_correct(completion: str, example: dict) -> bool:
    return get_reward(reward_for_task(task_of(example)))(completion, example) >= 1.0


def cosine(t: float, T: float, end: float, start: float) -> float:
    """``start`` at t = 0 moving to ``end`` at t = T along half a cosine (DiRL's ``cosfn(t, T, min, max)``)."""
    if T <= 0:
        return start
    return start - (start - end) * (1 - math.cos(t * math.pi / T)) / 2


@register_reward("speed")
def speed_reward(completion: str, example: dict) -> float:
    """``speed / block_length`` for a correct answer, 0 otherwise."""
    speed, block = decoding_speed(example)
    return speed / block if is_correct(completion, example) else 0.0


@register_reward("speed_cosine")
def speed_cosine_reward(completion: str, example: dict) -> float:
    """DiRL's ``SpeedReward``: correct answers 0.5 (slow) -> 1.0 (fast), wrong ones 0.0 (slow) -> -0.5 (fast)."""
    speed, block = decoding_speed(example)
    t = max(0.0, min(speed - 1.0, block - 1.0))
    if is_correct(completion, example):
        return cosine(t, block - 1, CORRECT_FAST, CORRECT_SLOW)
    return cosine(t, block - 1, WRONG_FAST, WRONG_SLOW)
