"""Optional format terms for the ``<reasoning>...</reasoning><answer>...</answer>`` layout (d1 style).

Each returns a score in [0, 1]; d1 adds these terms with weight 0.5 (its functions return 0.5 on a
match), so ``{"math": 1.0, "format": 0.5}`` reproduces a d1 combination. Use them as extra terms
of a weighted reward; they never look at ``ground_truth``.
"""
from __future__ import annotations

import re

from .registry import register_reward

# Same patterns as d1 (re.DOTALL so multi-line reasoning matches).
_STRICT = re.compile(r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$", re.DOTALL)
_SOFT = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)


@register_reward("format")
def soft_format_reward(completion: str, example: dict) -> float:
    """1.0 if the completion starts with a reasoning block followed by an answer block."""
    return 1.0 if _SOFT.match(completion) else 0.0


@register_reward("format_strict")
def strict_format_reward(completion: str, example: dict) -> float:
    """1.0 only for the exact newline layout ``<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>\\n``."""
    return 1.0 if _STRICT.match(completion) else 0.0


@register_reward("xml_count")
def xml_count_reward(completion: str, example: dict) -> float:
    """0.25 per well-placed tag (each present exactly once), minus 0.002 per character after the
    closing answer tag (d1's ``count_xml`` scaled by 2 so a perfect layout scores 1.0)."""
    text = completion
    score = 0.0
    if text.count("<reasoning>\n") == 1:
        score += 0.25
    if text.count("\n</reasoning>\n") == 1:
        score += 0.25
    if text.count("\n<answer>\n") == 1:
        score += 0.25 - 0.002 * len(text.split("\n</answer>\n")[-1])
    if text.count("\n</answer>") == 1:
        score += 0.25 - 0.002 * (len(text.split("\n</answer>")[-1]) - 1)
    return score


def _answer_text(completion: str) -> str:
    # d1's extract_xml_answer: after the last "<answer>", before the next "</answer>".
    return completion.split("<answer>")[-1].split("</answer>")[0].strip()


@register_reward("answer_int")
def answer_int_reward(completion: str, example: dict) -> float:
    """1.0 if the answer text is a bare non-negative integer (d1's GSM8K ``int_reward_func``)."""
    return 1.0 if _answer_text(completion).isdigit() else 0.0


@register_reward("boxed_in_answer")
def boxed_in_answer_reward(completion: str, example: dict) -> float:
    """d1's MATH format term, halved to [0.25, 1]: +0.5 when an ``<answer>`` block exists, then +0.5
    if ``\\boxed`` appears in it (in the whole text when there is no block), else +0.25. d1 adds its
    unhalved value with weight 0.5, i.e. this term with weight 1.0."""
    parts = completion.split("<answer>", 1)
    has_block = len(parts) == 2
    answer_text = parts[1].split("</answer>", 1)[0] if has_block else completion
    return (0.5 if has_block else 0.0) + (0.5 if "\\boxed" in answer_text else 0.25)
