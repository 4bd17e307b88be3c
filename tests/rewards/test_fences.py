"""The code reward's extraction in one pass (dare/rewards/fences.py): the blocks the old fence regex found, block for
block, and the ``def`` lines the old pattern found, without their quadratic worst cases (issue 41, finding 3)."""
import random
import re

from dare.rewards.code_reward import _FENCE, extract_code
from dare.rewards.fences import defines, fenced_blocks

PIECES = ["```", "`", "``", "\n", "python", "py", "Py3", " ", "\t", "x = 1", "def f():", "C++", "{}", "<answer>",
          "\r\n", "\r", "async ", "def", "f", "(", "\f", "\v"]


def _old_defines(code, name):
    return re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def _texts(n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 16))) for _ in range(n)]


def test_the_blocks_the_fence_regex_found():
    for text in _texts(5000, 0):
        assert fenced_blocks(text) == _FENCE.findall(text), repr(text)


def test_the_def_lines_the_old_pattern_found():
    for text in _texts(5000, 1):
        assert defines(text, "f") == _old_defines(text, "f"), repr(text)


def test_the_inputs_that_stalled_the_regexes():
    """Inputs the old patterns took seconds on (96 KB of backticks: 5.35-7.5 s; "```" x 64000: 13-31 s; 20,000 blank
    lines before a block without the def: 12 s; side by side: benchmarks/bench_reward_bounds.py) extract what the rules
    say."""
    assert fenced_blocks("```" * 64000) == [] and fenced_blocks("x\n" + "`" * 96000) == []
    assert extract_code("```" * 64000, "f") == "```" * 64000  # no fence: the raw completion
    assert extract_code("```python\n" + "\n" * 200000 + "def f():\n    pass\n```", "f").endswith("def f():\n    pass\n")
    blank = "```python\n" + "\n" * 200000 + "x = 1\n```"  # the old def search: 12 s at 20,000 blank lines
    assert extract_code(blank, "f") == "\n" * 200000 + "x = 1\n"  # no block defines f: the first block
    closing_and_opening = "```\n" + "``` ```\n" * 3  # each line closes a block and opens the next
    assert fenced_blocks(closing_and_opening) == _FENCE.findall(closing_and_opening) == [("", "")] * 4
