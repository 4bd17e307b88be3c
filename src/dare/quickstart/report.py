"""Tables and figures of the quickstart (before/after) and of the RL comparison (baseline + every algorithm)."""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Optional

from .stages import read_curve


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100.0 * x:.1f}"


def quickstart_table(rows: list[dict], settings: dict) -> str:
    """Markdown: one row per model, per benchmark the mean reward and the fraction fully solved (accuracy)."""
    benches = list(settings["benchmarks"])
    head = ["model"]
    for b in benches:
        head += [f"{b} mean reward", f"{b} solved (%)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        cells = [r["model"]]
        for b in benches:
            s = r["results"].get(b, {})
            cells += [f"{s['mean_score']:.3f}" if "mean_score" in s else "-", _pct(s.get("accuracy"))]
        lines.append("| " + " | ".join(cells) + " |")
    if len(rows) == 2:
        cells = ["change"]
        for b in benches:
            a, z = rows[0]["results"].get(b, {}), rows[1]["results"].get(b, {})
            dm = z.get("mean_score", math.nan) - a.get("mean_score", math.nan)
            da = z.get("accuracy", math.nan) - a.get("accuracy", math.nan)
            cells += [f"{dm:+.3f}", f"{100 * da:+.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    n = settings.get("limit")
    sampler = settings.get("sampler", {})
    note = (f"Held-out: {', '.join(benches)} test split, {n if n is not None else 'all'} examples, "
            f"{settings.get('template')} prompts, gen_length {sampler.get('gen_length')}, {sampler.get('steps')} steps, "
            f"temperature {sampler.get('temperature')} ({'greedy' if not sampler.get('temperature') else 'sampled'}). "
            f"Sudoku reward = fraction of empty cells filled correctly (d1); solved = all of them.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (RL rewards of a few prompts per step are noisy)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def quickstart_plot(out: Path, sft_metrics: Path, rl_metrics: Path, rows: list[dict], title: str = "") -> Optional[Path]:
    """Three panels: SFT loss, RL training reward (raw + moving average), held-out mean reward before/after."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.6))
    loss = read_curve(sft_metrics, "loss")
    ax = axes[0]
    if loss:
        ax.plot([p[0] for p in loss], [p[1] for p in loss], lw=0.8, alpha=0.4, color="C0")
        ax.plot([p[0] for p in loss], smooth([p[1] for p in loss], 25), lw=1.6, color="C0")
    ax.set_title("SFT loss (masked-diffusion NELBO)")
    ax.set_xlabel("SFT step")
    ax.grid(alpha=0.3)
    reward = read_curve(rl_metrics, "reward_mean")
    ax = axes[1]
    if reward:
        steps, vals = [p[0] for p in reward], [p[1] for p in reward]
        ax.plot(steps, vals, lw=0.8, alpha=0.4, color="C1", label="per step")
        ax.plot(steps, smooth(vals, 10), lw=1.8, color="C1", label="moving avg (10)")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_title("RL training reward (sampled rollouts)")
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax = axes[2]
    bench = next(iter(rows[0]["results"])) if rows and rows[0]["results"] else None
    if bench:
        vals = [r["results"][bench]["mean_score"] for r in rows]
        bars = ax.bar(range(len(rows)), vals, color=["C0", "C1", "C2", "C3"][:len(rows)])
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.3f}", ha="center", va="bottom", fontsize=9)
        ax.set_xticks(range(len(rows)), [r["model"] for r in rows], fontsize=8)
        ax.set_ylim(0, max(1.0, max(vals) * 1.15))
        ax.set_title(f"held-out {bench} mean reward (greedy)")
    ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


# ----------------------------------------------------------------------------------------------------------
# The comparison
# ----------------------------------------------------------------------------------------------------------


def mean_spread(values: list[float]) -> tuple[Optional[float], Optional[float]]:
    """Mean and sample standard deviation (0 for one value; None for none)."""
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def compare_table(results: dict, bench: str) -> str:
    """Markdown table of the comparison: per family, the SFT baseline then one row per algorithm.

    ``results = {family: {"baseline": summary, "runs": {algo: [run, ...]}, "failed": {algo: message}}}`` where a
    run holds ``after`` ({bench: summary}), ``seed``, ``seconds`` and ``train_reward_first/last``.
    """
    head = ["model", "method", f"held-out {bench} mean reward", "change vs SFT", "solved (%)", "seeds",
            "train reward first -> last 10 steps", "min / run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    for family, res in results.items():
        base = res["baseline"][bench]
        lines.append(f"| {family} | SFT baseline | {base['mean_score']:.3f} | | {_pct(base['accuracy'])} | - | | |")
        for algo, runs in sorted(res["runs"].items()):
            scores = [r["after"][bench]["mean_score"] for r in runs]
            accs = [r["after"][bench]["accuracy"] for r in runs]
            m, sd = mean_spread(scores)
            ma, _ = mean_spread(accs)
            first, _ = mean_spread([r["train_reward_first"] for r in runs if r.get("train_reward_first") is not None])
            last, _ = mean_spread([r["train_reward_last"] for r in runs if r.get("train_reward_last") is not None])
            mins, _ = mean_spread([r["seconds"] / 60.0 for r in runs])
            delta = m - base["mean_score"]
            train = f"{first:.3f} -> {last:.3f}" if first is not None and last is not None else "-"
            lines.append(f"| {family} | {algo} | {m:.3f} ± {sd:.3f} | {delta:+.3f} | {_pct(ma)} | {len(runs)} | {train} | "
                         f"{mins:.1f} |")
        for algo, msg in sorted(res.get("failed", {}).items()):
            lines.append(f"| {family} | {algo} | failed: {msg} | | | | | |")
    return "\n".join(lines) + "\n"


def compare_plot(out: Path, results: dict, bench: str, window: int = 10) -> Optional[Path]:
    """One panel per family: every algorithm's RL training reward (moving average, mean over seeds), with the
    held-out means as markers on the right edge and the SFT baseline as a dashed line."""
    plt = _plt()
    fams = [f for f in results if results[f]["runs"]]
    if not fams:
        return None
    fig, axes = plt.subplots(1, len(fams), figsize=(6.5 * len(fams), 4.2), squeeze=False)
    for ax, family in zip(axes[0], fams):
        res = results[family]
        cmap = plt.get_cmap("tab10")
        for i, (algo, runs) in enumerate(sorted(res["runs"].items())):
            curves = [read_curve(r["metrics"], "reward_mean") for r in runs]
            curves = [c for c in curves if c]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            steps = [p[0] for p in curves[0][:n]]
            mean = [statistics.fmean(c[j][1] for c in curves) for j in range(n)]
            held, _ = mean_spread([r["after"][bench]["mean_score"] for r in runs])
            ax.plot(steps, smooth(mean, window), lw=1.6, color=cmap(i % 10), label=f"{algo} (held-out {held:.3f})")
        base = res["baseline"][bench]["mean_score"]
        ax.axhline(base, color="k", ls="--", lw=1, label=f"SFT baseline held-out {base:.3f}")
        ax.set_title(f"{family}: RL training reward (moving avg {window}, mean of seeds)")
        ax.set_xlabel("RL step")
        ax.set_ylabel(f"{bench} reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)
