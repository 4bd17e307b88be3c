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
    """Markdown: one row per model; per benchmark the greedy mean reward (the headline) and fraction fully solved,
    and, when the evaluation also sampled k completions per example at the rollout temperature, their mean reward,
    best-of-k mean and pass@k; a last row with the change."""
    benches = list(settings["benchmarks"])
    sampled = any("sampled" in r["results"].get(b, {}) for r in rows for b in benches)
    head = ["model"]
    for b in benches:
        head += [f"{b} greedy mean reward", "greedy solved (%)"]
        if sampled:
            k = next(r["results"][b]["sampled"]["k"] for r in rows if "sampled" in r["results"].get(b, {}))
            head += [f"sampled mean reward (k={k})", f"best-of-{k} mean reward", f"pass@{k} (%)"]
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

    pct = {i for i, h in enumerate(head[1:]) if "(%)" in h}
    for r in rows:
        vals = cells_of(r["results"])
        lines.append("| " + " | ".join([r["model"]] + [_pct(v) if i in pct else ("-" if v is None else f"{v:.3f}")
                                                        for i, v in enumerate(vals)]) + " |")
    if len(rows) == 2:
        a, z = cells_of(rows[0]["results"]), cells_of(rows[1]["results"])
        diff = ["-" if x is None or y is None else (f"{100 * (y - x):+.1f}" if i in pct else f"{y - x:+.3f}")
                for i, (x, y) in enumerate(zip(a, z))]
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
                 f"over puzzles of the best completion's reward; pass@k = puzzles with a fully solved completion.")
    note += " Sudoku reward = fraction of the empty cells filled correctly (d1's verifier); solved = all of them."
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
        metrics = [("greedy", lambda s: s.get("mean_score"))]
        if all("sampled" in r["results"][bench] for r in rows):
            k = rows[0]["results"][bench]["sampled"]["k"]
            metrics += [(f"sampled (k={k})", lambda s: s["sampled"]["mean_score"]),
                        (f"best-of-{k}", lambda s: s["sampled"]["best_of_k_mean"])]
        width = 0.8 / len(rows)
        for j, r in enumerate(rows):
            vals = [fn(r["results"][bench]) for _, fn in metrics]
            xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(metrics))]
            bars = ax.bar(xs, vals, width=width * 0.95, color=f"C{j}", label=r["model"])
            for b, v in zip(bars, vals):
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(metrics)), [m for m, _ in metrics], fontsize=8)
        ax.set_ylim(0, 1.0)
        ax.legend(loc="upper left", fontsize=7)
        ax.set_title(f"held-out {bench} mean reward")
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


def learning_verdict(gain: float, spread: float, anchor_gain: Optional[float], n_seeds: int) -> str:
    """The comparison's bar: the mean held-out gain is above twice its seed spread and at least half the default
    (anchor) method's gain."""
    if n_seeds < 2:
        return "1 seed"
    ok = gain > 2.0 * spread and gain > 0 and (anchor_gain is None or anchor_gain <= 0 or gain >= 0.5 * anchor_gain)
    return "yes" if ok else "no"


def _run_gains(runs: list[dict], bench: str, base: float) -> tuple[float, float]:
    m, sd = mean_spread([r["after"][bench]["mean_score"] for r in runs])
    return m - base, sd


