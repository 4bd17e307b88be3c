"""Rewards used by the batch tests. They live in an importable module (not the test file's locals)
because pool workers receive rewards by reference and import them."""
import os
import time

from dare.rewards import register_reward


@register_reward("test_sleepy")
def sleepy(completion: str, example: dict) -> float:
    """Sleeps ``example["sleep"]`` seconds, then scores 1."""
    time.sleep(float(example.get("sleep", 0)))
    return 1.0


@register_reward("test_raises")
def raises(completion: str, example: dict) -> float:
    raise ValueError(f"bad completion {completion!r}")


def not_a_number(completion: str, example: dict):
    return float("nan") if completion == "nan" else "high"


def dies(completion: str, example: dict) -> float:
    os._exit(3)  # a reward that kills its worker process


def length(completion: str, example: dict) -> float:
    return float(len(completion))


def worker_pid(completion: str, example: dict) -> float:
    return float(os.getpid())
