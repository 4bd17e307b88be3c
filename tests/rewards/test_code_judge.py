"""The judged code reward: honest programs of every result kind still pass, the boundary carries data only.

The candidate program and the tests run in two sandboxes (``run_judged``); these tests check that ordinary
solutions keep their Python semantics across that boundary (generators, class instances, exceptions, keyword
arguments, stdlib value types, helpers from the task's prefix) and that the wire codec builds nothing but fresh
objects of exact builtin types. The hostile programs live in test_sandbox.py with the rest of the battery.
"""
import collections
import decimal
import fractions
import json

import pytest

from dare.rewards import SandboxLimits, get_reward, run_code, run_judged, set_code_limits
from dare.rewards.code_reward import code_limits
from dare.rewards.sandbox_child import MAX_FRAME, WireError, decode_value, encode_value, recv_frame, send_frame

code = get_reward("code")


@pytest.fixture(autouse=True)
def limits():
    previous = code_limits()
    set_code_limits(SandboxLimits(timeout=10.0))
    yield
    set_code_limits(*previous)


def mbpp(tests: str, prefix: str = "", entry_point=None) -> dict:
    return {"task": "mbpp", "ground_truth": {"tests": tests, "entry_point": entry_point, "prefix": prefix}}


# ------------------------------------------------------------------------------ honest programs keep passing
HONEST = {
    "data of every builtin kind": (
        "def f():\n    return [1, -2**70, 2.5, float('inf'), 1+2j, 'x', b'\\x00', bytearray(b'a'), None, True,\n"
        "            (1,), {1, 2}, frozenset([3]), {'k': [1, {'n': None}]}]\n",
        "r = f()\nassert r[:4] == [1, -2**70, 2.5, float('inf')] and r[4] == 1+2j and r[5:9] == ['x', b'\\x00', bytearray(b'a'), None]\n"
        "assert r[9] is True and r[10] == (1,) and r[11] == {1, 2} and r[12] == frozenset([3]) and r[13] == {'k': [1, {'n': None}]}\n"
        "assert type(r[1]) is int and type(r[2]) is float and type(r[10]) is tuple\n"),
    "nan stays nan": ("import math\ndef f():\n    return float('nan')\n", "import math\nassert math.isnan(f())\n"),
    "stdlib value types": (
        "import collections, decimal, fractions\n"
        "def f(s):\n    return collections.Counter(s), fractions.Fraction(1, 3), decimal.Decimal('0.1'), collections.deque([1])\n"
        "def g():\n    return collections.OrderedDict(a=1), collections.defaultdict(list, b=[2]), range(1, 7, 2)\n",
        "c, q, d, dq = f('aab')\nassert c == {'a': 2, 'b': 1} and c.most_common(1) == [('a', 2)]\n"
        "assert q == fractions.Fraction(1, 3) and d == decimal.Decimal('0.1') and list(dq) == [1]\n"
        "o, dd, r = g()\nassert o == {'a': 1} and dd == {'b': [2]} and list(r) == [1, 3, 5]\n"),
    "generator result": ("def f(n):\n    for i in range(n):\n        yield i * i\n",
                         "assert list(f(4)) == [0, 1, 4, 9]\nassert sorted(f(3), reverse=True) == [4, 1, 0]\n"
                         "assert f(3) != [0, 1, 4]   # a generator is not a list, as in plain Python\n"),
    "class instances passed back": (
        "class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
        "def max_chain_length(pairs, n):\n    pairs = sorted(pairs, key=lambda p: p.b)\n    best, end = 0, float('-inf')\n"
        "    for p in pairs:\n        if p.a > end:\n            best, end = best + 1, p.b\n    return best\n",
        "assert max_chain_length([Pair(5, 24), Pair(15, 25), Pair(27, 40), Pair(50, 60)], 4) == 3\n"),
    "a tree built by the tests' setup code": (
        "class Node:\n    def __init__(self, data):\n        self.data, self.left, self.right = data, None, None\n"
        "def height(node):\n    return 0 if node is None else 1 + max(height(node.left), height(node.right))\n",
        "root = Node(1)\nroot.left = Node(2)\nroot.left.left = Node(3)\nassert height(root) == 3\nassert root.data == 1\n"),
    "expected exception": ("def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n",
                           "try:\n    f(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\nelse:\n    raise AssertionError\n"),
    "keyword arguments and defaults": ("def f(a, b=2, *, c=3):\n    return a + b + c\n",
                                       "assert f(1) == 6 and f(1, c=10) == 13 and f(a=0, b=0, c=0) == 0\n"),
    "a module the program imported": ("import math\ndef f(x):\n    return math.sqrt(x)\n",
                                      "assert math.isclose(f(2.0), 1.4142135, rel_tol=1e-6)\n"),
    "a returned function": ("def adder(n):\n    def add(x):\n        return x + n\n    return add\n",
                            "assert adder(2)(3) == 5\n"),
    "str and len of an object": (
        "class Box:\n    def __init__(self, items):\n        self.items = items\n    def __len__(self):\n"
        "        return len(self.items)\n    def __str__(self):\n        return 'Box' + str(self.items)\n"
        "def make(*items):\n    return Box(list(items))\n",
        "assert len(make(1, 2)) == 2 and str(make(1)) == 'Box[1]'\n"),
}


