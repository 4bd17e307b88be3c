"""The building blocks the quickstart and the comparison chain: a ``dare train`` run and a ``dare.eval`` run.

Both go through the real components: ``train_stage`` is the ``dare train`` executor (``dare.trainer.loop.Trainer``
on a typed recipe + dotted overrides, exactly what ``dare train RECIPE key=value ...`` runs), ``eval_stage`` is
``dare.eval.evaluate`` (the runner behind ``dare eval``) on a checkpoint folder, with the settings of the recipe's
``eval`` section so training-time and final evaluations mean the same thing.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_dir: Path
    export: Path  # the trained model in its family's layout (+ tokenizer)
    metrics: Path  # metrics.jsonl
    seconds: float
    recipe: object  # the resolved TrainRecipe


def load_stage_recipe(path, overrides: list[str]):
    from ..trainer.recipe import load_recipe
    return load_recipe(path, overrides)


def train_stage(recipe_path, overrides: list[str], *, progress: bool = True) -> TrainResult:
    """Run ``dare train recipe_path *overrides`` in this process; returns where its outputs are."""
    from ..trainer.loop import Trainer

    ov = list(overrides) + [f"logging.progress={'true' if progress else 'false'}"]
    recipe = load_stage_recipe(recipe_path, ov)
    if recipe.distributed.nproc != 1:
        raise ValueError("the quickstart runs its training stages in one process; use distributed.nproc=1 "
                         "(or run the recipe with `dare train` for multi-process training)")
    if not recipe.train.export:
        raise ValueError("the quickstart needs the exported model of each stage: keep train.export=true")
    t0 = time.perf_counter()
    trainer = Trainer(recipe)
    try:
        trainer.run()
    finally:
        trainer.env.close()
    run_dir = Path(recipe.train.output_dir)
    return TrainResult(run_dir, run_dir / "export", run_dir / "metrics.jsonl", time.perf_counter() - t0, recipe)


def eval_settings(recipe) -> dict:
    """The held-out evaluation of a recipe (its ``eval`` section), as a plain dict (for summaries)."""
    import dataclasses
    ec = recipe.eval
    if not ec.benchmarks:
        raise ValueError("the recipe's eval.benchmarks is empty: the quickstart evaluates on eval.benchmarks "
                         "(e.g. eval.benchmarks=[sudoku])")
    return {"benchmarks": list(ec.benchmarks), "limit": ec.limit, "batch_size": ec.batch_size, "template": ec.template,
            "sampler": dataclasses.asdict(ec.sampler)}


def eval_stage(model_path, recipe, output_dir, name: str, *, seed: int = 0, progress: bool = True,
               reward_workers: int = 1, samples: int = 0, sample_limit: Optional[int] = None) -> dict:
    """``dare.eval.evaluate`` of the checkpoint at ``model_path`` with ``recipe.eval``'s settings.

    Returns ``{benchmark: summary}`` (``score``, ``mean_score``, ``accuracy``, ...) and writes per-sample JSONL,
    results.json and results.md to ``output_dir``. With ``samples = k > 0`` the same held-out examples are also
    decoded k times each with the RL rollout's sampler (``recipe.rollout.sampler``: its temperature and steps; the
    first ``sample_limit`` examples, default all), and ``summary["sampled"]`` holds the mean reward over the k samples,
    the best-of-k mean and pass@k.
    """
    from ..eval import evaluate
    from ..models.model_spec import load_model_spec, resolve_device

    ec = recipe.eval
    eval_settings(recipe)  # validates
    model, tok = load_model_spec(str(model_path), device=resolve_device(None))
    common = dict(limit=ec.limit, batch_size=ec.batch_size, template=ec.template, seed=seed, progress=progress,
                  resume=False, reward_workers=reward_workers)
    t0 = time.perf_counter()
    results = evaluate(model, tok, list(ec.benchmarks), ec.sampler, output_dir=Path(output_dir), model_name=name, **common)
    seconds = time.perf_counter() - t0
    out = {}
    for bench, s in results["benchmarks"].items():
        out[bench] = {k: s[k] for k in ("metric", "score", "mean_score", "accuracy", "n_examples", "errors")}
        out[bench]["seconds"] = round(seconds, 2)
    if samples > 0:
        t0 = time.perf_counter()
        if sample_limit is not None:
            common["limit"] = sample_limit if ec.limit is None else min(sample_limit, ec.limit)
        sampled = evaluate(model, tok, list(ec.benchmarks), recipe.rollout.sampler, output_dir=Path(output_dir) / "sampled",
                           model_name=f"{name}-sampled", n_samples=samples, **common)
        seconds = time.perf_counter() - t0
        for bench, s in sampled["benchmarks"].items():
            out[bench]["sampled"] = {k: s[k] for k in ("mean_score", "accuracy", "best_of_k_mean", "pass_at_k", "k")}
            out[bench]["sampled"].update(temperature=recipe.rollout.sampler.temperature, seconds=round(seconds, 2),
                                         n_examples=s["n_examples"])
    del model
    return out


def read_curve(metrics_path, key: str) -> list[tuple[int, float]]:
    """(step, value) points of ``key`` in a metrics.jsonl (lines cut by a kill are skipped)."""
    import math
    points = []
    path = Path(metrics_path)
    if not path.exists():
        return points
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        v = rec.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            points.append((int(rec.get("step", len(points) + 1)), float(v)))
    return points


def set_threads(threads: Optional[int]) -> None:
    """Intra-op threads for this process (``None``: PyTorch's default). The quickstart and the comparison default to
    1: the tiny models are overhead-bound, and two intra-op threads on a 2-core machine whose cores are shared with
    anything else ran up to 33x slower (docs/quickstart.md)."""
    if threads:
        import torch
        torch.set_num_threads(int(threads))


def fmt_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}:{s % 60:02d}"
