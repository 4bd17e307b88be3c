"""The math grader against answers an RL policy could find: wrong answers that must score 0, inputs that would stall
the grader (each is refused before any symbolic work and finishes far inside the per-item deadline), and legitimate
forms that must still score 1."""
import sys

import pytest

from dare.rewards import get_reward, score_batch
from dare.rewards import math_reward as math_module
from dare.rewards.extract import boxed_contents, last_boxed
from dare.rewards.math_bounds import MAX_ANSWER_CHARS, MAX_DIGITS, MAX_NESTING, work_problem

math_reward = get_reward("math")


def ex(gold, task="math"):
    return {"task": task, "ground_truth": gold}


# ------------------------------------------------------------------------------------------ wrong answers
@pytest.mark.parametrize("completion, gold", [
    ("\\boxed{3=7}", "7"), ("\\boxed{10=7}", "7"), ("\\boxed{ab=7}", "7"), ("\\boxed{-3=7}", "7"),
    ("<answer>ab=7</answer>", "7"), ("<answer>-3=7</answer>", "7"),
    ("\\boxed{3=5=7}", "7"), ("\\boxed{\\pi = 7}", "7"), ("\\boxed{f(x) = 7}", "7"),   # chains, constants, calls
    ("\\boxed{7 \\vee 8}", "8"), ("\\boxed{7 \\lor 8}", "8"), ("\\boxed{7 \\wedge 8}", "8"), ("\\boxed{7 \\land 8}", "8"),
    ("\\boxed{7 \\cup 8}", "8"), ("\\boxed{7 \\to 8}", "8"), ("\\boxed{7 \\implies 8}", "8"), ("\\boxed{7 & 8}", "8"),
    ("\\boxed{7 \\in 8}", "8"), ("\\boxed{7 \\mid 8}", "8"), ("\\boxed{7 \\frac 8}", "8"), ("\\boxed{\\cdot 8}", "8"),
])
def test_wrong_answers_score_zero(completion, gold):
    assert math_reward(completion, ex(gold)) == 0.0


@pytest.mark.parametrize("completion, gold", [
    ("\\boxed{x=7}", "7"), ("\\boxed{x_1 = 7}", "7"), ("\\boxed{\\theta = 7}", "7"), ("\\boxed{k = \\frac{7}{2}}", "3.5"),
    ("\\boxed{12+12\\sqrt{3}}", "AB=12+12\\sqrt{3}"), ("\\boxed{AB = 12 + 12\\sqrt3}", "AB=12+12\\sqrt{3}"),
    ("\\boxed{2x+3}", "y = 2x + 3"), ("\\boxed{y=2x+3}", "y = 2x + 3"),
    ("\\boxed{5x - 7y + 11z + 4 = 0}", "5x - 7y + 11z + 4 = 0"),
    ("\\boxed{(-\\infty, 2) \\cup (3, \\infty)}", "(-\\infty,2)\\cup(3,\\infty)"),   # a connective the gold has too
])
def test_equations_and_unions_that_are_answers_still_score_one(completion, gold):
    assert math_reward(completion, ex(gold)) == 1.0


def test_an_equation_gold_is_not_matched_by_one_side_of_it():
    assert math_reward("\\boxed{0}", ex("x + y + z = 0")) == 0.0
    assert math_reward("\\boxed{x + y = 0}", ex("x + y + z = 0")) == 0.0


# ----------------------------------------------------------------------------------------------- stalls
STALLS = {
    "power tower 10^10^10": "\\boxed{10^{10^{10}}}",
    "power tower 2^2^30": "\\boxed{2^{2^{30}}}",
    "factorial of a googol": "\\boxed{(10^{100})!}",
    "3,000 nested parentheses": "\\boxed{" + "(" * 3000 + "7" + ")" * 3000 + "}",
    "20,000 unclosed boxes": "\\boxed{" * 20000,
    "huge binomial": "\\boxed{\\binom{10^{100}}{10^{50}}}",
    "tower in a sum": "\\boxed{1 + 9^{9^{9^{9}}}}",
    "power of a power": "\\boxed{(10^{999})^{99999}}",
}


@pytest.mark.parametrize("case", sorted(STALLS))
def test_stall_cases_are_refused_before_any_symbolic_work(case, monkeypatch):
    def no_sympy(*args, **kwargs):
        raise AssertionError("math-verify was asked to parse an answer whose work is unbounded")

    monkeypatch.setattr(math_module, "_math_verify", lambda: type("MV", (), {"parse": no_sympy, "verify": no_sympy}))
    assert math_reward(STALLS[case], ex("7")) == 0.0


