"""The accuracy-vs-speed frontier of a ``dare eval --sweep``: one point per (setting, model, benchmark).

Each swept setting (``sampler.threshold=0.9``, ...) is a full evaluation; its score sits beside its tokens per
forward (TPF, hardware-independent) and tokens/s. A point is on the Pareto frontier of its (model, benchmark) when no
other setting scores at least as high at a TPF at least as high, one of them strictly. Outputs: ``frontier.json``,
``frontier.md`` (the table) and ``frontier.png`` (score against TPF, one panel per benchmark, one line per model).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from .speed import fmt

log = logging.getLogger(__name__)


def frontier_points(runs: list[tuple[str, list[dict]]]) -> list[dict]:
    """``runs``: (setting label, the combined results list of that setting's evaluation) -> one point per
    (setting, model, benchmark) that has a TPF, with ``pareto`` marked within each (model, benchmark)."""
    points = []
    for label, results in runs:
        for res in results:
            for bench, s in res["benchmarks"].items():
                if s.get("tpf") is None:  # lm-eval tasks carry no decoding counts
                    continue
                points.append({"setting": label, "model": res["model"], "benchmark": bench, "score": s["score"],
                               "metric": s.get("metric"), "tpf": s["tpf"], "nfe_per_sample": s.get("nfe_per_sample"),
                               "tokens_per_second": s.get("tokens_per_second"), "n_examples": s.get("n_examples")})
    for p in points:
        rivals = [q for q in points if q is not p and (q["model"], q["benchmark"]) == (p["model"], p["benchmark"])]
        p["pareto"] = not any(q["score"] >= p["score"] and q["tpf"] >= p["tpf"] and
                              (q["score"] > p["score"] or q["tpf"] > p["tpf"]) for q in rivals)
    points.sort(key=lambda p: (p["model"], p["benchmark"], p["tpf"]))
    return points


def frontier_markdown(points: list[dict], swept: str) -> str:
    lines = [f"Sweep over {swept}: each setting is a full evaluation; * = on the accuracy-vs-TPF Pareto frontier of "
             "its model and benchmark.", "",
             "| model | benchmark | setting | score | TPF | NFE / sample | tokens/s | frontier |",
             "|---|---|---|---:|---:|---:|---:|:---:|"]
    for p in points:
        lines.append(f"| {p['model']} | {p['benchmark']} | {p['setting']} | {p['score']:.1f} | {fmt(p['tpf'])} | "
                     f"{fmt(p['nfe_per_sample'], 1)} | {fmt(p['tokens_per_second'], 1)} | {'*' if p['pareto'] else ''} |")
    return "\n".join(lines) + "\n"


def frontier_plot(points: list[dict], path: Path, title: str = "") -> Optional[Path]:
    """Score against TPF, one panel per benchmark, one line per model through its settings in TPF order."""
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = list(dict.fromkeys(p["benchmark"] for p in points))
    fig, axes = plt.subplots(1, len(benches), figsize=(5.5 * len(benches), 4.2), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        for model in dict.fromkeys(p["model"] for p in points if p["benchmark"] == bench):
            pts = [p for p in points if (p["model"], p["benchmark"]) == (model, bench)]
            line, = ax.plot([p["tpf"] for p in pts], [p["score"] for p in pts], marker="o", label=model)
            labels: dict = {}  # settings that land on the same point share one label
            for p in pts:
                labels.setdefault((p["tpf"], p["score"]), []).append(p["setting"].split("=")[-1])
            for k, ((x, y), names) in enumerate(labels.items()):  # alternate above / below: neighbours crowd
                ax.annotate(", ".join(names), (x, y), textcoords="offset points", xytext=(3, 6 if k % 2 else -12),
                            fontsize=8, color=line.get_color())
        tpfs = [p["tpf"] for p in points if p["benchmark"] == bench]
        if min(tpfs) > 0 and max(tpfs) / min(tpfs) > 8:  # one token per step next to whole-block commits
            ax.set_xscale("log")
        metric = next(p["metric"] for p in points if p["benchmark"] == bench)
        ax.set_xlabel("tokens per forward (TPF)")
        ax.set_ylabel(f"{bench}: {'accuracy' if metric == 'accuracy' else 'mean reward'} (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(bench)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_frontier(runs: list[tuple[str, list[dict]]], output_dir: Path, swept: str) -> list[dict]:
    points = frontier_points(runs)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "frontier.json").write_text(json.dumps({"swept": swept, "points": points}, indent=1))
    (output_dir / "frontier.md").write_text(frontier_markdown(points, swept))
    frontier_plot(points, output_dir / "frontier.png", f"accuracy vs tokens per forward, sweep over {swept}")
    log.info("wrote %s, frontier.md and frontier.png", output_dir / "frontier.json")
    return points
