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

from .extract import boxed_spans

_TEXT_COMMANDS = ("\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\textit", "\\mbox")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_INT = re.compile(r"^-?\d+$")
_DECIMAL = re.compile(r"^-?(?:\d+\.?\d*|\.\d+)$")
# A repeating decimal: 0.\overline{3}, 0.1\overline{6}, 1.\bar{142857} (at most 50 digits each part).
_REPEATING = re.compile(r"^(-?)(\d{0,50})\.(\d{0,50})\\(?:overline|bar)\{(\d{1,50})\}$")
# "1,250.50 dollars": a number followed by plain words is a number with its unit. Words of 3+ letters, or a common
# 2-letter unit; never a function or constant name ("2 pi" is not 2), and never one letter ("5 x" is 5x).
_UNIT_TAIL = re.compile(r"^(-?(?:\d[\d,]*)?\.?\d+)\s+([A-Za-z]+(?:\s+[A-Za-z]+)*)$")
_TWO_LETTER_UNITS = {"cm", "mm", "km", "kg", "mg", "ml", "mL", "ft", "yd", "mi", "hr", "lb", "oz", "sq"}
_MATH_WORDS = {"pi", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "sqrt", "mod", "arcsin", "arccos",
               "arctan", "sinh", "cosh", "tanh", "and", "or", "not", "xor", "nor", "nand", "implies", "iff", "infinity",
               "inf", "infty", "choose", "over", "mul", "div", "plus", "minus", "times"}
# A variable, the only left-hand side that makes "lhs = value" an answer: one Latin letter or a Greek letter (not pi),
# optionally with a subscript and primes (x, k, x_1, a_{n}, \theta, y').
_GREEK = ("alpha|beta|gamma|delta|epsilon|varepsilon|zeta|eta|theta|vartheta|iota|kappa|lambda|mu|nu|xi|rho|varrho|"
          "sigma|varsigma|tau|upsilon|phi|varphi|chi|psi|omega|Gamma|Delta|Theta|Lambda|Xi|Sigma|Upsilon|Phi|Psi|Omega")
_VARIABLE = re.compile(r"(?:[A-Za-z]|\\(?:" + _GREEK + r"))(?:_(?:\{[A-Za-z0-9]{1,8}\}|[A-Za-z0-9]))?'*")
# A gold may name its quantity with a short name (AB = 12, CD = 4): the gold's own choice, so its value counts.
_NAME = re.compile(r"[A-Za-z]{1,3}")


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


def equation_sides(text: str) -> list[str]:
    """``text`` split at every ``=`` outside brackets (``<=``, ``>=``, ``!=`` and ``\\=`` are not equals signs)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "=" and depth == 0 and (i == 0 or text[i - 1] not in "<>!\\:"):
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def is_variable(text: str) -> bool:
    return _VARIABLE.fullmatch(text.strip()) is not None


def gold_name(gold: str) -> Optional[str]:
    """The left side of a gold written ``name = value`` with a variable or short name (``AB=12``), else None."""
    sides = equation_sides(gold)
    if len(sides) == 2 and (is_variable(sides[0]) or _NAME.fullmatch(sides[0].strip())):
        return sides[0].strip()
    return None


def answer_value(text: str, names: tuple = ()) -> Optional[str]:
    """The value an answer states: ``text`` itself without an ``=``, the right side of ``v = value`` when ``v`` is a
    variable (or one of ``names``, the gold's own name), else None: ``3=7``, ``ab=7`` or ``-3=7`` are not a 7 (an
    equation counts only when its left side is a variable), and a chain ``3=5=7`` is not either."""
    sides = equation_sides(text)
    if len(sides) == 1:
        return text
    lhs = sides[0].strip()
    if len(sides) == 2 and (is_variable(lhs) or lhs in names):
        return sides[1]
    return None


def _without_unit_words(s: str) -> str:
    match = _UNIT_TAIL.match(s)
    if match:
        words = match.group(2).split()
        if all((len(w) >= 3 or w in _TWO_LETTER_UNITS) and w.lower() not in _MATH_WORDS for w in words):
            return match.group(1)
    return s


def strip_answer(answer: str, names: tuple = ()) -> str:
    """Canonical string form of an answer: drop dollars, spacing, units text, ``\\left``/``\\right``,
    degree and percent marks, ``x =`` prefixes; unify ``\\dfrac``/``\\tfrac``, brace fractions and
    square roots; remove thousands separators."""
    s = answer.strip()
    if s.startswith(("\\boxed", "\\fbox")):
        spans = boxed_spans(s)
        if spans:
            s = s[spans[-1][0]:spans[-1][1]]
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
    s = _without_unit_words(s.strip())
    # "x = 5" (a variable, or the gold's own name for its quantity) states 5; any other equation stays whole.
    value = answer_value(s, names)
    if value is not None:
        s = value
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
    repeating = _REPEATING.match(s)
    if repeating:
        sign, whole, fixed, period = repeating.groups()
        value = (int(whole or "0") + Fraction(int(fixed or "0"), 10 ** len(fixed))
                 + Fraction(int(period), 10 ** len(fixed) * (10 ** len(period) - 1)))
        return -value if sign else value
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
    name = gold_name(gold)
    names = (name,) if name else ()
    a, b = strip_answer(prediction, names), strip_answer(gold, names)
    if not a or not b:
        return False
    if a == b:
        return True
    va, vb = numeric_value(a), numeric_value(b)
    return va is not None and vb is not None and va == vb
