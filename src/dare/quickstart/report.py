"""Tables and figures of the quickstart (before/after; the comparison's are dare.comparison.report)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .stages import read_curve


def pct(x: Optional[float]) -> str:
    """A fraction as the percent every dare table prints (one decimal; "-" for none)."""
    return "-" if x is None else f"{100.0 * x:.1f}"


def quickstart_table(rows: list[dict], settings: dict) -> str:
    """Markdown: one row per model; per benchmark the greedy score (the headline: mean reward in percent, the scale
    ``dare eval`` prints) and the share fully solved, and, when the evaluation also sampled k completions per example
    at the rollout temperature, their score, best-of-k score and pass@k; a last row with the change in points."""
    benches = list(settings["benchmarks"])
    sampled = any("sampled" in r["results"].get(b, {}) for r in rows for b in benches)
    head = ["model"]
    for b in benches:
        head += [f"{b} greedy score (%)", "greedy solved (%)"]
        if sampled:
            k = next(r["results"][b]["sampled"]["k"] for r in rows if "sampled" in r["results"].get(b, {}))
            head += [f"sampled score (k={k}, %)", f"best-of-{k} score (%)", f"pass@{k} (%)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]

    def cells_of(res: dict) -> list[Optional[float]]:
        out = []
        for b in benches:
            s = res.get(b, {})
            out += [s.get("mean_score"), s.get("accuracy")]
            if sampled:
                sm = s.get("sampled", {})
                out += [sm.get("mean_score"), sm.get("best_of_k_mean"), sm.get("pass_at_k")]
        return out

    for r in rows:
        lines.append("| " + " | ".join([r["model"]] + [pct(v) for v in cells_of(r["results"])]) + " |")
    if len(rows) == 2:
        a, z = cells_of(rows[0]["results"]), cells_of(rows[1]["results"])
        diff = ["-" if x is None or y is None else f"{100 * (y - x):+.1f}" for x, y in zip(a, z)]
        lines.append("| " + " | ".join(["change"] + diff) + " |")
    n = settings.get("limit")
    sampler = settings.get("sampler", {})
    note = (f"Held-out: {', '.join(benches)} test split, {n if n is not None else 'all'} examples, "
            f"{settings.get('template')} prompts. Greedy: gen_length {sampler.get('gen_length')}, {sampler.get('steps')} "
            f"steps, temperature {sampler.get('temperature')}.")
    rs = settings.get("rollout_sampler")
    if sampled and rs:
        ns = settings.get("sample_limit")
        note += (f" Sampled: the RL rollout's sampler ({rs.get('steps')} steps, temperature {rs.get('temperature')}), "
                 f"k completions per puzzle on the first {ns if ns is not None else 'all'} puzzles; best-of-k = mean "
                 f"over puzzles of the best completion's score; pass@k = puzzles with a fully solved completion.")
    note += (" Sudoku score = the percent of the empty cells filled correctly (d1's verifier's reward x 100, as "
             "`dare eval` prints it); solved = all of them; the change is in points.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (RL rewards of a few prompts per step are noisy)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (runs write PNGs on machines without a display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def quickstart_plot(out: Path, sft_metrics: Path, rl_metrics: Path, rows: list[dict], title: str = "") -> Optional[Path]:
    """Three panels: SFT loss, RL training reward (raw + moving average), held-out score before/after."""
    plt = pyplot()
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
        metrics = [("greedy", lambda s: s.get("mean_score"))]
        if all("sampled" in r["results"][bench] for r in rows):
            k = rows[0]["results"][bench]["sampled"]["k"]
            metrics += [(f"sampled (k={k})", lambda s: s["sampled"]["mean_score"]),
                        (f"best-of-{k}", lambda s: s["sampled"]["best_of_k_mean"])]
        width = 0.8 / len(rows)
        for j, r in enumerate(rows):
            vals = [100 * fn(r["results"][bench]) for _, fn in metrics]  # percent, as the table
            xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(metrics))]
            bars = ax.bar(xs, vals, width=width * 0.95, color=f"C{j}", label=r["model"])
            for b, v in zip(bars, vals):
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(metrics)), [m for m, _ in metrics], fontsize=8)
        ax.set_ylim(0, 100)
        ax.legend(loc="upper left", fontsize=7)
        ax.set_title(f"held-out {bench} score (%)")
    ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)
