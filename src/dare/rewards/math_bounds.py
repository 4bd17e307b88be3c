"""A bound on the work one math answer may cost, checked before any symbolic work starts.

math-verify hands answers to sympy, which evaluates integer arithmetic eagerly: ``10^{10^{10}}`` (20 characters) asks
for a number of ten billion digits, ``(10^{100})!`` for a factorial no computer finishes, and a few thousand nested
parentheses send the LaTeX parser into deep recursion. A deadline kills such an item eventually, but it holds a
worker (and the batch) for the whole deadline. ``work_problem`` refuses these shapes up front, in time linear in the
answer's length:

* at most ``MAX_ANSWER_CHARS`` characters (the longest MATH gold answer has about 160) and ``MAX_NESTING`` levels of
  brackets (MATH golds reach 3);
* every number the answer asks sympy to build stays under ``MAX_DIGITS`` digits: powers of numbers (towers included,
  sizes are tracked through exponents), factorials and binomials of numbers are estimated from the digits of their
  arguments, without computing them;
* the full expansion of the answer has at most ``MAX_TERMS`` terms: sympy's simplification expands powers of sums
  (``(a+b+c+d+e+f)^{10}``, 21 characters, is 3,003 terms and took 11 s; measured cost about 2.5 ms per term).

The estimate is deliberately generous (an upper bound: a sum counts like a product), so a refused answer is one whose
value has, or may have, more digits than any benchmark answer; the per-item deadline stays as the last line.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

MAX_ANSWER_CHARS = 1000
MAX_NESTING = 20
MAX_DIGITS = 10_000
MAX_TERMS = 100

_TOKEN = re.compile(r"\\[A-Za-z]+|\\.|\d+(?:\.\d*)?|\.\d+|\s+|.", re.DOTALL)
_FRACTIONS = {"\\frac", "\\dfrac", "\\tfrac", "\\cfrac"}
_BINOMIALS = {"\\binom", "\\dbinom", "\\tbinom"}
_SUMS = {"+", "-", "\\pm", "\\mp"}
_PRODUCTS = {"*", "/", "\\cdot", "\\times", "\\div", "\\ast"}
# Layout that neither separates nor multiplies: sizing commands and LaTeX spacing.
_IGNORED = {"\\left", "\\right", "\\big", "\\Big", "\\bigg", "\\Bigg", "\\bigl", "\\bigr", "\\Bigl", "\\Bigr",
            "\\,", "\\;", "\\!", "\\ ", "\\quad", "\\qquad", "$", "'"}
_OPENERS, _CLOSERS = "({[", ")}]"


class _Refused(Exception):
    """The answer asks for more work than the bounds allow (the message says what)."""


@dataclass(frozen=True)
class _Size:
    exact: bool  # integers and fractions only: sympy evaluates it to one number, eagerly
    digits: float  # an upper bound on log10 of the numbers it builds (0 for a symbol)
    terms: float  # an upper bound on the terms of its full expansion


_SYMBOL = _Size(False, 0.0, 1.0)


def work_problem(answer: str) -> Optional[str]:
    """Why grading ``answer`` symbolically could take unbounded work (one line), or None when it is within the bounds."""
    if len(answer) > MAX_ANSWER_CHARS:
        return f"the answer has {len(answer):,} characters (more than {MAX_ANSWER_CHARS})"
    depth = deepest = 0
    for ch in answer:
        if ch in _OPENERS:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in _CLOSERS:
            depth = max(0, depth - 1)
    if deepest > MAX_NESTING:
        return f"the answer is nested {deepest} brackets deep (more than {MAX_NESTING})"
    tokens = [t for t in _TOKEN.findall(answer) if not t.isspace()]
    scanner = _Scanner(tokens)
    try:
        while scanner.i < len(tokens):  # a stray closing bracket ends one sequence, not the scan
            scanner.sequence()
    except _Refused as refused:
        return str(refused)
    return None


def _number(token: str) -> _Size:
    digits = token.replace(".", "").lstrip("0")
    fraction = len(token.split(".", 1)[1]) if "." in token else 0
    size = len(digits) if len(digits) > 15 else math.log10(max(1, int(digits or "0")))
    return _Size(True, max(size, float(fraction)), 1.0)


def _checked(size: _Size) -> _Size:
    if size.terms > MAX_TERMS:
        raise _Refused(f"an expansion of up to {size.terms:.3g} terms (more than {MAX_TERMS})")
    return size


def _product(parts: list[_Size]) -> _Size:
    exact = all(p.exact for p in parts)
    return _checked(_Size(exact, sum(p.digits for p in parts), 1.0 if exact else math.prod(p.terms for p in parts)))


def _sum(parts: list[_Size]) -> _Size:
    exact = all(p.exact for p in parts)
    return _checked(_Size(exact, sum(p.digits for p in parts), 1.0 if exact else sum(p.terms for p in parts)))


class _Scanner:
    """A forgiving left-to-right reading of LaTeX that tracks sizes only (no grammar is enforced: a malformed answer
    is math-verify's problem, an expensive one is ours). Inside a bracket, ``+``/``-`` separate summands, adjacency
    and ``\\cdot`` multiply, and anything else (``,``, ``=``, ``&``, relations) separates independent pieces."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.i = tokens, 0

    def _peek(self) -> Optional[str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def sequence(self) -> _Size:
        """Items up to the next closing bracket (consumed) or the end; ``a \\choose b`` is a binomial."""
        pieces: list[_Size] = []
        summands: list[_Size] = []
        factors: list[_Size] = []
        chose: Optional[_Size] = None

        def close_summand():
            if factors:
                summands.append(_product(factors))
                factors.clear()

        def close_piece():
            close_summand()
            if summands:
                pieces.append(_sum(summands))
                summands.clear()

        while True:
            token = self._peek()
            if token is None or token in _CLOSERS:
                self.i += token is not None
                break
            if token == "\\choose":
                self.i += 1
                close_piece()
                chose, pieces = _pieces(pieces), []
            elif token in _SUMS:
                self.i += 1
                close_summand()
            elif token in _PRODUCTS or token in _IGNORED:
                self.i += 1
            elif self._starts_item(token):
                factors.append(self.postfix(self.item()))
            else:
                self.i += 1
                close_piece()
        close_piece()
        whole = _pieces(pieces)
        return _binomial(chose, whole) if chose is not None else whole

    @staticmethod
    def _starts_item(token: str) -> bool:
        return (token in _OPENERS or token[0].isdecimal() or (token[0] == "." and len(token) > 1) or token.isalpha()
                or (token[0] == "\\" and len(token) > 2))

    def argument(self) -> _Size:
        """A command's argument: a bracketed group or one token."""
        token = self._peek()
        if token is None:
            return _SYMBOL
        if self._starts_item(token):
            return self.item()
        self.i += 1
        return _SYMBOL

    def item(self) -> _Size:
        token = self.tokens[self.i]
        self.i += 1
        if token in _OPENERS:
            return self.sequence()
        if token[0].isdecimal() or token[0] == ".":
            return _number(token)
        if token in _FRACTIONS:
            top, bottom = self.argument(), self.argument()
            return _Size(top.exact and bottom.exact, top.digits + bottom.digits,
                         1.0 if top.exact and bottom.exact else top.terms + bottom.terms)
        if token == "\\sqrt":
            if self._peek() == "[":
                self.i += 1
                self.sequence()
            inner = self.argument()
            return _Size(False, inner.digits / 2, 1.0)  # an irrational stays a symbol in sympy
        if token in _BINOMIALS:
            return _binomial(self.argument(), self.argument())
        return _SYMBOL  # a letter, constant, function or font command (its braced argument is scanned next)

    def postfix(self, base: _Size) -> _Size:
        while True:
            token = self._peek()
            if token == "^":
                self.i += 1
                base = _power(base, self.argument())
            elif token == "_":
                self.i += 1
                self.argument()  # a label; still scanned, so a tower hidden in it is caught
            elif token == "!":
                self.i += 1
                base = _factorial(base)
            elif token == "'":
                self.i += 1
            else:
                return base


def _pieces(pieces: list[_Size]) -> _Size:
    if not pieces:
        return _SYMBOL
    exact = all(p.exact for p in pieces)
    return _Size(exact, sum(p.digits for p in pieces), max(p.terms for p in pieces))


def _value_bound(size: _Size) -> float:
    """An upper bound on the absolute value of an exact quantity of ``size``."""
    return math.inf if size.digits > 300 else 10.0 ** size.digits


def _power(base: _Size, exponent: _Size) -> _Size:
    if not exponent.exact:
        return _Size(False, base.digits, base.terms)  # a symbolic exponent: nothing to evaluate or expand
    value = _value_bound(exponent)
    digits = value * base.digits if base.digits else 0.0
    if digits > MAX_DIGITS:
        raise _Refused(f"a power with numbers of up to {digits:.3g} digits (more than {MAX_DIGITS})")
    terms = 1.0 if base.exact or base.terms <= 1 else _multinomial_terms(value, base.terms)
    return _checked(_Size(base.exact, digits, terms))


def _multinomial_terms(n: float, k: float) -> float:
    """Terms of ``(a_1 + ... + a_k)^n`` expanded: C(n + k - 1, k - 1), in floating point (inf when huge)."""
    if n > 1e6 or k > 1e6:
        return math.inf
    n, k = math.ceil(n - 1e-9), math.ceil(k - 1e-9)  # 10 ** log10(13) is 12.99...
    return math.exp(math.lgamma(n + k) - math.lgamma(k) - math.lgamma(n + 1))


def _factorial(base: _Size) -> _Size:
    if not base.exact:
        return base
    digits = _value_bound(base) * base.digits if base.digits else 0.0  # log10(n!) <= n log10(n)
    if digits > MAX_DIGITS:
        raise _Refused(f"a factorial of up to {digits:.3g} digits (more than {MAX_DIGITS})")
    return _Size(True, digits, 1.0)


def _binomial(top: _Size, bottom: _Size) -> _Size:
    if not (top.exact and bottom.exact):
        return _Size(False, top.digits + bottom.digits, top.terms + bottom.terms)
    digits = _value_bound(bottom) * top.digits if top.digits else 0.0  # C(n, k) <= n^k
    if digits > MAX_DIGITS:
        raise _Refused(f"a binomial coefficient of up to {digits:.3g} digits (more than {MAX_DIGITS})")
    return _Size(True, digits, 1.0)
