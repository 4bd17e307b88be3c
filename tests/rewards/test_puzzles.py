"""Countdown and Sudoku scored by d1's rules, the safe arithmetic evaluator, and the format terms."""
import json
import random
import warnings

import pytest

from dare.rewards import evaluate_arithmetic, get_reward

countdown = get_reward("countdown")
sudoku = get_reward("sudoku")

CD = {"task": "countdown", "ground_truth": {"numbers": [30, 100, 93], "target": 23}}


# ------------------------------------------------------------------------------------------ countdown
@pytest.mark.parametrize("completion, expected", [
    ("<answer>100 - 93 + 30 - 14</answer>", 0.1),            # extra number: multiset differs
    ("<reasoning>..</reasoning><answer>30 - (100 - 93)</answer>", 1.0),  # correct
    ("<answer>100 - (93 - 30)</answer>", 0.1),                # well-formed, wrong value (37)
    ("<answer>30 - 100 + 93 + 93 - 93</answer>", 0.1),         # reuses a number
    ("<answer>30 - (100 - 93) = 23</answer>", 0.1),           # "=" is an illegal character (and 23 extra)
    ("<answer>abs(30 - 100 + 93)</answer>", 0.1),             # illegal characters, right numbers
    ("<answer>30 - (100 - 93</answer>", 0.1),                 # syntax error
    ("<answer>30 / (100 - 100 + 0 * 93)</answer>", 0.1),       # wrong numbers anyway
    ("30 - (100 - 93)", 0.0),                                 # no answer block
    ("<answer>1</answer> then <answer>30 - (100 - 93)</answer>", 1.0),  # the last block counts
    ("<answer>30 - (100 - 93)</answer> then <answer>1</answer>", 0.1),
    ("<answer>\n30 - (100 -\n 93)\n</answer>", 1.0),          # newlines inside parentheses are fine
    ("<answer>30 - 100\n+ 93</answer>", 0.1),                 # ... outside they are a syntax error (eval)
    ("<answer></answer>", 0.1),                               # an empty answer is still an answer
])
def test_countdown_d1_rules(completion, expected):
    assert countdown(completion, CD) == pytest.approx(expected)


def test_countdown_division_and_tolerance():
    ex = {"task": "countdown", "ground_truth": {"numbers": [3, 4, 7], "target": 1}}
    assert countdown("<answer>(4 + 3) / 7</answer>", ex) == 1.0
    assert countdown("<answer>4 / (7 - 7 + 0)</answer>", ex) == 0.1  # wrong numbers
    ex0 = {"task": "countdown", "ground_truth": {"numbers": [3, 4, 0], "target": 1}}
    assert countdown("<answer>(3 + 4) / 0</answer>", ex0) == 0.1     # ZeroDivisionError -> format score
    ex3 = {"task": "countdown", "ground_truth": {"numbers": [1, 3, 3], "target": 0.333333333}}
    assert countdown("<answer>1 / 3 * 3 / 3</answer>", {"task": "countdown", "ground_truth": {"numbers": [1, 3, 3, 3], "target": 0.333333333}}) == 1.0
    assert countdown("<answer>1 / 3</answer>", ex3) == 0.1           # right value, missing a number


def test_countdown_accepts_json_and_string_numbers():
    as_json = {"task": "countdown", "ground_truth": json.dumps({"numbers": [30, 100, 93], "target": 23})}
    as_text = {"task": "countdown", "ground_truth": {"numbers": "[30, 100, 93]", "target": "23"}}
    for ex in (as_json, as_text):
        assert countdown("<answer>30 - (100 - 93)</answer>", ex) == 1.0
    with pytest.raises(KeyError, match="target"):
        countdown("<answer>1</answer>", {"task": "countdown", "ground_truth": {"numbers": [1]}})


def test_huge_power_is_rejected_not_computed():
    ex = {"task": "countdown", "ground_truth": {"numbers": [50, 99, 98], "target": 1}}
    assert countdown("<answer>50 ** 99 ** 98</answer>", ex) == 0.1  # eval would never finish


# ------------------------------------------------------------------------- evaluator = Python's eval
def _random_expression(rng: random.Random, depth: int = 0) -> str:
    choice = rng.random()
    if depth > 3 or choice < 0.3:
        return rng.choice(["0", "00", "7", "12", "3.5", ".25", "4.", "012", "100"])
    if choice < 0.45:
        return rng.choice(["-", "+", "- "]) + _random_expression(rng, depth + 1)
    if choice < 0.6:
        return "(" + rng.choice(["", " ", "\n"]) + _random_expression(rng, depth + 1) + ")"
    op = rng.choice(["+", "-", "*", "/", "//", "**", " * ", "- -", "*/", ""])
    return _random_expression(rng, depth + 1) + op + _random_expression(rng, depth + 1)


def _python_value(expr: str):
    # Test-only reference: our own generated strings, never model output.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # "'int' object is not callable" hints
            return ("ok", eval(expr, {"__builtins__": None}, {}))  # noqa: S307
    except Exception as err:  # noqa: BLE001
        return ("err", type(err).__name__)


def _our_value(expr: str):
    try:
        return ("ok", evaluate_arithmetic(expr))
    except Exception as err:  # noqa: BLE001
        return ("err", type(err).__name__)


