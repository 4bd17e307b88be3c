"""Batch scoring: ``score_batch(reward, completions, examples)`` -> ``list[RewardResult]``.

Rewards run in a reusable pool of worker processes (forkserver or spawn context, never fork: the
trainer may hold threads and CUDA state). Each item has a deadline; a worker that overruns it
(math-verify can hang on adversarial LaTeX) is killed and replaced, and the item scores 0 with
reason ``"timeout"``. An exception in a reward scores 0 with reason ``"error: <type>: <message>"``.
Nothing a reward does can crash the caller.

Rewards registered with ``isolated=True`` (code execution) already run in their own sandboxed
subprocess, so they are called from a thread pool in the calling process instead.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import importlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from typing import Any, Optional, Sequence

from .registry import RewardFn, RewardResult, RewardSpec, is_isolated, resolve_terms, reward_name

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10.0
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))
# Time a worker may take to start and import the reward modules (not charged to any item).
STARTUP_TIMEOUT = 120.0
# Extra time an isolated (sandboxed) reward gets beyond the item timeout for process start/cleanup.
ISOLATED_GRACE = 2.0


def _worker_main(conn: multiprocessing.connection.Connection, warm_modules: tuple[str, ...]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    for name in warm_modules:
        module = importlib.import_module(name)
        warm = getattr(module, "warm_up", None)
        if callable(warm):
            try:
                warm()
            except Exception:  # warming is an optimisation; a real item reports the error
                pass
    conn.send(("ready", None, None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, payload = message
        try:
            fn, completion, example = pickle.loads(payload)
            value = fn(completion, example)
            conn.send((index, True, _as_score(value)))
        except BaseException as err:  # noqa: BLE001 - any failure is this item's failure
            conn.send((index, False, f"{type(err).__name__}: {err}"[:500]))


def _as_score(value: Any) -> float:
    if isinstance(value, RewardResult):
        value = value.score
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"a reward must return a finite number, got {value!r}")
    return float(value)


class _Worker:
    def __init__(self, ctx, warm_modules: tuple[str, ...]):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child, warm_modules), daemon=True,
                                   name="dare-reward-worker")
        self.process.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.item: Optional[int] = None
        self.deadline = math.inf

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class RewardPool:
    """A fixed number of reward worker processes, reused across batches. Thread-safe (one batch at
    a time); ``close()`` shuts it down (also done at interpreter exit for the default pool)."""

    def __init__(self, workers: int = DEFAULT_WORKERS, warm_modules: Sequence[str] = ("dare.rewards.math_reward",),
                 start_method: Optional[str] = None):
        if workers < 1:
            raise ValueError(f"a RewardPool needs at least one worker, got {workers}")
        if start_method is None:
            start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        if start_method == "fork":
            raise ValueError("reward pools never fork the caller (it may hold threads); use forkserver or spawn")
        self.ctx = multiprocessing.get_context(start_method)
        self.size = workers
        self.warm_modules = tuple(warm_modules)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def _spawn(self) -> _Worker:
        worker = _Worker(self.ctx, self.warm_modules)
        self._workers.append(worker)
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)

    def map(self, calls: Sequence[tuple[RewardFn, str, dict]], timeout: float) -> list[RewardResult]:
        """Run ``fn(completion, example)`` for every call with a per-call ``timeout`` in seconds."""
        payloads = [pickle.dumps(call) for call in calls]  # unpicklable rewards fail here, loudly
        results: list[Optional[RewardResult]] = [None] * len(calls)
        with self._lock:
            if self._closed:
                raise RuntimeError("this RewardPool is closed")
            pending = list(range(len(calls)))[::-1]
            startup_failures = 0
            while pending or any(w.item is not None for w in self._workers):
                while len(self._workers) < min(self.size, len(pending) + sum(w.item is not None for w in self._workers)):
                    self._spawn()
                now = time.monotonic()
                for worker in list(self._workers):
                    if worker.ready and worker.item is None and pending:
                        index = pending.pop()
                        try:
                            worker.conn.send((index, payloads[index]))
                        except OSError:  # the worker died while idle: retry the item elsewhere
                            pending.append(index)
                            self._discard(worker)
                            continue
                        worker.item, worker.deadline = index, now + timeout
                waits = [w.deadline if w.item is not None else w.started + STARTUP_TIMEOUT
                         for w in self._workers]
                ready = multiprocessing.connection.wait([w.conn for w in self._workers],
                                                        timeout=max(0.0, min(waits, default=now + 1) - now))
                for worker in list(self._workers):
                    if worker.conn in ready:
                        try:
                            index, ok, value = worker.conn.recv()
                        except (EOFError, OSError):
                            if worker.item is not None:
                                results[worker.item] = RewardResult(0.0, "worker died")
                            elif not worker.ready:
                                startup_failures += 1
                            self._discard(worker)
                            continue
                        if index == "ready":
                            worker.ready = True
                            continue
                        results[index] = RewardResult(value, None) if ok else RewardResult(0.0, f"error: {value}")
                        worker.item, worker.deadline = None, math.inf
                    elif worker.item is not None and time.monotonic() >= worker.deadline:
                        results[worker.item] = RewardResult(0.0, "timeout")
                        self._discard(worker)
                    elif not worker.ready and time.monotonic() >= worker.started + STARTUP_TIMEOUT:
                        startup_failures += 1
                        self._discard(worker)
                if startup_failures >= 3:
                    raise RuntimeError("reward worker processes fail to start (see their stderr above)")
        return [r if r is not None else RewardResult(0.0, "lost") for r in results]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for worker in self._workers:
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
            for worker in self._workers:
                worker.process.join(2)
                worker.kill()
            self._workers.clear()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default_pool: Optional[RewardPool] = None
_default_lock = threading.Lock()
_threads: Optional[concurrent.futures.ThreadPoolExecutor] = None


def get_pool(workers: int = DEFAULT_WORKERS) -> RewardPool:
    """The shared pool, (re)created with ``workers`` processes."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool.size != workers or _default_pool._closed:
            if _default_pool is not None:
                _default_pool.close()
            _default_pool = RewardPool(workers)
        return _default_pool


