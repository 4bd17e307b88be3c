"""String-normalising answer comparison (the Hendrycks MATH ``strip_string`` / ``is_equiv`` idea).

Used two ways: as the fast first check before math-verify (most matches are plain strings or
numbers, which need no sympy), and as the whole grader when math-verify is not installed.
Our own implementation; the steps follow the published MATH grader's normalisations plus thousands
separators and exact numeric comparison of simple numbers and fractions.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

from .extract import boxed_contents

_TEXT_COMMANDS = ("\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\textit", "\\mbox")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_INT = re.compile(r"^-?\d+$")
_DECIMAL = re.compile(r"^-?(?:\d+\.?\d*|\.\d+)$")


def _unwrap_command(text: str, command: str) -> str:
    """Replace every ``\\command{x}`` by ``x`` (nested braces respected)."""
    out = []
    i = 0
    while True:
        pos = text.find(command + "{", i)
        if pos == -1:
            out.append(text[i:])
            return "".join(out)
        depth, j = 0, pos + len(command)
        while j < len(text):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        if depth != 0:  # unbalanced: leave the rest as is
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:pos])
        out.append(text[pos + len(command) + 1:j])
        i = j + 1


def _brace_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{b}`` -> ``\\frac{1}{b}`` (single-character arguments)."""
    def fix(match: re.Match) -> str:
        a, b = match.group(1), match.group(2)
        wrap = lambda s: s if s.startswith("{") else "{" + s + "}"  # noqa: E731
        return "\\frac" + wrap(a) + wrap(b)

    return re.sub(r"\\frac(\{[^{}]*\}|[^{\\\s])(\{[^{}]*\}|[^{\\\s])", fix, text)


def strip_answer(answer: str) -> str:
    """Canonical string form of an answer: drop dollars, spacing, units text, ``\\left``/``\\right``,
    degree and percent marks, ``x =`` prefixes; unify ``\\dfrac``/``\\tfrac``, brace fractions and
    square roots; remove thousands separators."""
    s = answer.strip()
    boxes = boxed_contents(s)
    if boxes and s.startswith(("\\boxed", "\\fbox")):
        s = boxes[-1]
    s = s.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("°", "")
    s = s.replace("\\$", "").replace("$", "")
    # Trailing units written as text with a leading space: "5 \text{ cm}" -> "5".
    s = re.sub(r"\\(?:text|mbox|mathrm)\{\s[^{}]*\}\s*$", "", s)
    for command in _TEXT_COMMANDS:
        s = _unwrap_command(s, command)
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip()
    # A short left-hand side such as "x = 5" or "k=3" names the answer; keep the value.
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2:
        s = parts[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _brace_fracs(s)
    s = s.rstrip(".")
    if s.startswith("."):
        s = "0" + s
    s = s.replace("{.", "{0.")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s


def numeric_value(answer: str) -> Optional[Fraction]:
    """Exact value of a normalised plain number, ``a/b`` or ``\\frac{a}{b}`` (None otherwise)."""
    s = answer
    negative = False
    if s.startswith("-") and (s.startswith("-\\frac") or s.count("/") == 1):
        negative, s = True, s[1:]
    frac = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(r"(-?[\d.]+)/(-?[\d.]+)", s)
    try:
        if frac:
            value = Fraction(frac.group(1)) / Fraction(frac.group(2))
        elif _DECIMAL.match(s):
            value = Fraction(s)
        else:
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return -value if negative else value


def strings_equivalent(prediction: Optional[str], gold: Optional[str]) -> bool:
    """True when both answers normalise to the same string or to the same exact number."""
    if prediction is None or gold is None:
        return False
    a, b = strip_answer(prediction), strip_answer(gold)
    if not a or not b:
        return False
    if a == b:
        return True
    va, vb = numeric_value(a), numeric_value(b)
    return va is not None and vb is not None and va == vb
