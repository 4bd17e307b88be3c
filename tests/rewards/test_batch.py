"""Registry and batch scoring: pooled workers, per-item timeouts, errors, weighted combinations."""
import logging
import os
import threading
import time

import pytest

from dare.rewards import (
    REWARDS, RewardPool, RewardResult, get_reward, register_reward, resolve_terms, reward_for_task, score_batch,
)

from . import helpers

MATH = {"task": "math", "ground_truth": "5"}


# ------------------------------------------------------------------------------------------- registry
def test_registry_and_task_defaults():
    for task, name in [("gsm8k", "math"), ("math", "math"), ("math500", "math"), ("aime", "math"),
                       ("countdown", "countdown"), ("sudoku", "sudoku"), ("humaneval", "code"), ("mbpp", "code")]:
        assert reward_for_task(task) == name
        assert REWARDS[name] is get_reward(name)
    with pytest.raises(KeyError, match="registered rewards"):
        get_reward("no-such-reward")
    with pytest.raises(KeyError, match="no default reward"):
        reward_for_task("poetry")


def test_register_rejects_a_second_function_under_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math")(helpers.length)
    assert register_reward("test_sleepy")(helpers.sleepy) is helpers.sleepy  # re-import is fine


def test_resolve_weighted_terms():
    terms = resolve_terms({"countdown": 1.0, "format": 0.5})
    assert [(w, f) for w, f in terms] == [(1.0, get_reward("countdown")), (0.5, get_reward("format"))]
    assert resolve_terms("auto", {"task": "mbpp", "ground_truth": {}}) == [(1.0, get_reward("code"))]
    with pytest.raises(TypeError, match="weight"):
        resolve_terms({"math": "high"})
    with pytest.raises(ValueError, match="at least one"):
        resolve_terms({})


# --------------------------------------------------------------------------------------- score_batch
@pytest.fixture(scope="module")
def pool():
    with RewardPool(workers=2) as p:
        yield p


def test_pool_scores_and_is_reused(pool):
    calls = [(helpers.worker_pid, "", {}) for _ in range(6)]
    first = {r.score for r in pool.map(calls, timeout=30)}
    second = {r.score for r in pool.map(calls, timeout=30)}
    # The same two worker processes serve both batches (which of them takes which call is up to the pool).
    assert len(first | second) <= 2 and os.getpid() not in first | second
    results = pool.map([(helpers.length, "abc", {}), (get_reward("math"), "\\boxed{5}", MATH)], timeout=30)
    assert results == [RewardResult(3.0), RewardResult(1.0)]


def test_pool_shuts_down_cleanly():
    pool = RewardPool(workers=2)
    pids = {int(r.score) for r in pool.map([(helpers.worker_pid, "", {})] * 4, timeout=60)}
    assert pids and os.getpid() not in pids
    pool.close()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"
    with pytest.raises(RuntimeError, match="closed"):
        pool.map([(helpers.length, "", {})], timeout=5)


def test_timeout_gives_zero_and_the_pool_recovers(pool):
    slow = {"task": "math", "ground_truth": "", "sleep": 30}
    fast = {"task": "math", "ground_truth": "", "sleep": 0}
    start = time.monotonic()
    results = pool.map([(helpers.sleepy, "", slow), (helpers.sleepy, "", fast), (helpers.sleepy, "", fast)], timeout=1.0)
    assert time.monotonic() - start < 15
    assert results == [RewardResult(0.0, "timeout"), RewardResult(1.0), RewardResult(1.0)]
    assert pool.map([(helpers.sleepy, "", fast)] * 3, timeout=30) == [RewardResult(1.0)] * 3