def close_pool() -> None:
    """Shut down the shared pool and thread pool (a later ``score_batch`` starts new ones)."""
    global _default_pool, _threads
    with _default_lock:
        if _default_pool is not None:
            _default_pool.close()
            _default_pool = None
        if _threads is not None:
            _threads.shutdown(wait=True)
            _threads = None


atexit.register(close_pool)


def _thread_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    global _threads
    with _default_lock:
        if _threads is None or _threads._max_workers != workers:  # noqa: SLF001
            if _threads is not None:
                _threads.shutdown(wait=False)
            _threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dare-reward")
        return _threads


def _call_isolated(fn: RewardFn, completion: str, example: dict, timeout: float, started: list) -> RewardResult:
    from .code_reward import item_timeout

    started.append(time.monotonic())
    token = item_timeout.set(timeout)
    try:
        # A reward may carry ``detailed(completion, example) -> RewardResult`` that says why a score is 0 (the code
        # reward: its sandbox timed out), which a plain number cannot.
        detailed = getattr(fn, "detailed", None)
        if callable(detailed):
            result = detailed(completion, example)
            if isinstance(result, RewardResult):
                return RewardResult(_as_score(result.score), result.reason)
        return RewardResult(_as_score(fn(completion, example)))
    finally:
        item_timeout.reset(token)


def _run_inline(calls: Sequence[tuple[RewardFn, str, dict]]) -> list[RewardResult]:
    results = []
    for fn, completion, example in calls:
        try:
            results.append(RewardResult(_as_score(fn(completion, example))))
        except Exception as err:  # noqa: BLE001
            results.append(RewardResult(0.0, f"error: {type(err).__name__}: {err}"[:500]))
    return results


