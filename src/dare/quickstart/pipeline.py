"""``dare quickstart``: a tiny diffusion LM trained by dare, improved by dLLM RL, evaluated by dare's runner.

Stages (each is a real component; nothing is re-implemented here):

  [sft]      ``--from-scratch`` only: ``dare train recipes/quickstart/sft.yaml`` (tiny LLaDA, 4x4 Sudoku SFT).
             By default the shipped checkpoint ``dare/assets/quickstart/sudoku-llada-sft`` (made by that recipe)
             is used, so RL starts at once.
  [eval]     held-out evaluation of the SFT model (``dare.eval.evaluate``, the recipe's ``eval`` section:
             the bundled sudoku test split, greedy low-confidence decoding).
  [rl]       ``dare train recipes/quickstart/rl.yaml model.path=<SFT model>`` (Coupled-GRPO).
  [eval]     the same evaluation of the RL model.
  [report]   before/after table (results.md, summary.json) and quickstart.png (SFT loss, RL reward, held-out
             reward before/after) in the run folder.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .assets import get_checkpoint, recipe_path
from .report import quickstart_plot, quickstart_table
from .stages import eval_settings, eval_stage, fmt_seconds, load_stage_recipe, set_threads, train_stage

log = logging.getLogger(__name__)

DEFAULT_CHECKPOINT = "lazy-sudoku-llada-sft"


@dataclass
class QuickstartOptions:
    output_dir: Optional[str] = None  # default: runs/quickstart/<timestamp>
    from_scratch: bool = False  # rerun the SFT stage instead of starting from the shipped checkpoint
    checkpoint: str = DEFAULT_CHECKPOINT  # shipped SFT checkpoint to start from (see dare.quickstart.assets)
    seed: int = 0
    rl_steps: Optional[int] = None  # default: the RL recipe's train.steps
    sft_steps: Optional[int] = None  # --from-scratch: default the SFT recipe's train.steps
    eval_limit: Optional[int] = None  # held-out puzzles (default: the RL recipe's eval.limit)
    rl_overrides: list[str] = field(default_factory=list)  # dotted overrides of the RL recipe
    sft_overrides: list[str] = field(default_factory=list)  # dotted overrides of the SFT recipe
    rl_recipe: Optional[str] = None  # default: the packaged rl.yaml
    sft_recipe: Optional[str] = None  # default: the shipped checkpoint's SFT recipe
    threads: Optional[int] = 1  # torch intra-op threads (None: PyTorch's choice; 1: see stages.set_threads)
    samples: int = 4  # k completions per held-out puzzle at the rollout temperature (mean, best-of-k, pass@k); 0: off
    sample_limit: Optional[int] = 50  # ... on the first N held-out puzzles (None: all of eval.limit)
    progress: bool = True


class StageLog:
    """Prints one banner per stage with the elapsed time, so a long run shows where it is (each stage's own
    progress bar carries its ETA)."""

    def __init__(self, names: list[str], echo=print):
        self.names, self.echo, self.t0, self.i = names, echo, time.perf_counter(), 0
        self.times: dict[str, float] = {}
        self._start: Optional[float] = None

    def start(self, what: str) -> None:
        self.i += 1
        self._start = time.perf_counter()
        self.echo(f"\n[{self.i}/{len(self.names)}] {what}   (elapsed {fmt_seconds(self._start - self.t0)})", flush=True)

    def done(self, key: str) -> float:
        sec = time.perf_counter() - (self._start or self.t0)
        self.times[key] = round(sec, 1)
        return sec

    @property
    def total(self) -> float:
        return time.perf_counter() - self.t0


def results_markdown(shipped, algo: str, rl_steps: int, table: str) -> str:
    """results.md: what the task is and why RL can improve it (from the checkpoint's manifest), then the table."""
    head = f"# dare quickstart: {shipped.task} ({shipped.family}, {algo}, {rl_steps} RL steps)\n\n"
    about = shipped.info.get("task_note", "")
    return head + (about + "\n\n" if about else "") + table


def default_run_dir() -> Path:
    return Path("runs") / "quickstart" / time.strftime("%Y%m%d-%H%M%S")


def run_quickstart(opts: QuickstartOptions, echo=print) -> dict:
    """Run every stage; returns the summary (also written to ``<run>/summary.json``)."""
    from ..rewards import close_pool
    from ..files import write_text

    set_threads(opts.threads)
    run = Path(opts.output_dir) if opts.output_dir else default_run_dir()
    if (run / "summary.json").exists():
        raise ValueError(f"{run} already holds a finished quickstart run; choose another --output-dir")
    run.mkdir(parents=True, exist_ok=True)
    shipped = get_checkpoint(opts.checkpoint)
    rl_path = Path(opts.rl_recipe) if opts.rl_recipe else recipe_path("rl.yaml")
    sft_path = Path(opts.sft_recipe) if opts.sft_recipe else recipe_path(shipped.sft_recipe)
    seed_ov = [f"train.seed={opts.seed}"]

    # Resolve the RL recipe first so a bad override fails before any work starts.
    # The checkpoint's own overrides (e.g. its decoding block length) come first, so --set can still change them.
    rl_ov = (list(shipped.recipe_overrides) + list(shipped.rl_overrides) + [f"train.output_dir={run / 'rl'}"] + seed_ov
             + list(opts.rl_overrides))
    if opts.rl_steps is not None:
        rl_ov.append(f"train.steps={opts.rl_steps}")
    if opts.eval_limit is not None:
        rl_ov.append(f"eval.limit={opts.eval_limit}")
    rl_recipe = load_stage_recipe(rl_path, rl_ov + ["model.path=" + str(shipped.path)])
    settings = eval_settings(rl_recipe)
    if opts.samples:
        import dataclasses
        settings["rollout_sampler"] = dataclasses.asdict(rl_recipe.rollout.sampler)
        settings["samples"] = opts.samples
        settings["sample_limit"] = opts.sample_limit
    names = (["SFT"] if opts.from_scratch else []) + ["eval SFT", "RL", "eval RL", "report"]
    stages = StageLog(names, echo)
    echo(f"dare quickstart: run folder {run}", flush=True)
    try:
        if opts.from_scratch:
            sft_ov = list(shipped.sft_overrides) + [f"train.output_dir={run / 'sft'}"] + seed_ov + list(opts.sft_overrides)
            if opts.sft_steps is not None:
                sft_ov.append(f"train.steps={opts.sft_steps}")
            stages.start(f"SFT from scratch: dare train {sft_path.name} ({shipped.family}, 4x4 Sudoku)")
            sft = train_stage(sft_path, sft_ov, progress=opts.progress)
            stages.done("sft")
            sft_model, sft_curve = sft.export, sft.metrics
        else:
            sft_model, sft_curve = shipped.path, shipped.sft_metrics
            echo(f"starting from the shipped SFT checkpoint {shipped.path} "
                 f"(made by recipes/quickstart/{shipped.sft_recipe}; --from-scratch reruns it)", flush=True)

        limit = settings["limit"]
        stages.start(f"held-out eval of the SFT model ({', '.join(settings['benchmarks'])}, {limit} examples)")
        before = eval_stage(sft_model, rl_recipe, run / "eval" / "sft", "sft", seed=opts.seed, progress=opts.progress,
                            samples=opts.samples, sample_limit=opts.sample_limit)
        stages.done("eval_sft")

        algo = rl_recipe.algorithm.name
        rl_ov.append(f"model.path={sft_model}")
        stages.start(f"RL: dare train {rl_path.name} ({algo}, {rl_recipe.train.steps} steps x "
                     f"{rl_recipe.train.batch_size} prompts x {rl_recipe.rollout.group_size} samples)")
        rl = train_stage(rl_path, rl_ov, progress=opts.progress)
        stages.done("rl")

        stages.start("held-out eval of the RL model")
        after = eval_stage(rl.export, rl_recipe, run / "eval" / "rl", "rl", seed=opts.seed, progress=opts.progress,
                           samples=opts.samples, sample_limit=opts.sample_limit)
        stages.done("eval_rl")

        stages.start("report")
        rows = [{"model": "SFT (baseline)", "path": str(sft_model), "results": before},
                {"model": f"SFT + {algo}", "path": str(rl.export), "results": after}]
        table = quickstart_table(rows, settings)
        write_text(run / "results.md", results_markdown(shipped, algo, rl_recipe.train.steps, table))
        png = quickstart_plot(run / "quickstart.png", sft_curve, rl.metrics, rows, title=f"dare quickstart: {shipped.task} ({shipped.family}), {algo}")
        stages.done("report")
        summary = {"run_dir": str(run), "algorithm": algo, "seed": opts.seed, "from_scratch": opts.from_scratch,
                   "sft_model": str(sft_model), "rl_model": str(rl.export), "before": before, "after": after,
                   "eval": settings, "rl_steps": rl_recipe.train.steps, "stage_seconds": stages.times,
                   "total_seconds": round(stages.total, 1), "plot": str(png) if png else None}
        write_text(run / "summary.json", json.dumps(summary, indent=1))  # last, whole: it marks a finished run
    finally:
        close_pool()
    echo("\n" + table, flush=True)
    echo(f"run folder: {run}  (results.md, summary.json, quickstart.png, rl/metrics.jsonl, rl/export/)   "
         f"total {fmt_seconds(stages.total)}", flush=True)
    return summary
