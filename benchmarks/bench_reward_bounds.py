"""Per-item time of the math grader on the answers that used to stall it, next to ordinary answers, the code reward's
extraction on hostile completions (one pass against the fence regex it replaced, side by side), and the cost of the
code sandbox's view, in one run.

    python benchmarks/bench_reward_bounds.py     # prints three tables (about 1.5 minutes on 2 cores)

Each stall case runs in a fresh process (the completion on stdin: 20,000 boxes are too long for an argument) with a
wall-clock limit (``LIMIT`` seconds plus import time), so an unbounded grader shows as ">= LIMIT" instead of hanging: run it on a checkout before the work bound to see the other column (the
numbers in docs/rewards.md came from such a side-by-side run). The sandbox table times a judged run (two sandboxed
processes) per isolation mode that works here.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

LIMIT = 20.0
CASES = {
    "10^{10^{10}}": "\\boxed{10^{10^{10}}}",
    "2^{2^{30}}": "\\boxed{2^{2^{30}}}",
    "(10^{100})!": "\\boxed{(10^{100})!}",
    "3,000 nested parentheses": "\\boxed{" + "(" * 3000 + "7" + ")" * 3000 + "}",
    "20,000 unclosed \\boxed{": "\\boxed{" * 20000,
    "(a+b+c+d+e+f)^{10}": "\\boxed{(a+b+c+d+e+f)^{10}}",
    "ordinary: \\frac{14}{2}": "\\boxed{\\frac{14}{2}}",
    "ordinary: x^2+2x+1": "\\boxed{x^2+2x+1}",
}
_ONE = """
import sys, time
from dare.rewards import get_reward
reward = get_reward("math")
reward("\\\\boxed{x+1}", {"task": "math", "ground_truth": "7"})  # imports and sympy's first call, not timed
completion = sys.stdin.read()
start = time.perf_counter()
score = reward(completion, {"task": "math", "ground_truth": "7"})
print(f"{time.perf_counter() - start:.4f} {score}")
"""


def time_case(completion: str) -> str:
    try:
        done = subprocess.run([sys.executable, "-c", _ONE], input=completion, capture_output=True, text=True,
                              timeout=LIMIT + 15, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        return f">= {LIMIT:.0f} s"
    if done.returncode != 0:
        return "error: " + done.stderr.strip().splitlines()[-1][:60]
    seconds, score = done.stdout.split()[-2:]
    return f"{float(seconds) * 1000:.1f} ms (score {score})"


EXTRACTION = {  # completions that took the old extraction seconds (issue 41, finding 3), and an ordinary one
    '"```" x 64,000': "```" * 64000,
    "96 KB of backticks after a line": "x\n" + "`" * 96000,
    "a fence, 20,000 blank lines, no def of f": "```python\n" + "\n" * 20000 + "x = 1\n```",
    "ordinary: one fenced function": "Here:\n```python\ndef f(x):\n    return x + 1\n```\nDone.",
}


def old_extraction(completion: str, entry_point: str) -> None:
    """What ``extract_code`` ran before ``dare.rewards.fences``: the fence regex, then the def search per block."""
    import re
    from dare.rewards.code_reward import _FENCE
    blocks = [body for lang, body in _FENCE.findall(completion) if lang.lower() in {"", "python", "py"}]
    [re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", b, re.MULTILINE) for b in blocks]


def main() -> None:
    print("| math answer (gold 7) | time per item |\n|---|---:|")
    for name, completion in CASES.items():
        print(f"| `{name}` | {time_case(completion)} |", flush=True)

    from dare.rewards.code_reward import extract_code
    print("\n| code completion | extraction now | the old patterns (fence regex, def search) |\n|---|---:|---:|")
    for name, completion in EXTRACTION.items():
        times = []
        for fn in (extract_code, old_extraction):
            start = time.perf_counter()
            fn(completion, "f")
            times.append(f"{(time.perf_counter() - start) * 1000:.1f} ms")
        print(f"| {name} | {times[0]} | {times[1]} |", flush=True)

    from dare.rewards import SandboxLimits, available_isolations, run_judged
    print("\n| isolation | judged run (two sandboxed processes), mean of 10 |\n|---|---:|")
    for mode in available_isolations():
        run_judged("def f():\n    return 1\n", "assert f() == 1\n", limits=SandboxLimits(timeout=10), isolation=mode)
        start = time.perf_counter()
        for _ in range(10):
            run_judged("def f():\n    return 1\n", "assert f() == 1\n", limits=SandboxLimits(timeout=10), isolation=mode)
        print(f"| {mode} | {(time.perf_counter() - start) * 100:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
