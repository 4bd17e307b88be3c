"""The normalised example every loader yields, and how bad rows are reported.

An example is a plain dict (cheap to pickle into reward worker processes and to write as JSON)::

    {"id": "gsm8k/test/0", "task": "math", "question": "<raw problem text, no template>",
     "ground_truth": ..., "source": "gsm8k", "index": 0, ...extras}

``ground_truth`` by task (the contract with ``dare.rewards``):

* ``math``      the gold answer string (GSM8K: the text after ``####``; MATH: the boxed answer),
* ``countdown`` ``{"numbers": [int, ...], "target": int}``,
* ``sudoku``    ``{"puzzle": "16 chars, 0 = empty", "solution": "16 chars"}`` (4x4; 9x9 = 81 chars also accepted),
* ``code``      ``{"tests": "<python run after the solution>", "entry_point": name or None,
                  "prefix": "<code placed before the completion>" or ""}``.

Optional extras: ``solution`` (a worked solution, used for SFT targets), ``messages`` (the chat prompt the
source file shipped, e.g. DARE's parquet), ``canonical_solution`` (code), ``data_source``.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Iterator, Optional

from ..config.core import clip, shown

log = logging.getLogger(__name__)

TASKS = ("math", "countdown", "sudoku", "code")
BAD_ROW_POLICIES = ("error", "skip")


class DataError(ValueError):
    """A malformed row or file; the message names the file and the row (and is never longer than ~2000 chars)."""

    def __init__(self, message: str):
        super().__init__(clip(message))


def where(source: str, row: Optional[int] = None, line: Optional[int] = None) -> str:
    text = str(source)
    if row is not None:
        text += f", row {row}"
    if line is not None:
        text += f" (line {line})"
    return text


def _need(cond: bool, loc: str, msg: str) -> None:
    if not cond:
        raise DataError(f"{loc}: {msg}")


def _check_sudoku(gt: Any, loc: str) -> None:
    _need(isinstance(gt, dict), loc, f"sudoku ground_truth must be a dict with puzzle/solution, got {type(gt).__name__}")
    puzzle, solution = gt.get("puzzle"), gt.get("solution")
    _need(isinstance(puzzle, str) and puzzle != "", loc, f"sudoku puzzle must be a non-empty string, got {shown(puzzle)}")
    _need(isinstance(solution, str) and solution != "", loc, f"sudoku solution must be a non-empty string, got {shown(solution)}")
    n = math.isqrt(len(puzzle))
    _need(n in (4, 9) and n * n == len(puzzle), loc, f"sudoku puzzle must have 16 (4x4) or 81 (9x9) cells, got {len(puzzle)}: {shown(puzzle)}")
    _need(len(solution) == len(puzzle), loc, f"sudoku solution has {len(solution)} cells, the puzzle {len(puzzle)}")
    digits = "".join(str(d) for d in range(n + 1))
    _need(all(c in digits for c in puzzle), loc, f"sudoku puzzle may only hold digits 0-{n}: {shown(puzzle)}")
    _need(all(c in digits[1:] for c in solution), loc, f"sudoku solution may only hold digits 1-{n}: {shown(solution)}")
    _need(all(p in ("0", s) for p, s in zip(puzzle, solution)), loc, "sudoku solution contradicts a given cell of the puzzle")


def validate_example(ex: dict, loc: str) -> dict:
    """Check the normalised fields; raise ``DataError`` naming ``loc`` (file and row) on the first problem."""
    for key in ("id", "task", "question", "ground_truth"):
        _need(key in ex, loc, f"missing field {key!r}")
    _need(isinstance(ex["id"], str) and ex["id"] != "", loc, f"id must be a non-empty string, got {shown(ex['id'])}")
    task = ex["task"]
    _need(task in TASKS, loc, f"unknown task {shown(task)} (expected one of {', '.join(TASKS)})")
    _need(isinstance(ex["question"], str) and ex["question"].strip() != "", loc, "empty question")
    gt = ex["ground_truth"]
    if task == "math":
        _need(isinstance(gt, str), loc, f"math ground_truth must be a string, got {type(gt).__name__} {shown(gt)}")
        _need(gt.strip() != "", loc, "empty answer")
    elif task == "countdown":
        _need(isinstance(gt, dict), loc, f"countdown ground_truth must be a dict with numbers/target, got {type(gt).__name__}")
        nums, target = gt.get("numbers"), gt.get("target")
        _need(isinstance(nums, list) and len(nums) > 0 and all(isinstance(v, int) and not isinstance(v, bool) for v in nums),
              loc, f"countdown numbers must be a non-empty list of ints, got {shown(nums)}")
        _need(isinstance(target, int) and not isinstance(target, bool), loc, f"countdown target must be an int, got {shown(target)}")
    elif task == "sudoku":
        _check_sudoku(gt, loc)
    else:  # code
        _need(isinstance(gt, dict), loc, f"code ground_truth must be a dict with tests/entry_point/prefix, got {type(gt).__name__}")
        _need(isinstance(gt.get("tests"), str) and gt["tests"].strip() != "", loc, "code ground_truth has no tests")
        _need(gt.get("entry_point") is None or isinstance(gt["entry_point"], str), loc, "code entry_point must be a string or null")
        _need(isinstance(gt.get("prefix", ""), str), loc, "code prefix must be a string")
    return ex


class BadRowPolicy:
    """``on_bad_row``: ``error`` raises the row's ``DataError``; ``skip`` logs it once per row and counts it."""

    def __init__(self, mode: str = "error", what: str = "row"):
        if mode not in BAD_ROW_POLICIES:
            raise ValueError(f"on_bad_row must be one of {', '.join(BAD_ROW_POLICIES)}, got {mode!r}")
        self.mode, self.what, self.skipped = mode, what, 0

    def handle(self, err: DataError) -> None:
        if self.mode == "error":
            raise err
        self.skipped += 1
        log.warning("skipping bad %s: %s", self.what, err)

    def apply(self, items: Iterable[Any], fn: Callable[[Any], Any]) -> Iterator[Any]:
        for item in items:
            try:
                yield fn(item)
            except DataError as e:
                self.handle(e)

    def summary(self, source: str) -> None:
        if self.skipped:
            log.warning("%s: skipped %d bad %s(s) (on_bad_row=skip)", source, self.skipped, self.what)
