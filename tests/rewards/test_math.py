"""Math answers: extraction edge cases, the string normaliser and math-verify equivalences."""
import pytest

from dare.rewards import answers_equivalent, extract_answer, get_reward, last_boxed, strings_equivalent, strip_answer
from dare.rewards.math_reward import gold_answer, math_verify_equivalent

math_reward = get_reward("math")


def ex(task, gold, **extra):
    return {"task": task, "ground_truth": gold, **extra}


# ----------------------------------------------------------------------------------------- extraction
@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{3} then finally \\boxed{5}", "5"),                         # the last box
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                               # nested braces
    ("\\boxed{\\left\\{ 1, 2 \\right\\}}", "\\left\\{ 1, 2 \\right\\}"),     # escaped braces are literal
    ("\\fbox{7}", "7"),
    ("answer: \\boxed 42.", "42."),                                           # \boxed without braces
    ("first \\boxed{4} then a cut \\boxed{\\frac{1}{", "4"),                  # unbalanced last box skipped
    ("\\boxed{}", None),                                                      # an empty box is no answer
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("text, allow_last, expected", [
    ("<reasoning>\\boxed{1}</reasoning><answer>\n 18 \n</answer>", False, "18"),  # the answer block wins
    ("<answer>The answer is \\boxed{x+1}</answer>", False, "x+1"),               # a box inside the block
    ("<answer>1</answer> retry <answer>2</answer>", False, "2"),                 # the last block
    ("<answer>\n 42 dollars", False, "42 dollars"),                               # unclosed block (truncated)
    ("Natalia sold 48 clips.\n#### 72\nsome trailing text", False, "72"),        # GSM8K ####
    ("it costs $1,250.50 in total", True, "1250.50"),                           # last number fallback
    ("it costs $1,250.50 in total", False, None),                                # ... only when allowed
    ("no digits at all", True, None),
    ("temperatures fell to -3 then to -7", True, "-7"),
])
def test_extract_answer(text, allow_last, expected):
    assert extract_answer(text, allow_last_number=allow_last) == expected