def test_stall_cases_finish_inside_the_deadline_with_no_timeout():
    """The documented bound: every item's work is bounded before it starts. With a 3 s deadline (each of these
    ran into the 12 s deadline before, and the unclosed boxes took 9.5 s in extraction alone) all score a plain 0."""
    cases = list(STALLS.values()) * 2
    results = score_batch("math", cases, [ex("7")] * len(cases), timeout=3.0, workers=2)
    assert [(r.score, r.reason) for r in results] == [(0.0, None)] * len(cases)


def test_the_bounds_name_what_they_refuse():
    assert "characters" in work_problem("1" * (MAX_ANSWER_CHARS + 1))
    assert "nested" in work_problem("(" * (MAX_NESTING + 1) + ")" * (MAX_NESTING + 1))
    assert "digits" in work_problem("10^{10^{10}}")
    assert "factorial" in work_problem("(10^{100})!")
    assert "binomial" in work_problem("\\binom{10^{100}}{10^{50}}")
    assert "terms" in work_problem("(x+1)^{10^{6}}") and "terms" in work_problem("(a+b+c+d+e+f)^{10}")
    for fine in ("2^{2^{3}}", "10^{100}", "1000!", "2^{2016}", "e^{x^2}", "x^{2n+1}", "\\binom{100}{50}", "3^{" + "9" * 3 + "}",
                 "\\frac{\\sqrt{3}}{2}", "(-\\infty, 2) \\cup (3, \\infty)", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"):
        assert work_problem(fine) is None, fine
    assert work_problem("10^{" + str(MAX_DIGITS - 1) + "}") is None
    assert "digits" in work_problem("10^{" + str(MAX_DIGITS + 1) + "}")


def test_box_extraction_is_linear_and_keeps_its_semantics():
    text = "\\boxed{" * 20000 + " then \\boxed{5} and \\fbox{\\frac{1}{2}} but \\boxedx and \\boxed 9."
    assert boxed_contents(text) == ["5", "\\frac{1}{2}", "9."]
    nested = "\\boxed{" * 5000 + "1" + "}" * 5000
    assert last_boxed(nested) is not None and boxed_contents("\\boxed{\\{1\\}} \\boxed{a{b}c}") == ["\\{1\\}", "a{b}c"]


# ------------------------------------------------------------------------------------------ legitimate forms
@pytest.mark.parametrize("completion, gold, task", [
    ("\\boxed{0.\\overline{3}}", "\\frac{1}{3}", "math"),
    ("\\boxed{0.1\\overline{6}}", "\\frac{1}{6}", "math"),
    ("\\boxed{1.\\overline{142857}}", "\\frac{8}{7}", "math"),
    ("<answer>1,250.50 dollars</answer>", "1250.5", "gsm8k"),
    ("\\boxed{1,250.50 \\text{ dollars}}", "1250.5", "math"),
    ("<answer>72 clips</answer>", "72", "gsm8k"),
])
def test_legitimate_forms_score_one(completion, gold, task):
    assert math_reward(completion, ex(gold, task)) == 1.0


@pytest.mark.parametrize("completion, gold", [
    ("\\boxed{0.\\overline{3}}", "0.3"), ("<answer>1,250.50 dollars</answer>", "1250"), ("\\boxed{2 \\pi}", "2"),
    ("\\boxed{2 \\sin}", "2"),
])
def test_their_near_misses_still_score_zero(completion, gold):
    assert math_reward(completion, ex(gold, "gsm8k")) == 0.0


# ------------------------------------------------------------------------------------------ math-verify
def test_the_math_reward_refuses_to_run_without_math_verify(monkeypatch):
    math_module._math_verify.cache_clear()
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify -> ImportError
    try:
        for answer in ("\\boxed{10^3}", "\\boxed{1000}"):  # whether or not the strings alone would settle it
            with pytest.raises(ImportError, match=r"pip install 'math-verify"):
                math_reward(answer, ex("1000"))
    finally:
        math_module._math_verify.cache_clear()


def test_math_verify_is_a_core_dependency():
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    core = re.search(r"^dependencies = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL).group(1)
    assert re.search(r'^\s*"math-verify>=', core, re.MULTILINE)
