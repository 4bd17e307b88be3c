"""Code correctness (HumanEval, MBPP): the extracted code against the tests, judged outside the code's process.

``ground_truth = {"tests": str | list[str], "entry_point": str | None, "prefix": str}``:
  * the candidate program is ``prefix`` (e.g. HumanEval's prompt: imports, signature, docstring), then the
    extracted code; the tests (plus ``check(<entry_point>)`` when they define ``check(candidate)`` and never
    call it, HumanEval's convention) run in a separate judge process (``sandbox.run_judged``) that sees the
    program's functions only through proxies returning data, so an object with a rigged ``__eq__`` or a forged
    success signal cannot pass a test;
  * MBPP-style tests may be a list of ``assert`` lines (or that list JSON-encoded);
  * an optional ``timeout`` (seconds) lowers the sandbox's wall-clock limit for that example.

Code extraction: the fenced ```python (or ```py / bare ```) block that defines the entry point
(the last such block), else the first fenced block; an unclosed fence at the end (a truncated
generation) runs to the end. Without fences, the last ``<answer>`` block, else the raw completion
(a HumanEval-style body continuation of ``prefix``). Function names are never rewritten.
"""
from __future__ import annotations

import contextvars
import json
import re
from dataclasses import dataclass
from typing import Optional

from .registry import RewardResult, ground_truth_dict, register_reward
from .sandbox import ISOLATIONS, SandboxLimits, SandboxResult, run_judged, with_timeout

# The fence regex extraction used before dare.rewards.fences (quadratic in runs of backticks); the one-pass
# fenced_blocks is tested to find what it finds.
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PY_LANGS = {"", "python", "py", "python3", "py3"}

# Limits and isolation for code rewards; change with ``set_code_limits`` (None = probed best mode).
_limits = SandboxLimits()
_isolation: Optional[str] = None
# Per-item deadline set by ``score_batch`` so a code item never outlives the batch timeout.
item_timeout: contextvars.ContextVar[Optional[float]] = contextvars.ContextVar("dare_reward_item_timeout", default=None)


def set_code_limits(limits: SandboxLimits, isolation: Optional[str] = None) -> None:
    """Sandbox limits used by the ``code`` reward (timeout, memory, processes, output cap), and
    optionally a forced isolation mode (``"bwrap"``, ``"unshare"``, ``"none"``; None = best available)."""
    global _limits, _isolation
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"expected SandboxLimits, got {type(limits).__name__}")
    if isolation is not None and isolation not in ISOLATIONS:
        raise ValueError(f"unknown sandbox isolation {isolation!r}; expected one of {ISOLATIONS}")
    _limits, _isolation = limits, isolation


def code_limits() -> tuple[SandboxLimits, Optional[str]]:
    return _limits, _isolation


def _defines(code: str, name: str) -> bool:
    from .fences import defines
    return defines(code, name)


def extract_code(completion: str, entry_point: Optional[str] = None) -> str:
    """The code to run from a completion (see the module docstring for the rules). The fences are found in one pass
    (``dare.rewards.fences``; ``_FENCE``, the regex it replaced, was quadratic in runs of backticks)."""
    from .fences import fenced_blocks
    blocks = [body for lang, body in fenced_blocks(completion) if lang.lower() in _PY_LANGS]
    if blocks:
        if entry_point:
            defining = [b for b in blocks if _defines(b, entry_point)]
            if defining:
                return defining[-1]
        return blocks[0]
    start = completion.rfind("<answer>")
    if start != -1:
        body = completion[start + len("<answer>"):]
        return body.split("</answer>", 1)[0].strip("\n")
    return completion