# ------------------------------------------------------------------------------------- normalisation
@pytest.mark.parametrize("a, b", [
    ("\\dfrac{1}{2}", "\\frac12"), ("\\frac{1}{2}", "0.5"), ("1,000", "1000"), ("18.00", "18"),
    ("$5$", "5"), ("x = 5", "5"), ("10\\%", "10"), ("90^\\circ", "90"), ("5 \\text{ cm}", "5"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"), ("\\sqrt3", "\\sqrt{3}"), (".5", "0.5"),
    ("\\text{(B)}", "(B)"), ("-\\frac{3}{4}", "-0.75"),
])
def test_strings_equivalent(a, b):
    assert strings_equivalent(a, b) and strings_equivalent(b, a)


@pytest.mark.parametrize("a, b", [("1", "2"), ("\\frac12", "\\frac13"), ("1,000", "100"), ("-5", "5"), ("", "")])
def test_strings_not_equivalent(a, b):
    assert not strings_equivalent(a, b)


def test_strip_answer_is_idempotent():
    for s in ["\\left( 3, \\dfrac{\\pi}{2} \\right)", "x = 1,000", "\\boxed{\\tfrac{1}{2}}", "12^{\\circ}"]:
        once = strip_answer(s)
        assert strip_answer(once) == once


# ----------------------------------------------------------------------------------- math-verify path
@pytest.mark.parametrize("prediction, gold", [
    ("2\\sqrt2", "\\sqrt{8}"),
    ("(x+1)^2", "x^2+2x+1"),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"),
    ("\\{1, 2\\}", "\\{2, 1\\}"),
])
def test_math_verify_symbolic_equivalences(prediction, gold):
    # These need sympy: the string normaliser alone must not be what makes them pass.
    assert not strings_equivalent(prediction, gold)
    assert math_verify_equivalent(prediction, gold)
    assert answers_equivalent(prediction, gold)


@pytest.mark.parametrize("prediction, gold", [("2\\sqrt3", "\\sqrt8"), ("x^2+1", "(x+1)^2"), ("\\frac{1}{3}", "0.3")])
def test_math_verify_rejects_different_values(prediction, gold):
    assert not answers_equivalent(prediction, gold)


# ------------------------------------------------------------------------------------- the reward
@pytest.mark.parametrize("completion, example, expected", [
    ("... so \\boxed{\\frac12}", ex("math", "0.5"), 1.0),
    ("... \\boxed{2\\sqrt2}", ex("math500", "\\sqrt{8}"), 1.0),
    ("... \\boxed{(x+1)^2}", ex("math", "x^2+2x+1"), 1.0),
    ("reasoning\n#### 18", ex("gsm8k", "18"), 1.0),
    ("<answer>1,000</answer>", ex("gsm8k", "1000"), 1.0),
    ("so she has 72 clips left.", ex("gsm8k", "72"), 1.0),               # last-number fallback for GSM8K
    ("so she has 72 clips left.", ex("math", "72", source="gsm8k"), 1.0),  # dare.data's GSM8K rows
    ("so she has 72 clips left.", ex("math", "72"), 0.0),               # MATH needs an explicit answer
    ("\\boxed{71}", ex("gsm8k", "72"), 0.0),
    ("", ex("math", "1"), 0.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", ex("math500", "\\left( 3, \\frac{\\pi}{2} \\right)"), 1.0),
    ("\\boxed{33}", ex("aime", 33), 1.0),                                 # numeric gold
])
def test_math_reward(completion, example, expected):
    assert math_reward(completion, example) == expected


@pytest.mark.parametrize("gold, expected", [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),   # a full GSM8K solution as gold
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),  # a full MATH solution as gold
    ("  \\sqrt{8} ", "\\sqrt{8}"),
])
def test_gold_formats(gold, expected):
    assert gold_answer(ex("math", gold)) == expected


def test_bad_gold_is_a_clear_error():
    with pytest.raises(ValueError, match="ground_truth"):
        math_reward("\\boxed{1}", ex("math", ""))
    with pytest.raises(KeyError, match="ground_truth"):
        math_reward("\\boxed{1}", {"task": "math"})


@pytest.mark.integration
def test_bundled_gold_answers_score_as_answers():
    """Every MATH-500 / GSM8K gold, written as a model would, scores 1; another problem's gold scores 1
    only when the two golds are the same answer (and the string normaliser knows it)."""
    from dare.data import DataConfig, load_examples
    from dare.rewards import score_batch

    math500 = load_examples(DataConfig(name="math500", split="test"))
    golds = [e["ground_truth"] for e in math500]
    own = score_batch("math", [f"The answer is $\\boxed{{{g}}}$." for g in golds], math500, workers=2)
    assert [g for g, r in zip(golds, own) if r.score != 1.0] == []
    shifted = golds[1:] + golds[:1]
    cross = score_batch("math", [f"\\boxed{{{g}}}" for g in shifted], math500, workers=2)
    matched = {(a, b) for a, b, r in zip(golds, shifted, cross) if r.score == 1.0}
    assert matched == {(a, b) for a, b in zip(golds, shifted) if strings_equivalent(a, b)}
    assert len(matched) < 10

    gsm8k = load_examples(DataConfig(name="gsm8k", split="test"))
    hashes = score_batch("auto", [f"Reasoning.\n#### {e['ground_truth']}" for e in gsm8k], gsm8k, workers=2)
    plain = score_batch("auto", [f"So the answer is {e['ground_truth']}." for e in gsm8k], gsm8k, workers=2)
    off_by_one = score_batch("auto", [f"#### {float(e['ground_truth'].replace(',', '')) + 1}" for e in gsm8k], gsm8k, workers=2)
    assert sum(r.score for r in hashes) == sum(r.score for r in plain) == len(gsm8k)
    assert sum(r.score for r in off_by_one) == 0
