"""Math correctness: GSM8K, MATH, MATH-500, AIME. 1.0 if the final answer equals the gold answer.

Equivalence is checked in two stages:
  1. string normalisation + exact numbers (``normalize.py``): cheap, no sympy;
  2. math-verify (``parse`` + ``verify``) when installed: symbolic equality (``2\\sqrt2`` = ``\\sqrt8``,
     ``(x+1)^2`` = ``x^2+2x+1``), intervals, sets, percentages.

math-verify's own timeouts use ``signal.alarm``, which raises off the main thread, so they are switched
off here (``parsing_timeout=None, timeout_seconds=None``). The deadline is enforced by the caller:
``score_batch`` runs this in a worker process and kills the worker when an item overruns.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

from .extract import extract_answer
from .normalize import strings_equivalent
from .registry import ground_truth, register_reward, task_of

log = logging.getLogger(__name__)

# Tasks whose completions may end with a bare number (GSM8K word problems); others need an
# explicit answer (\boxed, <answer>, ####) so a stray number in the reasoning is never graded.
# dare.data labels GSM8K rows task="math", source="gsm8k", so the source counts too.
LAST_NUMBER_TASKS = {"gsm8k"}


def allows_last_number(example: dict) -> bool:
    return task_of(example) in LAST_NUMBER_TASKS or example.get("source") in LAST_NUMBER_TASKS


@functools.lru_cache(maxsize=1)
def _math_verify() -> Optional[Any]:
    try:
        import math_verify
        from math_verify import grader, parser
    except ImportError:
        log.info("math-verify is not installed; math answers are compared by string normalisation only")
        return None
    # We disable math-verify's signal-based timeouts on purpose (see module docstring); its one-time
    # warning about that would otherwise be printed by every worker process.
    parser.TIMEOUT_WARNING_SHOWN = True
    grader.TIMEOUT_WARNING_SHOWN = True
    return math_verify


def _wrap_latex(answer: str) -> str:
    """math-verify's parser only extracts LaTeX inside ``$...$`` or ``\\boxed{}``; bare strings such
    as ``\\sqrt{8}`` would yield nothing."""
    stripped = answer.strip()
    if "\\boxed" in stripped or stripped.startswith("$"):
        return stripped
    return "\\boxed{" + stripped + "}"


def _parse(mv: Any, text: str) -> list:
    parsed = mv.parse(_wrap_latex(text), parsing_timeout=None)
    if not parsed:
        # Free text such as "The answer is 18 apples": let math-verify find the expression itself.
        parsed = mv.parse(text, parsing_timeout=None)
    return parsed


def math_verify_equivalent(prediction: str, gold: str) -> bool:
    """math-verify's verdict (False when it is not installed or parses nothing)."""
    mv = _math_verify()
    if mv is None:
        return False
    gold_parsed = _parse(mv, gold)
    if not gold_parsed:
        return False
    pred_parsed = _parse(mv, prediction)
    if not pred_parsed:
        return False
    return bool(mv.verify(gold_parsed, pred_parsed, timeout_seconds=None))


def answers_equivalent(prediction: Optional[str], gold: str) -> bool:
    if prediction is None or not prediction.strip():
        return False
    if strings_equivalent(prediction, gold):
        return True
    return math_verify_equivalent(prediction, gold)


def gold_answer(example: dict) -> str:
    """The gold answer string; a gold written as a full solution (``#### 18`` or ``\\boxed{}``) is
    reduced to its final answer."""
    gt = ground_truth(example)
    if isinstance(gt, (int, float)) and not isinstance(gt, bool):
        return str(gt)
    if isinstance(gt, dict) and "answer" in gt:
        gt = gt["answer"]
    if not isinstance(gt, str) or not gt.strip():
        raise ValueError(f"math ground_truth must be a non-empty answer string, got {gt!r}")
    if "####" in gt or "\\boxed" in gt or "<answer>" in gt:
        extracted = extract_answer(gt)
        if extracted:
            return extracted
    return gt.strip()


@register_reward("math")
def math_reward(completion: str, example: dict) -> float:
    """1.0 if the completion's final answer equals ``ground_truth``, else 0.0."""
    gold = gold_answer(example)
    prediction = extract_answer(completion, allow_last_number=allows_last_number(example))
    return 1.0 if answers_equivalent(prediction, gold) else 0.0


def warm_up() -> None:
    """Import math-verify and build its parser tables (pool workers call this before taking items,
    so the first item's deadline does not pay for the imports)."""
    answers_equivalent("\\frac{1}{2}", "0.5")
    answers_equivalent("x+1", "1+x")
