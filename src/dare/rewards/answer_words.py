"""Words that change an answer's value, and marks that change a symbol: what the unit stripping must not drop.

``strip_answer`` drops a trailing word as a unit ("5 apples" is 5), which made "7 hundred", "3 dozen", "7 squared"
and "7 halves" grade as 7 / 3 (math-verify reads them the same way). ``spelled_values`` writes such a number out
first ("700", "36", "7^{2}", "\\frac{7}{2}"), so both the string comparison and math-verify see the value the words
state. A combining mark over a digit or symbol ("7" + U+0338, a struck-through 7: "not 7") is not the symbol:
``combining_mark`` finds one (after NFC, so an accented letter written in two code points is one letter).
"""
from __future__ import annotations

import re
import unicodedata
from fractions import Fraction
from typing import Optional

MULTIPLIERS = {"hundred": 100, "thousand": 1000, "million": 10 ** 6, "billion": 10 ** 9, "trillion": 10 ** 12,
               "dozen": 12}
POWERS = {"squared": 2, "cubed": 3}
DENOMINATORS = {"half": 2, "halve": 2, "third": 3, "fourth": 4,  # not "quarter": 3 quarters are also coins
                "fifth": 5, "sixth": 6, "seventh": 7,
                "eighth": 8, "ninth": 9, "tenth": 10, "hundredth": 100, "thousandth": 1000}
_WORDS = "|".join(sorted({*MULTIPLIERS, *POWERS, *DENOMINATORS}, key=len, reverse=True))
# a number, then the word (with a space, or in a LaTeX text command: "7 \\text{ hundred}")
_SPELLED = re.compile(r"(?<![\w.,])(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?:[ \t]+|[ \t]*\\(?:text|mbox|mathrm)\{[ \t]*)("
                      + _WORDS + r")(s?)(?![A-Za-z])(?:[ \t]*\})?", re.IGNORECASE)


def _written(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _replace(match: re.Match) -> str:
    number, word = Fraction(match.group(1).replace(",", "")), match.group(2).lower()
    if word in MULTIPLIERS:
        return _written(number * MULTIPLIERS[word])
    if word in POWERS:
        return f"{match.group(1)}^{{{POWERS[word]}}}"
    return _written(number / DENOMINATORS[word])


def spelled_values(text: str) -> str:
    """``text`` with each number followed by a value word written as the value ("7 hundred" -> "700",
    "1.5 million" -> "1500000", "3 dozen" -> "36", "7 squared" -> "7^{2}", "7 halves" -> "\\frac{7}{2}")."""
    return _SPELLED.sub(_replace, text) if any(c.isdigit() for c in text) else text


def combining_mark(text: str) -> Optional[str]:
    """The first combining mark left in ``text`` after NFC composition ("U+0338"), else None."""
    for ch in unicodedata.normalize("NFC", text):
        if unicodedata.combining(ch):
            return f"U+{ord(ch):04X}"
    return None
