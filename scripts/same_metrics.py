"""Do two runs log the same numbers? Compares two ``metrics.jsonl`` files (e.g. the quickstart's ``rl/metrics.jsonl``
before and after a refactor) step by step, every field but the timings, bit for bit.

    python scripts/same_metrics.py BEFORE/rl/metrics.jsonl AFTER/rl/metrics.jsonl

Prints each field that differs (on how many steps, the first one, the largest relative difference) and exits 1, or
says the runs are the same and exits 0. A refactor proves itself this way: the numbers do not move.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TIMING_SUFFIXES = ("_time",)  # wall-clock fields: never equal between two runs


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def differences(before: list[dict], after: list[dict]) -> list[str]:
    """One line per field (or structural difference) that is not bit-for-bit equal."""
    if len(before) != len(after):
        return [f"{len(before)} logged steps before, {len(after)} after"]
    lines, fields = [], {}
    for i, (a, b) in enumerate(zip(before, after)):
        if set(a) != set(b):
            lines.append(f"step line {i}: fields only before {sorted(set(a) - set(b))}, only after "
                         f"{sorted(set(b) - set(a))}")
        for key in sorted(set(a) & set(b)):
            if key.endswith(TIMING_SUFFIXES) or a[key] == b[key]:
                continue
            rel = None
            if isinstance(a[key], (int, float)) and isinstance(b[key], (int, float)):
                rel = abs(a[key] - b[key]) / max(abs(a[key]), abs(b[key]), 1e-300)
            first, count, worst = fields.get(key, (i, 0, 0.0))
            fields[key] = (first, count + 1, max(worst, rel or 0.0))
    for key, (first, count, worst) in fields.items():
        lines.append(f"{key}: differs on {count} of {len(before)} steps (first: line {first}; largest relative "
                     f"difference {worst:.2e})")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    before = read(args.before)
    lines = differences(before, read(args.after))
    for line in lines:
        print(line)
    if not lines:
        print(f"same numbers: {len(before)} steps, every field but the timings bit for bit")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
