"""How much the k samples of one prompt differ, per rollout temperature: the signal a group-relative RL method gets.

    .venv/bin/python scripts/group_spread.py                                  # lazy-Sudoku LLaDA, T = 0.3 and 1.0
    .venv/bin/python scripts/group_spread.py --checkpoint lazy-sudoku-sdar-sft --temperatures 0.3,0.9,1.0

For each temperature it decodes the first ``--limit`` held-out puzzles ``--k`` times with the compare recipe's
rollout sampler (``dare.quickstart.stages.eval_stage`` with samples = k) and prints, over the puzzles: the mean
reward, the mean within-group reward standard deviation, the share of groups whose rewards are all equal (a
group-relative advantage is 0 there: no signal), the mean number of distinct completions, and best-of-k minus mean.
docs/algorithms/d1.md uses it for d1's Sudoku temperature (0.3).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path


def spread(jsonl: Path) -> dict:
    """Group statistics of an eval's per-sample JSONL (one row per (example, sample))."""
    scores, texts = collections.defaultdict(list), collections.defaultdict(set)
    for line in jsonl.read_text().splitlines():
        row = json.loads(line)
        scores[row["id"]].append(row["score"])
        texts[row["id"]].add(row["completion"])
    stds = [statistics.pstdev(v) for v in scores.values()]
    return {"groups": len(stds), "mean": statistics.mean(s for v in scores.values() for s in v),
            "within_group_std": statistics.mean(stds), "zero_variance_groups": sum(s == 0 for s in stds) / len(stds),
            "distinct": statistics.mean(len(t) for t in texts.values()),
            "best_minus_mean": statistics.mean(max(v) - statistics.mean(v) for v in scores.values())}


def main(argv=None) -> int:
    import torch

    from dare.quickstart.assets import get_checkpoint
    from dare.comparison.run import compare_recipe
    from dare.quickstart.stages import eval_stage, load_stage_recipe

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="lazy-sudoku-llada-sft")
    ap.add_argument("--temperatures", default="0.3,1.0")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--output-dir", default="runs/group_spread")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ck = get_checkpoint(args.checkpoint)
    rpath, ck_ov = compare_recipe(ck)
    print(f"{args.checkpoint}: {args.limit} held-out puzzles x {args.k} samples\n")
    print("| temperature | mean reward | within-group std | groups with equal rewards | distinct / k | best-of-k - mean |")
    print("|---:|---:|---:|---:|---:|---:|")
    for t in (float(x) for x in args.temperatures.split(",")):
        recipe = load_stage_recipe(rpath, ck_ov + [f"rollout.sampler.temperature={t}", f"eval.limit={args.limit}"])
        out = Path(args.output_dir) / f"{args.checkpoint}-T{t:g}"
        eval_stage(ck.path, recipe, out, f"T{t:g}", samples=args.k, sample_limit=args.limit, progress=False)
        s = spread(out / "sampled" / f"{recipe.eval.benchmarks[0]}.jsonl")
        print(f"| {t:g} | {s['mean']:.3f} | {s['within_group_std']:.3f} | {100 * s['zero_variance_groups']:.0f} % | "
              f"{s['distinct']:.2f} | {s['best_minus_mean']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