def _tests_text(tests) -> str:
    if isinstance(tests, str):
        stripped = tests.strip()
        if stripped.startswith("["):
            try:
                decoded = json.loads(stripped)
            except json.JSONDecodeError:
                decoded = None
            if isinstance(decoded, list):
                tests = decoded
    if isinstance(tests, (list, tuple)):
        if not all(isinstance(t, str) for t in tests):
            raise TypeError("code ground_truth['tests'] list must contain strings")
        return "\n".join(tests)
    if not isinstance(tests, str):
        raise TypeError(f"code ground_truth['tests'] must be a string or a list of strings, got {type(tests).__name__}")
    return tests


def infer_entry_point(tests: str) -> Optional[str]:
    """The function MBPP-style asserts call (``assert name(...)``), used to pick the code block."""
    match = re.search(r"^\s*assert\s+(?:not\s+)?(?:\(\s*)?([A-Za-z_]\w*)\s*\(", tests, re.MULTILINE)
    if match and match.group(1) not in {"isinstance", "math", "set", "sorted", "abs", "len", "all", "any"}:
        return match.group(1)
    return None


@dataclass(frozen=True)
class CodeTask:
    """What the sandbox runs for one completion: the candidate ``program`` (prefix + extracted code) and the trusted
    ``tests`` (plus ``check(<entry_point>)`` when they define ``check`` without calling it)."""
    program: str
    tests: str
    entry_point: Optional[str]
    prefix: str


def build_task(completion: str, gt: dict) -> CodeTask:
    tests = _tests_text(gt["tests"])
    entry_point = gt.get("entry_point") or None
    if entry_point is not None and not re.fullmatch(r"[A-Za-z_]\w*", str(entry_point)):
        raise ValueError(f"code ground_truth['entry_point'] must be an identifier, got {entry_point!r}")
    prefix = gt.get("prefix") or ""
    code = extract_code(completion, entry_point or infer_entry_point(tests))
    if prefix and not prefix.endswith("\n"):
        prefix += "\n"
    if entry_point and re.search(r"^def\s+check\s*\(", tests, re.MULTILINE) and not re.search(r"^check\s*\(", tests, re.MULTILINE):
        tests = f"{tests.rstrip()}\n\n\ncheck({entry_point})\n"
    return CodeTask(prefix + code + "\n", tests, entry_point, prefix)


def build_program(completion: str, gt: dict) -> str:
    """The candidate program and its tests as one file (what a single-process harness would run; for debugging)."""
    task = build_task(completion, gt)
    return f"{task.program}\n{task.tests}"


def run_code(completion: str, example: dict) -> SandboxResult:
    """Run the completion against the example's tests; the full result (status, output, reason)."""
    gt = ground_truth_dict(example, ("tests",))
    example_timeout = gt.get("timeout")
    if example_timeout is not None:
        try:
            example_timeout = float(example_timeout)
        except (TypeError, ValueError):
            raise ValueError(f"code ground_truth['timeout'] must be a number of seconds, got {example_timeout!r}") from None
    limits = with_timeout(with_timeout(_limits, example_timeout), item_timeout.get())
    task = build_task(completion, gt)
    return run_judged(task.program, task.tests, task.entry_point, task.prefix, limits, _isolation)


def code_result(completion: str, example: dict) -> RewardResult:
    """The code reward with its reason: ``"timeout"`` when the sandbox's wall clock ran out, ``"error: ..."`` when
    the sandbox could not run; a program that ran and failed its tests is a plain 0 (no reason)."""
    result = run_code(completion, example)
    if result.passed:
        return RewardResult(1.0)
    if result.status == "timeout":
        return RewardResult(0.0, "timeout")
    if result.status == "error":
        return RewardResult(0.0, f"error: sandbox: {result.output.strip()[:300]}")
    return RewardResult(0.0)


@register_reward("code", isolated=True)
def code_reward(completion: str, example: dict) -> float:
    """1.0 if every test passes against the program (prefix + extracted code), judged outside its process."""
    return code_result(completion, example).score


# score_batch takes the result with its reason from here (a reward's plain call stays a number).
code_reward.detailed = code_result  # type: ignore[attr-defined]
