"""Math correctness: GSM8K, MATH, MATH-500, AIME. 1.0 if the final answer equals the gold answer.

Equivalence is checked in two stages:
  1. string normalisation + exact numbers (``normalize.py``): cheap, no sympy;
  2. math-verify (``parse`` + ``verify``, a dependency of dare): symbolic equality (``2\\sqrt2`` = ``\\sqrt8``,
     ``(x+1)^2`` = ``x^2+2x+1``), intervals, sets, percentages.

The prediction is untrusted (an RL policy searches for whatever scores), so before stage 2 it must
  * be within the work bound of ``math_bounds.work_problem`` (length, nesting, number sizes, expansion terms);
  * state a value: ``v = value`` counts only when ``v`` is a variable (or the gold's own name for its quantity);
  * hold no logical connective the gold does not (math-verify reads ``7 \\vee 8`` as 8);
  * parse as LaTeX as a whole: math-verify's own fallback (the last number it can find, ``7 & 8`` -> 8) is used only
    for free text with a single number and no LaTeX command ("The answer is 18").

math-verify's own timeouts use ``signal.alarm``, which raises off the main thread, so they are switched
off here (``parsing_timeout=None, timeout_seconds=None``). The deadline is enforced by the caller:
``score_batch`` runs this in a worker process and kills the worker when an item overruns.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import re

from .extract import extract_answer
from .math_bounds import MAX_ANSWER_CHARS, work_problem
from .normalize import answer_value, equation_sides, gold_name, strings_equivalent
from .registry import ground_truth, register_reward, task_of

log = logging.getLogger(__name__)

# Tasks whose completions may end with a bare number (GSM8K word problems); others need an
# explicit answer (\boxed, <answer>, ####) so a stray number in the reasoning is never graded.
# dare.data labels GSM8K rows task="math", source="gsm8k", so the source counts too.
LAST_NUMBER_TASKS = {"gsm8k"}


def allows_last_number(example: dict) -> bool:
    return task_of(example) in LAST_NUMBER_TASKS or example.get("source") in LAST_NUMBER_TASKS


INSTALL_MATH_VERIFY = "pip install 'math-verify>=0.7'"
_CONNECTIVES = re.compile(r"\\(?:vee|lor|wedge|land|neg|lnot)(?![A-Za-z])")
_NUMBERS = re.compile(r"\d+(?:[.,]\d+)*")


@functools.lru_cache(maxsize=1)
def _math_verify() -> Any:
    try:
        import math_verify
        from math_verify import grader, parser
    except ImportError:
        # A grader that silently falls back to string matching scores 10^3 vs 1000 as wrong: RL would train on wrong
        # rewards, so there is no fallback.
        raise ImportError(f"the math reward needs math-verify (a dependency of dare): {INSTALL_MATH_VERIFY}") from None
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


def _parse_gold(mv: Any, text: str) -> list:
    parsed = mv.parse(_wrap_latex(text), parsing_timeout=None)
    if not parsed:
        # Free text such as "18 apples": let math-verify find the expression itself (the gold is trusted).
        parsed = mv.parse(text, parsing_timeout=None)
    return parsed


def _parse_prediction(mv: Any, text: str) -> list:
    """The prediction as one LaTeX expression. math-verify's defaults fall back, when the LaTeX does not parse, to the
    last plain number in the text (``7 \\vee 8``, ``7 & 8``, ``\\cdot 8`` all became 8): that fallback is allowed
    only for free text holding a single number and no LaTeX command."""
    parsed = mv.parse(_wrap_latex(text), extraction_config=[mv.LatexExtractionConfig()], fallback_mode="no_fallback",
                      extraction_mode="first_match", parsing_timeout=None)
    if not parsed and "\\" not in text and len(_NUMBERS.findall(text)) == 1:
        parsed = mv.parse(text, extraction_config=[mv.ExprExtractionConfig()], fallback_mode="no_fallback",
                          parsing_timeout=None)
    return parsed


def _comparable(prediction: str, gold: str) -> Optional[tuple[str, str]]:
    """(prediction, gold) as math-verify should compare them, or None when the prediction cannot be the gold."""
    if any(c not in gold for c in set(_CONNECTIVES.findall(prediction))):
        return None  # "7 \\vee 8" is not an answer; a connective the gold uses too (a logic answer) is compared
    name = gold_name(gold)
    names = (name,) if name else ()
    gold_value, pred_value = answer_value(gold, names), answer_value(prediction, names)
    if gold_value is not None:
        return (pred_value, gold_value) if pred_value is not None else None
    # The gold is an equation or relation (a line, a plane, a system): the prediction must be one of the same shape.
    # math-verify compares only the last part of a chain without commas (a=b=c), so chains are not compared.
    pred_sides, gold_sides = equation_sides(prediction), equation_sides(gold)
    if len(pred_sides) != len(gold_sides) or (len(gold_sides) > 2 and "," not in gold and ";" not in gold):
        return None
    return prediction, gold


def math_verify_equivalent(prediction: str, gold: str) -> bool:
    """math-verify's verdict on an untrusted ``prediction`` (see the module docstring for what it must satisfy first);
    an ImportError with the install line when math-verify is missing."""
    mv = _math_verify()
    problem = work_problem(prediction)
    if problem is not None:
        log.debug("math answer not compared symbolically: %s", problem)
        return False
    pair = _comparable(prediction, gold)
    if pair is None:
        return False
    gold_parsed = _parse_gold(mv, pair[1])
    if not gold_parsed:
        return False
    pred_parsed = _parse_prediction(mv, pair[0])
    if not pred_parsed:
        return False
    return bool(mv.verify(gold_parsed, pred_parsed, timeout_seconds=None))


def answers_equivalent(prediction: Optional[str], gold: str) -> bool:
    from .answer_words import combining_mark, spelled_values
    if prediction is None or not prediction.strip():
        return False
    if len(prediction) > MAX_ANSWER_CHARS:  # bounded before any normalisation (see math_bounds)
        return False
    if combining_mark(prediction) is not None and combining_mark(gold) is None:
        return False  # "7" with a combining overlay (U+0338: "not 7") is not 7
    prediction, gold = spelled_values(prediction), spelled_values(gold)  # "7 hundred" is 700, not 7 and a unit
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
    _math_verify()  # refuse to grade at all without it, not only on answers the strings cannot settle
    gold = gold_answer(example)
    prediction = extract_answer(completion, allow_last_number=allows_last_number(example))
    return 1.0 if answers_equivalent(prediction, gold) else 0.0


def warm_up() -> None:
    """Import math-verify and build its parser tables (pool workers call this before taking items,
    so the first item's deadline does not pay for the imports)."""
    answers_equivalent("\\frac{1}{2}", "0.5")
    answers_equivalent("x+1", "1+x")