def test_evaluator_matches_python_eval_on_random_expressions():
    rng = random.Random(1234)
    compared = errors = 0
    for _ in range(3000):
        expr = _random_expression(rng)
        ours = _our_value(expr)
        if ours == ("err", "OverflowError") and "**" in expr:
            continue  # our guard refused a huge integer power that eval would grind on (tested above)
        ref = _python_value(expr)
        if ref[0] == "ok":
            assert ours[0] == "ok", (expr, ref, ours)
            value, expected = ours[1], ref[1]
            assert type(value) is type(expected), (expr, value, expected)
            assert value == expected or (value != value and expected != expected), (expr, value, expected)
        else:
            # eval's SyntaxError / TypeError are ValueError for us. Our grammar is a subset of Python's
            # (no call syntax such as "(2)(1/0)"), so an arithmetic error of ours must be eval's too.
            assert ours[0] == "err", (expr, ref, ours)
            if ours[1] in ("ZeroDivisionError", "OverflowError"):
                assert ours[1] == ref[1], (expr, ref, ours)
            errors += ref[0] == "err"
        compared += 1
    assert compared > 2500 and errors > 100  # the generator hits both valid and invalid syntax


@pytest.mark.parametrize("expr, value", [("-2**2", -4), ("2**-1", 0.5), ("2**-2**2", 0.0625), ("7//2", 3),
                                         ("-7//2", -4), ("007.5", 7.5), ("00", 0), ("((1))", 1), ("1.", 1.0)])
def test_evaluator_python_semantics(expr, value):
    result = evaluate_arithmetic(expr)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize("expr", ["0123", "1 2", "1..2", "()", "(1", "1)", "1+", "*1", "2***2", "1\n+2", "1\x0b+2",
                                  "__import__('os')", "1e5", "٣+1"])
def test_evaluator_rejects_invalid(expr):
    with pytest.raises(ValueError):
        evaluate_arithmetic(expr)


# --------------------------------------------------------------------------------------------- sudoku
PUZZLE, SOLUTION = "3102200002100320", "3142243142131324"   # DARE's sudoku test row 0; 8 empty cells
SD = {"task": "sudoku", "ground_truth": {"puzzle": PUZZLE, "solution": SOLUTION}}


@pytest.mark.parametrize("completion, expected", [
    (f"<answer>{SOLUTION}</answer>", 1.0),
    ("<answer>\n3 1 4 2\n2 4 3 1\n4 2 1 3\n1 3 2 4\n</answer>", 1.0),     # separators ignored
    (f"<answer>{PUZZLE}</answer>", 0.0),                                  # copied the puzzle
    ("<answer>31422431421</answer>", 5 / 8),                             # too short: padded with 0
    (f"<answer>{SOLUTION}9999</answer>", 1.0),                           # too long: truncated
    ("<answer>3142 2431 4213 1323</answer>", 7 / 8),                     # one empty cell wrong
    ("<answer>3142 2431 4213 1424</answer>", 1.0),                       # wrong given cells do not count
    ("<answer>9999 9999 9999 9999</answer>", 0.0),
    (f"<answer>{SOLUTION}</answer> <answer>1111111111111111</answer>", 2 / 8),  # the last block counts
    (SOLUTION, 0.0),                                                     # no answer block
    ("<answer>no digits</answer>", 0.0),
])
def test_sudoku_partial_credit(completion, expected):
    assert sudoku(completion, SD) == pytest.approx(expected)


def test_sudoku_bad_ground_truth():
    with pytest.raises(ValueError, match="sudoku"):
        sudoku("<answer>1</answer>", {"task": "sudoku", "ground_truth": {"puzzle": "123", "solution": "123"}})


# -------------------------------------------------------------------------------------------- format
GOOD = "<reasoning>\nstep 1\nstep 2\n</reasoning>\n<answer>\n42\n</answer>\n"


@pytest.mark.parametrize("name, completion, expected", [
    ("format_strict", GOOD, 1.0),
    ("format_strict", GOOD.replace("<answer>\n", "<answer>"), 0.0),
    ("format_strict", "hi " + GOOD, 0.0),
    ("format", "<reasoning>x</reasoning> <answer>y</answer>", 1.0),
    ("format", "<reasoning>multi\nline</reasoning>\n\n<answer>y</answer> trailing", 1.0),
    ("format", "preamble <reasoning>x</reasoning><answer>y</answer>", 0.0),   # must start with the tags
    ("format", "<answer>y</answer>", 0.0),
    ("xml_count", GOOD, 1.0),
    ("xml_count", GOOD + "abc", 1.0 - 2 * 0.002 * 3),                  # trailing text is penalised
    ("xml_count", "<answer>y</answer>", 0.0),
    ("answer_int", GOOD, 1.0),
    ("answer_int", "<answer>4.5</answer>", 0.0),
    ("boxed_in_answer", "<answer>\\boxed{1}</answer>", 1.0),
    ("boxed_in_answer", "<answer>1</answer>", 0.75),
    ("boxed_in_answer", "\\boxed{1}", 0.5),
    ("boxed_in_answer", "1", 0.25),
])
def test_format_rewards(name, completion, expected):
    assert get_reward(name)(completion, {"task": "math", "ground_truth": "42"}) == pytest.approx(expected)
