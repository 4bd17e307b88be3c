"""Rewards and verifiers shared by training and evaluation (see docs/rewards.md).

Every reward is a pure function ``(completion: str, example: dict) -> float`` registered by name;
``score_batch`` scores many completions at once in worker processes with per-item timeouts.

Built-in rewards: ``math`` (GSM8K/MATH/MATH-500/AIME), ``countdown``, ``sudoku`` (d1 rules),
``code`` (HumanEval/MBPP in the sandbox), format terms ``format``, ``format_strict``, ``xml_count``,
``answer_int``, ``boxed_in_answer``; DiRL's decoding-speed terms ``speed``, ``speed_cosine`` (fed by the rollout's
step map). ``reward_for_task(task)`` names a task's default reward and
``"auto"`` picks it per example.
"""
from . import code_reward, format, math_reward, puzzles, speed  # noqa: F401  (register the built-in rewards)
from .batch import DEFAULT_TIMEOUT, DEFAULT_WORKERS, RewardPool, close_pool, get_pool, score_batch
from .code_reward import build_program, extract_code, run_code, set_code_limits
from .extract import extract_answer, last_boxed
from .math_reward import answers_equivalent
from .normalize import strings_equivalent, strip_answer
from .puzzles import evaluate_arithmetic
from .registry import (
    AUTO,
    REWARDS,
    TASK_REWARDS,
    RewardResult,
    get_reward,
    register_reward,
    resolve_terms,
    reward_for_task,
)
from .sandbox import (ISOLATIONS, SandboxLimits, SandboxResult, available_isolations, detect_isolation, run_judged,
                      run_python)

__all__ = [
    "AUTO", "ISOLATIONS", "available_isolations", "DEFAULT_TIMEOUT", "DEFAULT_WORKERS", "REWARDS", "TASK_REWARDS", "RewardPool", "RewardResult",
    "SandboxLimits", "SandboxResult", "answers_equivalent", "build_program", "close_pool", "detect_isolation",
    "evaluate_arithmetic", "extract_answer", "extract_code", "get_pool", "get_reward", "last_boxed",
    "register_reward", "resolve_terms", "reward_for_task", "run_code", "run_judged", "run_python", "score_batch",
    "set_code_limits", "strings_equivalent", "strip_answer",
]
