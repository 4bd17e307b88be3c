"""``dare compare``: every registered RL algorithm on the embedded CPU task, side by side (a mini Table 5).

For each shipped SFT checkpoint (one per family: a tiny LLaDA and a tiny SDAR, both SFT'd on 4x4 Sudoku) the
comparison evaluates the SFT baseline once, then runs every registered RL algorithm whose ``supports`` lists the
checkpoint's attention kind, for ``seeds`` seeds, with the same recipe (the checkpoint's ``compare_recipe``, default
``compare.yaml``, plus its manifest's ``recipe_overrides``, e.g. SDAR's decoding block length: same prompts, rollout sampler, group size, reward, optimizer, steps and held-out evaluation); only
``algorithm.name`` changes, so every method runs with its own (paper) defaults. Algorithms come from the registry
(``dare.algorithms.ALGORITHMS``, ``uses_rollout``), never from a list of names, so a newly registered method is
picked up by rerunning the command; finished runs are reused (``summary.json`` per run), only new ones run.

Outputs (``--output-dir``): one folder per (family, algorithm, seed) with the run and its held-out eval,
``comparison.md`` / ``comparison.json`` (baseline and each algorithm: mean and spread over seeds) and
``comparison.png`` (all reward curves).
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .assets import recipe_path, shipped_checkpoints
from .report import compare_plot, compare_table
from .stages import eval_stage, fmt_seconds, load_stage_recipe, read_curve, set_threads, train_stage

log = logging.getLogger(__name__)

# An algorithm that declares no ``supports`` is taken to be a masked-diffusion method (the one-step estimators
# of d1-style methods score a [prompt ; completion] view without the block-diffusion layout).
DEFAULT_SUPPORTS = ("bidirectional",)


@dataclass
class CompareOptions:
    algorithms: Optional[list[str]] = None  # default: every registered RL algorithm
    families: Optional[list[str]] = None  # default: every shipped checkpoint
    seeds: int = 3
    steps: Optional[int] = None  # default: the compare recipe's train.steps
    eval_limit: Optional[int] = None  # default: the recipe's eval.limit
    output_dir: str = "runs/compare"
    overrides: list[str] = field(default_factory=list)  # "key=value" for every run, "algo:key=value" for one method
    resume: bool = True  # reuse finished runs (their summary.json)
    report_only: bool = False  # only tabulate finished runs (e.g. while others still run); start none
    docs_dir: Optional[str] = None  # also copy comparison.md/.png there (e.g. docs/)
    threads: Optional[int] = None
    progress: bool = True


def rl_algorithms() -> dict[str, type]:
    """Registered algorithms that train from rollouts (``uses_rollout``), by name."""
    from ..algorithms import ALGORITHMS, load_builtin_algorithms
    load_builtin_algorithms()
    return {name: cls for name, cls in sorted(ALGORITHMS.items()) if getattr(cls, "uses_rollout", False)}


def supports(cls) -> tuple[str, ...]:
    return tuple(getattr(cls, "supports", None) or DEFAULT_SUPPORTS)


def split_overrides(overrides: list[str], algorithms) -> tuple[list[str], dict[str, list[str]]]:
    """``key=value`` (every run) vs ``algo:key=value`` (that algorithm only); unknown algorithm prefixes are errors."""
    common, per = [], {}
    for item in overrides:
        head, sep, rest = item.partition(":")
        if sep and "=" not in head:
            if head not in algorithms:
                raise ValueError(f"override {item!r}: {head!r} is not a registered RL algorithm "
                                 f"({', '.join(algorithms)})")
            per.setdefault(head, []).append(rest)
        else:
            common.append(item)
    return common, per


def plan(opts: CompareOptions) -> list[tuple]:
    """[(checkpoint, [algorithm names])] after the filters; errors for unknown names."""
    algos = rl_algorithms()
    wanted = opts.algorithms or list(algos)
    unknown = [a for a in wanted if a not in algos]
    if unknown:
        raise ValueError(f"not registered RL algorithm(s) {unknown}; registered: {', '.join(algos)}")
    cks = shipped_checkpoints()
    fams = opts.families or [c.family for c in cks.values()]
    by_family = {c.family: c for c in cks.values()}
    bad = [f for f in fams if f not in by_family]
    if bad:
        raise ValueError(f"no shipped checkpoint for famil(y/ies) {bad}; shipped: {', '.join(by_family)}")
    out = []
    for fam in fams:
        ck = by_family[fam]
        out.append((ck, [a for a in wanted if ck.attention in supports(algos[a])]))
    return out


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


def _train_reward_ends(metrics: Path, n: int = 10) -> tuple[Optional[float], Optional[float]]:
    pts = [v for _, v in read_curve(metrics, "reward_mean")]
    if not pts:
        return None, None
    k = min(n, len(pts))
    return sum(pts[:k]) / k, sum(pts[-k:]) / k


def run_compare(opts: CompareOptions, echo=print) -> dict:
    from ..rewards import close_pool

    set_threads(opts.threads)
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    algos = rl_algorithms()
    common, per_algo = split_overrides(opts.overrides, algos)
    todo = plan(opts)
    total = sum(len(names) for _, names in todo) * opts.seeds
    t0, done_runs, run_times = time.perf_counter(), 0, []
    results: dict = {}
    bench = None
    try:
        for ck, names in todo:
            rpath = recipe_path(ck.info.get("compare_recipe", "compare.yaml"))
            base_ov = [f"model.path={ck.path}"] + list(ck.recipe_overrides) + common
            if opts.steps is not None:
                base_ov.append(f"train.steps={opts.steps}")
            if opts.eval_limit is not None:
                base_ov.append(f"eval.limit={opts.eval_limit}")
            recipe = load_stage_recipe(rpath, base_ov + [f"train.output_dir={out}"])
            bench = recipe.eval.benchmarks[0]
            fam_dir = out / ck.family
            base_file = fam_dir / "baseline.json"
            if opts.resume and base_file.exists():
                baseline = json.loads(base_file.read_text())
            else:
                echo(f"\n[{ck.family}] held-out eval of the SFT baseline {ck.name}", flush=True)
                baseline = eval_stage(ck.path, recipe, fam_dir / "baseline", "sft", progress=opts.progress)
                fam_dir.mkdir(parents=True, exist_ok=True)
                base_file.write_text(json.dumps(baseline, indent=1))
            fam = results.setdefault(ck.family, {"checkpoint": ck.name, "baseline": baseline, "runs": {}, "failed": {}})
            for name in names:
                for seed in range(opts.seeds):
                    done_runs += 1
                    run_dir = fam_dir / name / f"seed-{seed}"
                    summary_file = run_dir / "summary.json"
                    if (opts.resume or opts.report_only) and summary_file.exists():
                        fam["runs"].setdefault(name, []).append(json.loads(summary_file.read_text()))
                        continue
                    if opts.report_only:
                        continue
                    if run_dir.exists():
                        shutil.rmtree(run_dir)  # an unfinished run of an earlier invocation: start it over
                    eta = ""
                    if run_times:
                        left = (total - done_runs + 1) * sum(run_times) / len(run_times)
                        eta = f", ETA {fmt_seconds(left)}"
                    echo(f"\n[run {done_runs}/{total}] {ck.family} / {name} / seed {seed}   "
                         f"(elapsed {fmt_seconds(time.perf_counter() - t0)}{eta})", flush=True)
                    ov = base_ov + per_algo.get(name, []) + [f"algorithm.name={name}", f"train.seed={seed}",
                                                             f"train.output_dir={run_dir}"]
                    started = time.perf_counter()
                    try:
                        tr = train_stage(rpath, ov, progress=opts.progress)
                        after = eval_stage(tr.export, tr.recipe, run_dir / "eval", f"{name}-seed{seed}", seed=seed,
                                           progress=opts.progress)
                    except Exception as e:  # one method failing must not sink the table: record and go on
                        log.exception("%s / %s / seed %d failed", ck.family, name, seed)
                        fam["failed"][name] = _first_line(e)
                        break
                    first, last = _train_reward_ends(tr.metrics)
                    summary = {"family": ck.family, "algorithm": name, "seed": seed, "after": after,
                               "seconds": round(time.perf_counter() - started, 1), "train_seconds": round(tr.seconds, 1),
                               "metrics": str(tr.metrics), "train_reward_first": first, "train_reward_last": last,
                               "steps": tr.recipe.train.steps}
                    summary_file.write_text(json.dumps(summary, indent=1))
                    fam["runs"].setdefault(name, []).append(summary)
                    run_times.append(summary["seconds"])
                    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # keep the export, not the optimizer
    finally:
        close_pool()
        if results and bench:
            write_outputs(out, results, bench, opts, echo)
    return results


def write_outputs(out: Path, results: dict, bench: str, opts: CompareOptions, echo=print) -> None:
    table = compare_table(results, bench)
    (out / "comparison.md").write_text(table)
    (out / "comparison.json").write_text(json.dumps(results, indent=1, default=str))
    png = compare_plot(out / "comparison.png", results, bench)
    echo("\n" + table, flush=True)
    echo(f"wrote {out / 'comparison.md'}, {out / 'comparison.json'}" + (f", {png}" if png else ""), flush=True)
    if opts.docs_dir:
        docs = Path(opts.docs_dir)
        docs.mkdir(parents=True, exist_ok=True)
        (docs / "comparison_table.md").write_text(table)
        if png:
            shutil.copyfile(png, docs / "comparison.png")
        echo(f"copied the table and figure to {docs}", flush=True)
