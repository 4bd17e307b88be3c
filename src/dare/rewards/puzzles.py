"""Countdown and 4x4 Sudoku, scored exactly as d1 (diffu-grpo ``reward_func.py``) scores them.

Countdown: the expression in the last ``<answer>...</answer>`` must use exactly the given numbers
(sorted multisets equal, numbers read with ``\\d+``), contain only ``[\\d+\\-*/().\\s]`` and evaluate
to the target within 1e-5 -> 1.0; any other answer (wrong value, reused or missing number, illegal
character, syntax error, division by zero) -> 0.1; no answer block -> 0.0.

d1 evaluates the expression with Python ``eval``. We never eval model output: ``evaluate_arithmetic``
is a small recursive-descent parser that follows Python's grammar and number semantics for that
character set (``**``, ``//``, unary signs, int/float literals, newlines only inside parentheses),
so every expression gets the value ``eval`` would give. One deliberate difference: powers whose
result would exceed ~4096 bits raise instead of hanging the scorer (``50**99**98``); such an
answer scores 0.1, the "wrong value" score it would get if eval ever finished.

Sudoku: digits of the last ``<answer>`` block, padded with "0" / truncated to 16; the reward is the
fraction of the puzzle's empty cells ("0") that now hold the solution's digit. (9x9 puzzles, 81
characters, are scored by the same rule with 81 cells; d1 only has 4x4.)
"""
from __future__ import annotations

import math
import operator
import re
from typing import Optional, Union

from .registry import ground_truth_dict, register_reward

Number = Union[int, float, complex]

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")
_NUMBER_LITERAL = re.compile(r"[0-9]*\.[0-9]*|[0-9]+")  # ASCII only, as Python literals
_MAX_POWER_BITS = 4096
_MAX_NESTING = 200  # CPython's parser stops at 200 nested parentheses as well


def last_answer_block(text: str) -> Optional[str]:
    """Stripped content of the last closed ``<answer>`` block (d1's ``extract_solution``), or None."""
    blocks = _ANSWER_BLOCK.findall(text)
    return blocks[-1].strip() if blocks else None


class ExpressionSyntaxError(ValueError):
    """The expression is not valid Python arithmetic (a SyntaxError for ``eval``)."""


def _tokenize(expr: str) -> list[str]:
    tokens: list[str] = []
    depth = 0
    i, n = 0, len(expr)
    while i < n:
        ch = expr[i]
        if ch in " \t\f":
            i += 1
        elif ch in "\r\n":
            # A newline ends the logical line unless it sits inside brackets (Python tokenizer rule).
            if depth == 0:
                raise ExpressionSyntaxError("newline outside parentheses")
            i += 1
        elif ch in "0123456789" or (ch == "." and i + 1 < n and expr[i + 1] in "0123456789"):
            match = _NUMBER_LITERAL.match(expr, i)
            literal = match.group(0)
            if "." not in literal and len(literal) > 1 and literal[0] == "0" and literal.strip("0"):
                raise ExpressionSyntaxError(f"leading zeros in integer literal {literal!r}")
            tokens.append(literal)
            i = match.end()
        elif expr.startswith("**", i) or expr.startswith("//", i):
            tokens.append(expr[i:i + 2])
            i += 2
        elif ch in "+-*/":
            tokens.append(ch)
            i += 1
        elif ch in "()":
            depth += 1 if ch == "(" else -1
            if depth < 0:
                raise ExpressionSyntaxError("unbalanced ')'")
            tokens.append(ch)
            i += 1
        else:
            raise ExpressionSyntaxError(f"character {ch!r} is not arithmetic")
    return tokens


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log2(abs(base)) > _MAX_POWER_BITS:
            raise OverflowError("power too large to evaluate")
    return operator.pow(base, exponent)


_BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv}


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/'|'//') factor)* ;
    factor := ('+'|'-') factor | power ; power := atom ['**' factor] ; atom := NUMBER | '(' expr ')'."""

    def __init__(self, tokens: list[str], compute: bool):
        # With compute=False the parse only checks syntax (every value is 0): Python reports a
        # syntax error before evaluating anything, so we parse once dry, then again for real.
        self.tokens, self.pos, self.nesting, self.compute = tokens, 0, 0, compute

    def apply(self, op: str, *args: Number) -> Number:
        if not self.compute:
            return 0
        if op == "**":
            return _power(*args)
        if len(args) == 1:
            return operator.neg(args[0]) if op == "-" else operator.pos(args[0])
        return _BINARY[op](*args)

    def peek(self) -> Optional[str]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ExpressionSyntaxError("unexpected end of expression")
        self.pos += 1
        return token

    def expr(self) -> Number:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            value = self.apply(op, value, self.term())
        return value

    def term(self) -> Number:
        value = self.factor()
        while self.peek() in ("*", "/", "//"):
            op = self.take()
            value = self.apply(op, value, self.factor())
        return value

    def factor(self) -> Number:
        if self.peek() in ("+", "-"):
            sign = self.take()
            self.nesting += 1  # "----1" recurses too; bound it like parentheses
            if self.nesting > 4 * _MAX_NESTING:
                raise ExpressionSyntaxError("expression nested too deeply")
            value = self.factor()
            self.nesting -= 1
            return self.apply(sign, value)
        return self.power()

    def power(self) -> Number:
        base = self.atom()
        if self.peek() == "**":
            self.take()
            return self.apply("**", base, self.factor())
        return base

    def atom(self) -> Number:
        token = self.take()
        if token == "(":
            self.nesting += 1
            if self.nesting > _MAX_NESTING:
                raise ExpressionSyntaxError("too many nested parentheses")
            value = self.expr()
            if self.take() != ")":
                raise ExpressionSyntaxError("expected ')'")
            self.nesting -= 1
            return value
        if token[0] in "0123456789.":
            return float(token) if "." in token else int(token)
        raise ExpressionSyntaxError(f"unexpected {token!r}")


def evaluate_arithmetic(expr: str) -> Number:
    """Value of ``expr`` as Python's ``eval`` would compute it, for the Countdown character set.
    Raises ``ValueError`` for invalid syntax, ``ZeroDivisionError`` / ``OverflowError`` as eval would."""
    tokens = _tokenize(expr.strip(" \t\f"))
    if not tokens:
        raise ExpressionSyntaxError("empty expression")
    for compute in (False, True):
        parser = _Parser(tokens, compute)
        value = parser.expr()
        if parser.peek() is not None:
            raise ExpressionSyntaxError(f"unexpected {parser.peek()!r}")
    return value


def _uses_exactly(expr: str, numbers: list[int]) -> bool:
    return sorted(int(n) for n in re.findall(r"\d+", expr)) == sorted(numbers)


def countdown_score(completion: str, numbers: list[int], target: float, *, format_score: float = 0.1,
                    score: float = 1.0) -> float:
    equation = last_answer_block(completion)
    if equation is None:
        return 0.0
    if not _uses_exactly(equation, numbers) or not _ALLOWED.match(equation):
        return format_score
    try:
        result = evaluate_arithmetic(equation)
        return score if abs(result - target) < 1e-5 else format_score
    except Exception:  # d1 scores every evaluation failure as a well-formed wrong answer
        return format_score


def _int_list(value, what: str) -> list[int]:
    if isinstance(value, str):
        value = [v for v in re.split(r"[\s,\[\]]+", value) if v]
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError):
        raise ValueError(f"countdown ground_truth[{what!r}] must be a list of integers, got {value!r}") from None


@register_reward("countdown")
def countdown_reward(completion: str, example: dict) -> float:
    gt = ground_truth_dict(example, ("numbers", "target"))
    numbers = _int_list(gt["numbers"], "numbers")
    try:
        target = float(gt["target"])
    except (TypeError, ValueError):
        raise ValueError(f"countdown ground_truth['target'] must be a number, got {gt['target']!r}") from None
    return countdown_score(completion, numbers, target)


def sudoku_score(completion: str, puzzle: str, solution: str) -> float:
    block = last_answer_block(completion)
    if block is None:
        return 0.0
    digits = "".join(ch for ch in block if ch.isdigit())
    if not digits:
        return 0.0
    size = len(puzzle)
    digits = (digits + "0" * size)[:size]
    empty = [i for i in range(size) if puzzle[i] == "0"]
    if not empty:
        return 0.0
    return sum(digits[i] == solution[i] for i in empty) / len(empty)


def _grid(value) -> str:
    if isinstance(value, (list, tuple)):
        return "".join(str(v) for v in value)
    return str(value).strip()


@register_reward("sudoku")
def sudoku_reward(completion: str, example: dict) -> float:
    gt = ground_truth_dict(example, ("puzzle", "solution"))
    puzzle, solution = _grid(gt["puzzle"]), _grid(gt["solution"])
    if len(puzzle) not in (16, 81) or len(solution) != len(puzzle):
        raise ValueError(f"sudoku ground_truth needs 'puzzle' and 'solution' of 16 (4x4) or 81 (9x9) characters, "
                         f"got {puzzle!r} / {solution!r}")
    return sudoku_score(completion, puzzle, solution)
