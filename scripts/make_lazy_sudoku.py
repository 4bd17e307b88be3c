#!/usr/bin/env python
"""Make the "lazy Sudoku" SFT demonstrations of the quickstart's RL task (fixed seed, deterministic).

Real SFT corpora mix demonstration quality. This script builds such a corpus from the bundled 4x4 Sudoku **train**
split (d1's puzzles, via DARE's preprocessed parquet): every puzzle becomes one ``{"prompt", "response"}`` row whose
response is ``<answer>{grid}</answer>``. For a fraction ``--lazy`` of the rows the demonstrator was lazy: ``--blanks``
of the puzzle's empty cells, chosen at random, are left as ``0`` (copied from the puzzle) instead of solved. The
other rows are the full solution. The reward (d1's Sudoku verifier: fraction of the empty cells filled correctly)
and the held-out **test** split are untouched, so a model SFT'd on these rows learns a habit -- leaving some
cells empty -- that the verifier penalises and that RL can remove on puzzles it never saw.

    python scripts/make_lazy_sudoku.py                      # writes the packaged file (the defaults below)
    python scripts/make_lazy_sudoku.py --lazy 0.8 --blanks 5 --out /tmp/lazy.jsonl   # another habit strength
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

from dare.data import load_examples
from dare.data.config import DataConfig

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src/dare/assets/data/quickstart/sudoku_lazy_train.jsonl.gz"


def lazy_rows(lazy: float, blanks: int, seed: int, limit: int | None = None) -> list[dict]:
    """One row per train puzzle, in file order; the random choices come from one ``random.Random(seed)``."""
    rng = random.Random(seed)
    rows = []
    for ex in load_examples(DataConfig(name="sudoku", split="train", limit=limit)):
        puzzle, solution = ex["ground_truth"]["puzzle"], ex["ground_truth"]["solution"]
        grid = list(solution)
        is_lazy = rng.random() < lazy
        if is_lazy:
            empty = [i for i, c in enumerate(puzzle) if c == "0"]
            for i in rng.sample(empty, min(blanks, len(empty))):
                grid[i] = "0"
        rows.append({"prompt": puzzle, "response": f"<answer>{''.join(grid)}</answer>", "lazy": is_lazy})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lazy", type=float, default=0.7, help="fraction of lazy demonstrations")
    ap.add_argument("--blanks", type=int, default=4, help="empty cells a lazy demonstration leaves as 0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="first N train puzzles (default: all 20000)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    rows = lazy_rows(args.lazy, args.blanks, args.seed, args.limit)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)
    if args.out.suffix == ".gz":  # mtime 0: the same rows give the same bytes
        with open(args.out, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
            gz.write(text.encode())
    else:
        args.out.write_text(text)
    n_lazy = sum(r["lazy"] for r in rows)
    print(f"wrote {len(rows)} rows ({n_lazy} lazy, {args.blanks} blanks each) to {args.out}")


if __name__ == "__main__":
    main()
