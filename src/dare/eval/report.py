"""Results: per-benchmark summaries, results.json and the Markdown table (models x benchmarks, Table 2 shape)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

from .benchmarks import TABLE_ORDER, get_benchmark


def summarize(benchmark, records: list[dict], n_examples: int, run_seconds: float = 0.0, run_tokens: int = 0) -> dict:
    scores = [float(r["score"]) for r in records]
    n = len(scores)
    accuracy = sum(s >= 1.0 - 1e-9 for s in scores) / n if n else 0.0
    mean = sum(scores) / n if n else 0.0
    headline = accuracy if benchmark.metric == "accuracy" else mean
    # Per example over its k samples (k = n_samples of the run): the best score, and whether any sample is fully
    # correct (pass@k). With one sample per example they equal mean_score and accuracy.
    best: dict = {}
    for r in records:
        best[r["id"]] = max(best.get(r["id"], 0.0), float(r["score"]))
    return {
        "benchmark": benchmark.name, "metric": benchmark.metric, "score": round(100.0 * headline, 2),
        "accuracy": accuracy, "mean_score": mean, "n_examples": n_examples, "n_samples": n,
        "best_of_k_mean": sum(best.values()) / len(best) if best else 0.0,
        "pass_at_k": sum(b >= 1.0 - 1e-9 for b in best.values()) / len(best) if best else 0.0,
        "k": round(n / len(best)) if best else 0,
        "errors": sum(1 for r in records if r.get("reason")),
        "mean_completion_tokens": (sum(r.get("completion_tokens", 0) for r in records) / n) if n else 0.0,
        # Generation throughput of this invocation only (resumed samples were timed by an earlier run).
        "gen_seconds": round(run_seconds, 3), "tokens_per_second": round(run_tokens / run_seconds, 2) if run_seconds else None,
    }


def _columns(results: Iterable[dict]) -> list[str]:
    names: list[str] = []
    for res in results:
        for name in res["benchmarks"]:
            if name not in names:
                names.append(name)
    order = {n: i for i, n in enumerate(TABLE_ORDER)}
    return sorted(names, key=lambda n: (order.get(n, len(order)), names.index(n)))


def markdown_table(results: list[dict]) -> str:
    """One row per model, one column per benchmark (+ the average), numbers in percent."""
    cols = _columns(results)
    head = ["model"] + cols + ["avg"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for res in results:
        vals = [res["benchmarks"].get(c, {}).get("score") for c in cols]
        got = [v for v in vals if v is not None]
        avg = round(sum(got) / len(got), 2) if got else None
        cells = [res["model"]] + ["-" if v is None else f"{v:.1f}" for v in vals] + ["-" if avg is None else f"{avg:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for c in cols:
        b = get_benchmark(c)
        if b is not None:
            n = max((r["benchmarks"].get(c, {}).get("n_examples", 0) for r in results), default=0)
            notes.append(f"{c}: {'accuracy' if b.metric == 'accuracy' else 'mean reward'} on {n} examples")
    return "\n".join(lines) + ("\n\n" + "; ".join(notes) + "." if notes else "") + "\n"


def write_results(results, output_dir: Optional[Path]) -> None:
    """``results.json`` and ``results.md`` (``results`` is one model's dict or a list of them)."""
    if output_dir is None:
        return
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    rows = results if isinstance(results, list) else [results]
    (output_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (output_dir / "results.md").write_text(markdown_table(rows))