def test_exceptions_bad_values_and_dead_workers_score_zero(pool):
    results = pool.map([(helpers.raises, "x", {}), (helpers.not_a_number, "nan", {}),
                        (helpers.not_a_number, "str", {}), (helpers.dies, "", {}), (helpers.length, "ok", {})], timeout=30)
    assert results[0] == RewardResult(0.0, "error: ValueError: bad completion 'x'")
    assert results[1].score == 0.0 and "finite number" in results[1].reason
    assert results[2].score == 0.0 and "finite number" in results[2].reason
    assert results[3] == RewardResult(0.0, "worker died")
    assert results[4] == RewardResult(2.0)


def test_unpicklable_reward_is_a_clear_error(pool):
    with pytest.raises(Exception, match="pickle|local object|lambda"):
        pool.map([(lambda c, e: 1.0, "", {})], timeout=5)


def test_score_batch_timeout_reason_and_combination():
    examples = [{"task": "math", "ground_truth": "5", "sleep": 0}, {"task": "math", "ground_truth": "5", "sleep": 30}]
    results = score_batch("test_sleepy", ["", ""], examples, timeout=1.0, workers=2)
    assert results == [RewardResult(1.0), RewardResult(0.0, "timeout")]
    combo = score_batch({"math": 1.0, "format": 0.5, "test_raises": 2.0},
                        ["<reasoning>r</reasoning><answer>\\boxed{5}</answer>", "\\boxed{4}"], [MATH, MATH], workers=2)
    assert [r.score for r in combo] == [1.5, 0.0]
    assert combo[0].reason.startswith("test_raises: error: ValueError")


def test_adversarial_latex_that_would_hang_math_verify_is_refused_before_it():
    # sympy would evaluate the power tower forever; the math grader's work bound refuses it first (a plain 0, not a
    # timeout), and the worker deadline (test_score_batch_timeout_reason_and_combination) stays as the last line.
    start = time.monotonic()
    results = score_batch("math", ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{1}"], [{"task": "math", "ground_truth": "1"}] * 2,
                          timeout=2.0, workers=2)
    assert results == [RewardResult(0.0), RewardResult(1.0)]
    assert time.monotonic() - start < 30


def test_score_batch_auto_mixes_tasks_and_sandboxed_code():
    completions = ["\\boxed{5}", "<answer>30 - (100 - 93)</answer>", "```python\ndef add(a, b):\n    return a + b\n```",
                   "```python\ndef add(a, b):\n    return a * b\n```", "anything"]
    code = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"], "entry_point": None, "prefix": ""}
    examples = [MATH, {"task": "countdown", "ground_truth": {"numbers": [30, 100, 93], "target": 23}},
                {"task": "mbpp", "ground_truth": code}, {"task": "mbpp", "ground_truth": code},
                {"task": "poetry", "ground_truth": ""}]
    results = score_batch("auto", completions, examples, workers=2)
    assert [r.score for r in results] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert results[3].reason is None                     # a failing test is a score, not an error
    assert "no default reward for task 'poetry'" in results[4].reason


def test_score_batch_inline_and_argument_checks(caplog):
    with caplog.at_level(logging.WARNING, logger="dare.rewards.batch"):
        assert score_batch("test_raises", ["a"], [MATH], workers=0) == [RewardResult(0.0, "error: ValueError: bad completion 'a'")]
    assert "1 of 1 items had a failed term (item 0: error: ValueError" in caplog.text
    assert score_batch(helpers.length, ["abcd"], [MATH], workers=0) == [RewardResult(4.0)]
    with pytest.raises(ValueError, match="2 completions but 1 examples"):
        score_batch("math", ["a", "b"], [MATH])
    with pytest.raises(KeyError, match="unknown reward"):
        score_batch("nope", ["a"], [MATH])


def test_score_batch_from_threads():
    # The trainer may call score_batch from several threads; the shared pool serialises batches.
    out = {}

    def run(k):
        out[k] = score_batch("math", ["\\boxed{5}", "\\boxed{6}"], [MATH, MATH], workers=2)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all([r.score for r in out[k]] == [1.0, 0.0] for k in range(3))
