"""Built-in benchmarks: which dataset split, which reward, and which number the results table reports.

Every benchmark is scored by the same reward function the trainer optimises (``dare.rewards``), so an eval
number and a training reward mean the same thing. ``metric``:

* ``accuracy``   fraction of samples with a full score (reward >= 1): GSM8K, MATH-500, AIME, HumanEval, MBPP,
  Countdown (d1 gives 0.1 for a well-formed wrong answer; that is not a solve),
* ``mean_score`` the mean reward: Sudoku, whose d1 reward is the fraction of empty cells filled correctly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Benchmark:
    name: str
    dataset: str  # a dare.data dataset name
    split: str = "test"
    reward: str = "auto"  # a dare.rewards name; "auto" = the default reward of each example's task
    metric: str = "accuracy"  # accuracy | mean_score
    description: str = ""


BENCHMARKS: dict[str, Benchmark] = {}


def register_benchmark(b: Benchmark) -> Benchmark:
    if b.metric not in ("accuracy", "mean_score"):
        raise ValueError(f"benchmark {b.name}: metric must be accuracy or mean_score, got {b.metric!r}")
    BENCHMARKS[b.name] = b
    return b


for _b in (
    Benchmark("gsm8k", "gsm8k", description="GSM8K test (1,319)"),
    Benchmark("math500", "math500", description="MATH-500"),
    Benchmark("humaneval", "humaneval", description="HumanEval pass@1 (164)"),
    Benchmark("mbpp", "mbpp", description="MBPP pass@1 (500, 3-shot prompt)"),
    Benchmark("countdown", "countdown", description="Countdown, 3 numbers (256)"),
    Benchmark("sudoku", "sudoku", metric="mean_score", description="4x4 Sudoku, fraction of empty cells solved (500)"),
    Benchmark("aime24", "aime24", description="AIME 2024 (30)"),
    Benchmark("aime25", "aime25", description="AIME 2025 (30)"),
    Benchmark("olympiadbench", "olympiadbench", description="OlympiadBench OE maths (674; from the Hub, not in 'all')"),
):
    register_benchmark(_b)

# The column order of the paper's Table 2 (math, code, planning).
TABLE_ORDER = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "countdown", "sudoku")


def _bundled(b: Benchmark) -> bool:
    from ..data.registry import get_dataset
    return get_dataset(b.dataset).bundled(b.split) is not None


def resolve_benchmarks(names) -> list[Benchmark]:
    """``"all"`` / a comma-separated string / a list of names -> benchmarks (unknown names are errors).

    ``all`` means every benchmark whose data ships with dare (runs offline); Hub-only ones are named explicitly.
    """
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    out: list[Benchmark] = []
    for raw in names:
        name = raw.strip()
        if name == "all":
            chosen = [BENCHMARKS[n] for n in TABLE_ORDER if n in BENCHMARKS]
            chosen += [b for n, b in BENCHMARKS.items() if n not in TABLE_ORDER and _bundled(b)]
        elif name in BENCHMARKS:
            chosen = [BENCHMARKS[name]]
        else:
            raise ValueError(f"unknown benchmark {name!r}; built-in: {', '.join(BENCHMARKS)} (or 'all')")
        out += [b for b in chosen if b not in out]
    if not out:
        raise ValueError("no benchmarks given")
    return out


def get_benchmark(name: str) -> Optional[Benchmark]:
    return BENCHMARKS.get(name)
