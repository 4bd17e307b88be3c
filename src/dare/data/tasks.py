"""Per-task helpers shared by loaders and templates: canonical problem text, gold answers, and solvers.

The canonical question of a structured task (countdown, sudoku) is built from its ground truth, so the d1
JSONL/CSV files and DARE's parquet copies of the same items give identical examples.
"""
from __future__ import annotations

import ast
import builtins
import itertools
import re
from fractions import Fraction
from typing import Optional

COUNTDOWN_RULES = ("You must use all numbers from the list, and each number must be used exactly once. "
                   "You may use the operations +, -, *, and / as needed.")


def countdown_question(numbers: list[int], target: int) -> str:
    return (f"Using only the numbers {list(numbers)}, create an arithmetic expression that evaluates to exactly "
            f"{target}. {COUNTDOWN_RULES}")


def sudoku_question(puzzle: str) -> str:
    return f"Solve the following Sudoku puzzle: {puzzle}"


# --- countdown: brute force over orderings, operators and bracketings ---------------------------------
_OPS = ("+", "-", "*", "/")


def _combine(a: Fraction, b: Fraction, op: str) -> Optional[Fraction]:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b if b != 0 else None


_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3


def _wrap(expr: str, need: bool) -> str:
    return f"({expr})" if need else expr


def _join(a: tuple, b: tuple, op: str) -> str:
    """``a op b`` with only the brackets precedence needs (``a-(b-c)`` keeps them, ``a+b*c`` needs none)."""
    p = _PREC[op]
    left = _wrap(a[1], a[2] < p)
    right = _wrap(b[1], b[2] < p or (b[2] == p and op in "-/"))
    return f"{left}{op}{right}"


def _expressions(items: list[tuple[Fraction, str, int]]):
    """Every (value, expression, precedence) reachable by repeatedly combining two items (all bracketings)."""
    if len(items) == 1:
        yield items[0]
        return
    for i, j in itertools.permutations(range(len(items)), 2):
        a, b = items[i], items[j]
        rest = [items[k] for k in range(len(items)) if k not in (i, j)]
        for op in _OPS:
            if op in "+*" and i > j:  # commutative: (a op b) was already tried as (b op a)
                continue
            value = _combine(a[0], b[0], op)
            if value is None:
                continue
            yield from _expressions(rest + [(value, _join(a, b, op), _PREC[op])])


def solve_countdown(numbers: list[int], target: int) -> Optional[str]:
    """An expression using every number exactly once with + - * / that equals ``target``, or None.

    Exact rational arithmetic (no float round-off), minimal brackets. Candidates are tried in a fixed
    order, so the answer is deterministic.
    """
    leaves = [(Fraction(n), str(n), _ATOM) for n in numbers]
    for value, expr, _ in _expressions(leaves):
        if value == target:
            return expr
    return None


def eval_countdown(expr: str) -> Optional[Fraction]:
    """Evaluate an arithmetic expression of ints, + - * / and brackets exactly (None when invalid)."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            return a / b  # ZeroDivisionError for b == 0
        raise ValueError(f"unsupported syntax {ast.dump(node)}")

    try:
        return ev(tree)
    except (ValueError, ZeroDivisionError):
        return None


# --- math --------------------------------------------------------------------------------------------
def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += text[j] == "{"
        depth -= text[j] == "}"
        if depth == 0:
            return text[i + 1:j]
    return None


def gsm8k_final_answer(answer: str) -> Optional[str]:
    """The gold of a GSM8K ``answer`` field: the text after the last ``####`` (kept as written, e.g. ``2,125``,
    exactly as DARE's parquet stores it; reward functions normalise separators)."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip()


def gsm8k_reasoning(answer: str) -> str:
    """The worked solution of a GSM8K answer without the ``#### N`` line and the ``<<calc>>`` annotations."""
    body = answer.rsplit("####", 1)[0]
    return re.sub(r"<<[^>]*>>", "", body).strip()


# --- code --------------------------------------------------------------------------------------------
_NOT_ENTRY = set(dir(builtins)) | {"math", "isclose", "assert", "not", "and", "or", "in", "is"}


def entry_point_from_asserts(tests: list[str]) -> Optional[str]:
    """The function under test in MBPP-style asserts: the first called name that is not a builtin."""
    for test in tests:
        for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(", test):
            if name not in _NOT_ENTRY:
                return name
    return None


def last_top_level_def(code: str) -> Optional[str]:
    """HumanEval's entry point is the last top-level function of its prompt (true for all 164 problems)."""
    names = re.findall(r"^def\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(", code, flags=re.M)
    return names[-1] if names else None


def humaneval_tests(test: str, entry_point: str) -> str:
    """HumanEval's ``check(candidate)`` test plus the call that runs it on the solution."""
    return f"{test.rstrip()}\n\n\ncheck({entry_point})\n"
