"""Running the comparison (``dare compare``): every registered RL algorithm on the embedded CPU task, side by side
(a mini Table 5).

For each shipped SFT checkpoint of the chosen task (one per family: a tiny LLaDA and a tiny SDAR) the comparison
evaluates the SFT baseline once, then runs every registered RL algorithm whose ``supports`` lists the checkpoint's
attention kind, for ``seeds`` seeds, from one recipe (the checkpoint's ``compare_recipe`` plus its manifest's
``recipe_overrides``: same prompts, rollout sampler, group size, reward and held-out evaluation).

The comparison is **budget-matched** and uses **each method's own paper settings** (``Algorithm.paper``, see
``dare.algorithms.paper``):

* every method makes the same number of optimizer updates (``--updates``, default the recipe's ``train.steps``) and
  sees the same number of rollouts: a method with ``mu`` inner iterations runs ``updates / mu`` steps of
  ``mu x train.batch_size`` prompts (warm-up counts updates, so it is matched too);
* its learning rate is the recipe's ``optim.lr`` times ``paper.lr / anchor.paper.lr`` (the anchor is the recipe's
  ``algorithm.name``, the default method) times the comparison's documented factor for the method, if any
  (``Algorithm.departure``, ``departures.lr_factor``), its gradient-norm clip and rollout temperature are its paper's, and so are the
  per-task values of its authors' scripts for the recipe's task (mu, KL, ...).

``--shared-settings`` turns the second part off (one lr / clip / temperature for all, each method's config defaults).
Algorithms come from the registry (``dare.algorithms.ALGORITHMS``, ``uses_rollout``), never from a list of names;
finished runs are reused (``summary.json`` per run), only new ones run.

Outputs (``--output-dir``): one folder per (family, algorithm, seed) with the run and its held-out eval,
``comparison.json`` (the report's data: baseline and each algorithm's settings, mean and spread over seeds, ...;
``report.py``), ``comparison.md`` (the table rendered from that data) and ``comparison.png`` (reward curves over
optimizer updates, mean and band over seeds). ``report_from_data`` renders the table from a stored data file alone.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..quickstart.assets import get_checkpoint, recipe_path, shipped_checkpoints
from ..quickstart.stages import eval_stage, fmt_seconds, load_stage_recipe, read_curve, set_threads, train_stage
from .departures import lr_departures, lr_factor
from .report import compare_plot, comparison_data, dump_data, load_data, merge_data, render_summary, render_table

log = logging.getLogger(__name__)

# An algorithm that declares no ``supports`` is taken to be a masked-diffusion method (the one-step estimators
# of d1-style methods score a [prompt ; completion] view without the block-diffusion layout).
DEFAULT_SUPPORTS = ("bidirectional",)


@dataclass
class CompareOptions:
    algorithms: Optional[list[str]] = None  # default: every registered RL algorithm
    families: Optional[list[str]] = None  # default: every shipped checkpoint of the task
    task: Optional[str] = None  # shipped checkpoints' task (manifest "task"); default: the default quickstart's
    seeds: int = 3
    updates: Optional[int] = None  # optimizer updates per run (default: the compare recipe's train.steps)
    paper_settings: bool = True  # each method's own paper lr scale / grad clip / temperature / task values
    eval_limit: Optional[int] = None  # default: the recipe's eval.limit
    output_dir: str = "runs/compare"
    overrides: list[str] = field(default_factory=list)  # "key=value" for every run, "algo:key=value" for one method
    resume: bool = True  # reuse finished runs (their summary.json)
    report_only: bool = False  # only tabulate finished runs (e.g. while others still run); start none
    docs_dir: Optional[str] = None  # also write the table, its data and the figure there (e.g. docs/)
    merge: bool = False  # merge these runs' rows into docs_dir's stored comparison.json (its figure is kept)
    threads: Optional[int] = 1  # torch intra-op threads (None: PyTorch's choice)
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
    task = opts.task or default_task()
    cks = {n: c for n, c in shipped_checkpoints().items() if c.task == task}
    if not cks:
        tasks = sorted({c.task for c in shipped_checkpoints().values()})
        raise ValueError(f"no shipped checkpoint of task {task!r}; tasks: {', '.join(tasks)}")
    fams = opts.families or [c.family for c in cks.values()]
    by_family = {c.family: c for c in cks.values()}
    bad = [f for f in fams if f not in by_family]
    if bad:
        raise ValueError(f"no shipped {task} checkpoint for famil(y/ies) {bad}; shipped: {', '.join(by_family)}")
    out = []
    for fam in fams:
        ck = by_family[fam]
        out.append((ck, [a for a in wanted if ck.attention in supports(algos[a])]))
    return out


def method_settings(rpath, base_ov: list[str], name: str, anchor: str, opts: CompareOptions,
                    user_ov: list[str], attention: Optional[str] = None) -> tuple[list[str], dict]:
    """The overrides that make ``name``'s run budget-matched (and, with ``opts.paper_settings``, give it its paper's
    relative settings), and a summary of its settings for the table.

    ``base_ov`` are the checkpoint's overrides, ``attention`` its model's attention kind; ``user_ov`` the user's
    ``--set name:...`` (applied last, so they win over the paper's values; the budget is computed after them).
    """
    from ..algorithms import build_algorithm, get_algorithm
    from ..algorithms.paper import paper_overrides
    from ..data.registry import DATASETS

    base = load_stage_recipe(rpath, base_ov)
    updates = opts.updates or base.train.steps
    ov = []
    if opts.paper_settings:
        ds = base.data.dataset
        task = DATASETS[ds.name].task if ds is not None and ds.name in DATASETS else None
        ov += paper_overrides(get_algorithm(name), get_algorithm(anchor), base.optim.lr, task, attention,
                              lr_factor=lr_factor(name))
    ov += list(user_ov) + [f"algorithm.name={name}"]
    recipe = load_stage_recipe(rpath, base_ov + ov)
    mu = build_algorithm(recipe.algorithm).inner_iterations
    if updates % mu:
        raise ValueError(f"{name}: {updates} optimizer updates are not a multiple of its mu = {mu} (inner iterations); "
                         f"choose --updates as a multiple of every method's mu")
    steps, prompts = updates // mu, base.train.batch_size * mu
    ov += [f"train.steps={steps}", f"train.batch_size={prompts}"]
    info = {"mu": mu, "steps": steps, "prompts_per_step": prompts, "updates": updates, "lr": recipe.optim.lr,
            "grad_clip": recipe.optim.grad_clip, "temperature": recipe.rollout.sampler.temperature,
            "rollouts": steps * prompts * recipe.rollout.group_size, "paper_settings": opts.paper_settings,
            "lora": recipe.lora.r if recipe.lora.enabled else None}
    return ov, info


def compare_recipe(ck) -> tuple[Path, list[str]]:
    """The recipe a shipped checkpoint ``ck`` is compared with (its manifest's ``compare_recipe``) and the overrides
    that point it at the checkpoint."""
    return recipe_path(ck.info.get("compare_recipe", "compare.yaml")), [f"model.path={ck.path}", *ck.recipe_overrides]


def default_task() -> str:
    """The task of the default quickstart checkpoint."""
    from ..quickstart.pipeline import DEFAULT_CHECKPOINT
    return get_checkpoint(DEFAULT_CHECKPOINT).task


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


def _train_reward_ends(metrics: Path, n: int = 10) -> tuple[Optional[float], Optional[float]]:
    """Mean training reward of the first and the last steps: ``n`` steps, or a quarter of a shorter run (a mu = 8
    method makes 6 steps, where two 10-step windows would be the same numbers)."""
    pts = [v for _, v in read_curve(metrics, "reward_mean")]
    if not pts:
        return None, None
    k = max(1, min(n, len(pts) // 4))
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
            rpath, ck_ov = compare_recipe(ck)
            base_ov = ck_ov + common
            if opts.eval_limit is not None:
                base_ov.append(f"eval.limit={opts.eval_limit}")
            recipe = load_stage_recipe(rpath, base_ov + [f"train.output_dir={out}"])
            anchor = recipe.algorithm.name
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
            fam = results.setdefault(ck.family, {"checkpoint": ck.name, "task": ck.task, "anchor": anchor,
                                                 "baseline": baseline, "runs": {}, "failed": {}})
            for name in names:
                for seed in range(opts.seeds):
                    done_runs += 1
                    run_dir = fam_dir / name / f"seed-{seed}"
                    summary_file = run_dir / "summary.json"
                    if (opts.resume or opts.report_only) and summary_file.exists():
                        done = json.loads(summary_file.read_text())
                        if Path(done.get("metrics", "")).is_file():  # recomputed: the windows may have changed
                            done["train_reward_first"], done["train_reward_last"] = _train_reward_ends(Path(done["metrics"]))
                        fam["runs"].setdefault(name, []).append(done)
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
                    method_ov, settings = method_settings(rpath, base_ov, name, anchor, opts, per_algo.get(name, []),
                                                          ck.attention)
                    ov = base_ov + method_ov + [f"train.seed={seed}", f"train.output_dir={run_dir}"]
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
                               "steps": tr.recipe.train.steps, "settings": settings}
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
    """The report of finished runs: its data, the table rendered from the data, and the figure (from the runs)."""
    png = compare_plot(out / "comparison.png", results, bench)
    write_report(out, comparison_data(results, bench), opts.docs_dir, echo, png, merge=opts.merge)


def write_report(out: Path, data: dict, docs_dir: Optional[str], echo=print, png: Optional[Path] = None,
                 merge: bool = False) -> None:
    """``out``/comparison.json (the data) and comparison.md (the table rendered from it); with ``docs_dir``, the same
    table as comparison_table.md and the data as comparison.json there, and the figure if there is one. ``merge``:
    in ``docs_dir`` these rows join its stored data (``merge_data``) and its figure stays (it needs every run)."""
    table = render_table(data)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.md").write_text(table, encoding="utf-8")
    (out / "comparison.json").write_text(dump_data(data), encoding="utf-8")
    echo("\n" + table + "\n" + render_summary(data, lr_departures()), flush=True)
    echo(f"wrote {out / 'comparison.md'}, {out / 'comparison.json'}" + (f", {png}" if png else ""), flush=True)
    if docs_dir:
        docs = Path(docs_dir)
        docs.mkdir(parents=True, exist_ok=True)
        if merge:
            data, png = merge_data(load_data(docs / "comparison.json"), data), None
            table = render_table(data)
        (docs / "comparison_table.md").write_text(table, encoding="utf-8")
        (docs / "comparison.json").write_text(dump_data(data), encoding="utf-8")
        if png:
            shutil.copyfile(png, docs / "comparison.png")
        echo(f"wrote the table and its data{' and the figure' if png else ''} to {docs}"
             + (" (merged into the stored rows; the figure kept)" if merge else ""), flush=True)


def report_from_data(path, opts: CompareOptions, echo=print) -> dict:
    """``--report-only --data FILE``: the table of a stored report's data (e.g. docs/comparison.json), no runs needed
    (the figure needs the runs' curves, so none is drawn); written as ``write_report`` does. Returns the data."""
    data = load_data(path)
    write_report(Path(opts.output_dir), data, opts.docs_dir, echo, merge=opts.merge)
    return data