def _run_isolated(calls: Sequence[tuple[RewardFn, str, dict]], timeout: float, workers: int) -> list[RewardResult]:
    if not calls:
        return []
    executor = _thread_pool(max(1, workers))
    starts: list[list] = [[] for _ in calls]
    futures = [executor.submit(_call_isolated, fn, c, ex, timeout, starts[i]) for i, (fn, c, ex) in enumerate(calls)]
    results: list[Optional[RewardResult]] = [None] * len(calls)
    while any(r is None for r in results):
        concurrent.futures.wait([f for f, r in zip(futures, results) if r is None], timeout=0.05,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        now = time.monotonic()
        for i, future in enumerate(futures):
            if results[i] is not None:
                continue
            if future.done():
                err = future.exception()
                results[i] = (future.result() if err is None
                              else RewardResult(0.0, f"error: {type(err).__name__}: {err}"[:500]))
            elif starts[i] and now > starts[i][0] + timeout + ISOLATED_GRACE:
                results[i] = RewardResult(0.0, "timeout")  # the thread finishes on its own later
    return results  # type: ignore[return-value]


def score_batch(reward: RewardSpec, completions: Sequence[str], examples: Sequence[dict],
                timeout: float = DEFAULT_TIMEOUT, workers: int = DEFAULT_WORKERS) -> list[RewardResult]:
    """Score every (completion, example) pair with ``reward`` (a registered name, a function, a
    ``{name: weight}`` combination, or ``"auto"`` for each example's task default).

    ``timeout`` is per item (per term of a combination); ``workers`` is the process-pool size
    (``workers=0`` runs non-isolated rewards inline in this thread, without timeouts)."""
    if len(completions) != len(examples):
        raise ValueError(f"score_batch got {len(completions)} completions but {len(examples)} examples")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    # (item, weight, name, fn) per term; resolution problems of one item are that item's error.
    terms: list[tuple[int, float, str, RewardFn]] = []
    item_errors: dict[int, str] = {}
    for i, example in enumerate(examples):
        try:
            for weight, fn in resolve_terms(reward, example):
                terms.append((i, weight, reward_name(fn), fn))
        except (KeyError, TypeError, ValueError) as err:
            if not isinstance(reward, str) or reward == "auto":
                item_errors[i] = f"error: {type(err).__name__}: {err}"[:500]
            else:
                raise
    isolated = [k for k, t in enumerate(terms) if is_isolated(t[3])]
    pooled = [k for k, t in enumerate(terms) if not is_isolated(t[3])]

    def calls(keys: list[int]) -> list[tuple[RewardFn, str, dict]]:
        return [(terms[k][3], str(completions[terms[k][0]]), examples[terms[k][0]]) for k in keys]

    # Sandboxed terms start first (threads), then the pool runs while they execute.
    isolated_box: list[list[RewardResult]] = []
    isolated_thread = threading.Thread(
        target=lambda: isolated_box.append(_run_isolated(calls(isolated), timeout, max(1, workers))),
        name="dare-reward-isolated")
    if isolated:
        isolated_thread.start()
    try:
        if not pooled:
            pooled_results: list[RewardResult] = []
        elif workers <= 0:
            pooled_results = _run_inline(calls(pooled))
        else:
            pooled_results = get_pool(workers).map(calls(pooled), timeout)
    finally:
        if isolated:
            isolated_thread.join()
    term_results: dict[int, RewardResult] = dict(zip(pooled, pooled_results))
    term_results.update(zip(isolated, isolated_box[0] if isolated_box else []))

    terms_per_item = [0] * len(examples)
    for i, *_ in terms:
        terms_per_item[i] += 1
    scores = [0.0] * len(examples)
    reasons: list[list[str]] = [[] for _ in examples]
    for i, msg in item_errors.items():
        reasons[i].append(msg)
    for k, (i, weight, name, _) in enumerate(terms):
        result = term_results.get(k, RewardResult(0.0, "lost"))
        scores[i] += weight * result.score
        if result.reason is not None:
            reasons[i].append(result.reason if terms_per_item[i] == 1 else f"{name}: {result.reason}")
    out = [RewardResult(scores[i], "; ".join(reasons[i]) or None) for i in range(len(examples))]
    failed = [(i, r.reason) for i, r in enumerate(out) if r.reason is not None]
    if failed:
        # One line per batch (a training step may have many): counts and the first reason.
        log.warning("rewards: %d of %d items had a failed term (item %d: %s)", len(failed), len(out), *failed[0])
        for i, reason in failed:
            log.debug("reward for item %d: %s", i, reason)
    return out