@pytest.mark.parametrize("case", sorted(HONEST))
def test_honest_programs_keep_their_python_semantics(case):
    program, tests = HONEST[case]
    result = run_code(program, mbpp(tests))
    assert result.passed, result.output[-800:]


def test_humaneval_style_check_and_trusted_prefix_helpers():
    # HumanEval/32-like: the test uses a helper of the prompt. The trusted copy is used, so a program that
    # redefines the helper to always agree gains nothing.
    prefix = "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n\n\ndef find_zero(xs):\n    \"\"\"Doc.\"\"\"\n"
    tests = "def check(candidate):\n    x = candidate([-2, 1])\n    assert abs(poly([-2, 1], x)) < 1e-6\n"
    example = {"task": "humaneval", "ground_truth": {"tests": tests, "entry_point": "find_zero", "prefix": prefix}}
    assert code("    return -xs[0] / xs[1]\n", example) == 1.0
    cheat = "    return 0.0\n\n\ndef poly(xs, x):\n    return 0.0\n"
    assert code(cheat, example) == 0.0


def test_wrong_answers_crashes_and_timeouts_fail_with_a_reason():
    tests = "assert f(2) == 4\n"
    wrong = run_code("def f(x):\n    return x + 1\n", mbpp(tests))
    assert not wrong.passed and wrong.reason.endswith("AssertionError")
    broken = run_code("def f(x):\n    return x * 2\nundefined_name\n", mbpp(tests))
    assert not broken.passed and "the candidate program failed: NameError" in broken.reason
    exits = run_code("import os\nos._exit(0)\n", mbpp(tests))
    assert not exits.passed and "exited before its functions could be tested" in exits.reason
    set_code_limits(SandboxLimits(timeout=1.5))
    assert run_code("while True:\n    pass\n", mbpp(tests)).status == "timeout"
    assert run_code("def f(x):\n    while True:\n        pass\n", mbpp(tests)).status == "timeout"


def test_the_tests_never_enter_the_candidates_process():
    # A program that reads its own file (or its arguments) for the asserts finds nothing to copy answers from.
    spy = ("import sys\nsource = open(__file__).read() + ' '.join(sys.argv)\nsource = source.replace('ass' + 'ert', '', 1)\n"
           "def f(x):\n    return ('ass' + 'ert') in source or ('secret' + '-expected') in source\n")
    assert run_judged(spy, "assert f(1) is False  # secret-expected\n").passed


def test_values_the_tests_read_come_from_the_tests_never_from_the_program():
    # A test that reads a value it does not define (an input its setup should build) fails, instead of letting the
    # program choose the input: bundled MBPP row 356 lost its setup, and programs defined root, root1, root2 themselves.
    result = run_judged("LIMIT = [1, 2]\nroot = 0\ndef f(x):\n    return x == 0\n", "assert f(root)\n")
    assert not result.passed and "NameError: name 'root' is not defined" in result.output
    assert run_judged("def f(x):\n    return x == 0\n", "root = 0\nassert f(root)\n").passed


