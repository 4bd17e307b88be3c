"""Reward registry: named pure functions ``(completion, example) -> float``.

Training rewards and benchmark scores go through the same functions, so a number reported by
``dare eval`` means the same thing as the reward the trainer optimised.

A reward reads only ``example["task"]`` and ``example["ground_truth"]`` (see docs/rewards.md for the
schema). Rewards that start their own sandboxed subprocess (code execution) are registered with
``isolated=True``: the batch scorer runs those from threads instead of its process pool, because the
subprocess already isolates them and a pool worker would only add a second process hop.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

RewardFn = Callable[[str, dict], float]
# What callers may pass as "a reward": a registered name, a function, or {name-or-function: weight}.
RewardSpec = Union[str, RewardFn, Mapping[Union[str, RewardFn], float]]

REWARDS: dict[str, RewardFn] = {}

# Task name -> default reward name. Benchmarks and training datasets pick their scorer here.
TASK_REWARDS: dict[str, str] = {
    "gsm8k": "math",
    "math": "math",
    "math500": "math",
    "aime": "math",
    "countdown": "countdown",
    "sudoku": "sudoku",
    "humaneval": "code",
    "mbpp": "code",
    "code": "code",
}

# A pseudo reward name: resolve each example's reward from its ``task`` (mixed-task batches).
AUTO = "auto"


@dataclass(frozen=True)
class RewardResult:
    """One scored completion. ``reason`` is None for a normal score, else why the score is 0
    (``"timeout"``, ``"error: ValueError: ..."``, ``"worker died"``)."""

    score: float
    reason: Optional[str] = None


def register_reward(name: str, *, isolated: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn`` under ``name``. ``isolated=True`` marks rewards that run their own
    sandboxed subprocess (safe to call from threads, never sent to the process pool)."""
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"reward name must be a non-empty string other than {AUTO!r}, got {name!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"register_reward({name!r}) expects a function, got {type(fn).__name__}")
        existing = REWARDS.get(name)
        if existing is not None and _qualified(existing) != _qualified(fn):
            raise ValueError(f"reward {name!r} is already registered to {_qualified(existing)}")
        fn.runs_in_subprocess = isolated  # type: ignore[attr-defined]
        fn.reward_name = name  # type: ignore[attr-defined]
        REWARDS[name] = fn
        return fn

    return decorator


def _qualified(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def get_reward(name: str) -> RewardFn:
    """The registered reward ``name``, or the user's function a reference names (``my_rewards:score``,
    ``./my_rewards.py:score``: ``dare.config.references``); an unknown name is an error listing the known ones."""
    try:
        return REWARDS[name]
    except KeyError:
        from ..config.references import Referenced, is_reference, load_reference
        if is_reference(name):
            load_reference(name, "reward")  # a one-line error now, not one per scored completion
            fn = Referenced(name)
            fn.runs_in_subprocess = False  # type: ignore[attr-defined]
            fn.reward_name = name  # type: ignore[attr-defined]
            return fn  # not registered: a relative reference names another file from another folder
        known = ", ".join(sorted(REWARDS)) or "(none registered)"
        raise KeyError(f"unknown reward {name!r}; registered rewards: {known}") from None


def check_reward_spec(spec: RewardSpec, where: str = "reward") -> None:
    """A ``ValueError`` naming ``where`` for an unknown reward name or a weight that is not a finite number: recipes
    call this at load time, before any model is built or rollout generated."""
    import importlib
    import math

    importlib.import_module(__package__)  # registers the built-in rewards
    names = sorted(REWARDS) + [AUTO]
    items = spec.items() if isinstance(spec, Mapping) else [(spec, 1.0)]
    for name, weight in items:
        if isinstance(name, str) and name not in names and _is_reference(name):
            from ..config.references import load_reference
            load_reference(name, where)  # the user's file or module, and the function in it, exist
        elif isinstance(name, str) and name not in names:
            import difflib
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{where}: unknown reward {name!r}.{hint} Registered: {', '.join(names)}; or a "
                             "function of yours: module:function or path/to/file.py:function")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"{where}: the weight of {name!r} must be a finite number, got {weight!r}")


def _is_reference(name: str) -> bool:
    from ..config.references import is_reference
    return is_reference(name)


def reward_for_task(task: str) -> str:
    """Default reward name for a task (gsm8k/math/math500/aime -> math, humaneval/mbpp -> code, ...)."""
    try:
        return TASK_REWARDS[task]
    except KeyError:
        raise KeyError(f"no default reward for task {task!r}; known tasks: {', '.join(sorted(TASK_REWARDS))}") from None


def is_isolated(fn: RewardFn) -> bool:
    return bool(getattr(fn, "runs_in_subprocess", False))


def resolve_terms(reward: RewardSpec, example: Optional[dict] = None) -> list[tuple[float, RewardFn]]:
    """Turn a reward spec into ``[(weight, fn), ...]``. ``"auto"`` needs ``example`` (uses its task)."""
    if isinstance(reward, str):
        if reward == AUTO:
            if example is None:
                raise ValueError("reward 'auto' picks the reward from each example's 'task'; no example given")
            return [(1.0, get_reward(reward_for_task(task_of(example))))]
        return [(1.0, get_reward(reward))]
    if callable(reward):
        return [(1.0, reward)]
    if isinstance(reward, Mapping):
        if not reward:
            raise ValueError("a weighted reward combination needs at least one term")
        terms: list[tuple[float, RewardFn]] = []
        for key, weight in reward.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise TypeError(f"weight of reward term {key!r} must be a number, got {weight!r}")
            for inner_weight, fn in resolve_terms(key, example):
                terms.append((float(weight) * inner_weight, fn))
        return terms
    raise TypeError(f"a reward is a registered name, a function or a {{name: weight}} mapping, got {type(reward).__name__}")


def reward_name(fn: RewardFn) -> str:
    return getattr(fn, "reward_name", None) or getattr(fn, "__name__", repr(fn))


# ---------------------------------------------------------------------------------------------
# Example helpers shared by the reward modules: tolerant access to task / ground_truth.
# ---------------------------------------------------------------------------------------------

def task_of(example: dict) -> str:
    if not isinstance(example, Mapping):
        raise TypeError(f"an example must be a dict with 'task' and 'ground_truth', got {type(example).__name__}")
    task = example.get("task")
    if not isinstance(task, str) or not task:
        raise KeyError(f"example has no 'task' string (keys: {sorted(example)})")
    return task


def ground_truth(example: dict) -> Any:
    if not isinstance(example, Mapping):
        raise TypeError(f"an example must be a dict with 'task' and 'ground_truth', got {type(example).__name__}")
    if "ground_truth" not in example:
        raise KeyError(f"example has no 'ground_truth' (keys: {sorted(example)})")
    return example["ground_truth"]


def ground_truth_dict(example: dict, required: tuple[str, ...]) -> dict:
    """``ground_truth`` as a dict holding ``required`` keys; a JSON-encoded string is accepted."""
    gt = ground_truth(example)
    if isinstance(gt, str):
        try:
            gt = json.loads(gt)
        except json.JSONDecodeError as err:
            raise ValueError(f"ground_truth of a {example.get('task')!r} example is a string but not JSON: {err}") from None
    if not isinstance(gt, Mapping):
        raise TypeError(f"ground_truth of a {example.get('task')!r} example must be a dict, got {type(gt).__name__}")
    missing = [k for k in required if k not in gt]
    if missing:
        raise KeyError(f"ground_truth of a {example.get('task')!r} example lacks {missing} (has {sorted(gt)})")
    return dict(gt)