def compare_table(results: dict, bench: str) -> str:
    """Markdown table of the comparison: per family, the SFT baseline then one row per algorithm.

    ``results = {family: {"baseline": summary, "anchor": name, "runs": {algo: [run, ...]}, "failed": {algo: msg}}}``
    where a run holds ``after`` ({bench: summary}), ``seed``, ``seconds``, ``settings`` (mu, steps, lr, ...) and
    ``train_reward_first/last``.
    """
    head = ["model", "method", "mu", "steps x prompts", "lr", "clip", "temp.", "LoRA r", f"held-out {bench} mean reward",
            "change vs SFT", "learns", "solved (%)", "seeds", "train reward first -> last", "min / run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    for family, res in results.items():
        base = res["baseline"][bench]
        lines.append(f"| {family} | SFT baseline | | | | | | | {base['mean_score']:.3f} | | | {_pct(base['accuracy'])} "
                     f"| - | | |")
        anchor_runs = res["runs"].get(res.get("anchor"))
        anchor_gain = _run_gains(anchor_runs, bench, base["mean_score"])[0] if anchor_runs else None
        for algo, runs in sorted(res["runs"].items()):
            scores = [r["after"][bench]["mean_score"] for r in runs]
            m, sd = mean_spread(scores)
            ma, _ = mean_spread([r["after"][bench]["accuracy"] for r in runs])
            first, _ = mean_spread([r["train_reward_first"] for r in runs if r.get("train_reward_first") is not None])
            last, _ = mean_spread([r["train_reward_last"] for r in runs if r.get("train_reward_last") is not None])
            mins, _ = mean_spread([r["seconds"] / 60.0 for r in runs])
            delta = m - base["mean_score"]
            st = runs[0].get("settings") or {}
            clip = st.get("grad_clip")
            cells = [family, algo + (" (default)" if algo == res.get("anchor") else ""), str(st.get("mu", "-")),
                     f"{st['steps']} x {st['prompts_per_step']}" if "steps" in st else str(runs[0].get("steps", "-")),
                     f"{st['lr']:.3g}" if "lr" in st else "-", "-" if clip is None else f"{clip:g}",
                     f"{st['temperature']:g}" if "temperature" in st else "-", str(st.get("lora") or "-"),
                     f"{m:.3f} ± {sd:.3f}", f"{delta:+.3f}",
                     learning_verdict(delta, sd, anchor_gain, len(runs)), _pct(ma), str(len(runs)),
                     f"{first:.3f} -> {last:.3f}" if first is not None and last is not None else "-", f"{mins:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        for algo, msg in sorted(res.get("failed", {}).items()):
            lines.append(f"| {family} | {algo} | | | | | | | failed: {msg} | | | | | | |")
    return "\n".join(lines) + "\n"


def compare_plot(out: Path, results: dict, bench: str, window: int = 5) -> Optional[Path]:
    """One panel per family: every algorithm's RL training reward against optimizer updates (the matched budget;
    moving average, mean over seeds with a min-max band), the held-out means in the legend and the SFT baseline as a
    dashed line."""
    plt = _plt()
    fams = [f for f in results if results[f]["runs"]]
    if not fams:
        return None
    fig, axes = plt.subplots(1, len(fams), figsize=(7.0 * len(fams), 4.6), squeeze=False)
    for ax, family in zip(axes[0], fams):
        res = results[family]
        cmap = plt.get_cmap("tab20")
        for i, (algo, runs) in enumerate(sorted(res["runs"].items())):
            curves = [read_curve(r["metrics"], "reward_mean") for r in runs]
            curves = [c for c in curves if c]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            mu = (runs[0].get("settings") or {}).get("mu", 1)
            x = [p[0] * mu for p in curves[0][:n]]  # optimizer updates after each step
            per_seed = [smooth([p[1] for p in c[:n]], window) for c in curves]
            mean = [statistics.fmean(v[j] for v in per_seed) for j in range(n)]
            lo = [min(v[j] for v in per_seed) for j in range(n)]
            hi = [max(v[j] for v in per_seed) for j in range(n)]
            held, sd = mean_spread([r["after"][bench]["mean_score"] for r in runs])
            color = cmap(i % 20)
            ax.plot(x, mean, lw=1.6, color=color, marker="o" if n < 12 else None, ms=3,
                    label=f"{algo} (held-out {held:.3f} ± {sd:.3f})")
            if len(per_seed) > 1:
                ax.fill_between(x, lo, hi, color=color, alpha=0.15, lw=0)
        base = res["baseline"][bench]["mean_score"]
        ax.axhline(base, color="k", ls="--", lw=1, label=f"SFT baseline held-out {base:.3f}")
        ax.set_title(f"{family}: RL training reward (moving avg {window}; mean and min-max over seeds)", fontsize=10)
        ax.set_xlabel("optimizer updates (every method: the same updates and rollouts)")
        ax.set_ylabel(f"{bench} reward (sampled rollouts)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)