def test_the_judge_refuses_objects_it_cannot_send():
    tests = "try:\n    f(lambda: 1)\nexcept TypeError as e:\n    assert 'cannot be passed' in str(e)\nelse:\n    raise AssertionError\n"
    assert run_judged("def f(g):\n    return 1\n", tests).passed


# ------------------------------------------------------------------------------ the wire codec
def roundtrip(value):
    return decode_value(json.loads(json.dumps(encode_value(value))))


def test_codec_round_trips_data_into_fresh_exact_objects():
    values = [None, True, 0, -(2 ** 200), 1.5, -0.0, float("inf"), 3 - 4j, "\udc80 text", b"\x00\xff", bytearray(b"x"),
              [1, [2]], (1, (2,)), {1, "a"}, frozenset({2}), {"a": {1: (None,)}}, range(0, 9, 3),
              fractions.Fraction(-7, 3), decimal.Decimal("1.10"), collections.OrderedDict(b=1, a=2),
              collections.Counter("abca"), collections.deque([1, 2])]
    for value in values:
        back = roundtrip(value)
        assert back == value and type(back) is type(value), value
    assert type(roundtrip(collections.defaultdict(list, a=[1]))) is collections.defaultdict


def test_codec_turns_non_data_into_handles_and_rejects_forged_trees():
    class Sneaky(int):
        def __eq__(self, other):
            return True

    handles = {}
    assert encode_value([Sneaky(1), object()], handles) == ["l", [["h", 0], ["h", 1]]] and len(handles) == 2
    with pytest.raises(WireError, match="not data"):
        encode_value(Sneaky(1))
    for forged in (["i", "1.5"], ["i", "-"], ["i", 5], ["b", 1], ["s", 5], ["l", "abc"], ["d", [[["l", []], ["N"]]]],
                   ["q", "1", "0"], ["h", 0], ["x"], "text", [], ["N", 1]):
        with pytest.raises(WireError):
            decode_value(forged)
    deep = ["N"]
    for _ in range(200):
        deep = ["l", [deep]]
    with pytest.raises(WireError, match="deeper"):
        decode_value(deep)


def test_frames_are_bounded(tmp_path):
    import os
    r, w = os.pipe()
    try:
        send_frame(w, ["ok", ["i", "2a"]])
        assert recv_frame(r) == ["ok", ["i", "2a"]]
        os.write(w, (MAX_FRAME + 1).to_bytes(4, "big"))
        with pytest.raises(WireError, match="limit"):
            recv_frame(r)
        os.close(w)
        w = -1
        assert recv_frame(r) is None
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


# ------------------------------------------------------------------------------ bundled tests are self-contained
# Classes a task asks the program to write, which its tests construct (the only names a test may take from it besides
# the entry point). Anything else a test reads must be its own, a builtin or a standard-library module.
TASK_CLASSES = {"mbpp/test/356": {"Node"}}


@pytest.mark.parametrize("name", ["mbpp", "humaneval"])
def test_every_bundled_test_defines_the_names_it_reads(name):
    import builtins
    import sys

    from dare.data import DataConfig, load_examples
    from dare.rewards.code_reward import infer_entry_point
    from dare.rewards.sandbox_child import _names_used

    missing = {}
    for ex in load_examples(DataConfig(name=name, split="test")):
        gt = ex["ground_truth"]
        read, defined = _names_used(gt["tests"])
        if gt.get("prefix"):
            defined |= _names_used(gt["prefix"])[1]
        entry = gt["entry_point"] or infer_entry_point(gt["tests"])
        outside = {n for n in read - defined - {entry} - TASK_CLASSES.get(ex["id"], set())
                   if not hasattr(builtins, n) and n not in sys.stdlib_module_names}
        if outside:
            missing[ex["id"]] = sorted(outside)
    assert missing == {}
