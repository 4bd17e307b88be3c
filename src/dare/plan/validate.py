"""The check of a plan: the same step on real tensors, measured by the same tracker, in 1 or N real processes.

``measure(recipe)`` runs ``plan_recipe(simulate=False)`` on the recipe's real (tiny) model: in this process for one
rank, or under ``torchrun`` with gloo for several (rank 0 reports). It also reports the measuring process's resident
memory growth over the step (``ru_maxrss`` after the step minus the resident size before it), a sanity check
with a wider tolerance: it also counts the allocator's caching and Python objects, and it misses memory freed and
reused below the previous high-water mark.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from .planner import PlanOptions, plan_recipe


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_here(recipe, options: Optional[PlanOptions] = None) -> dict:
    """The step on real tensors in this process (a rank of a torchrun job when a process group is set up)."""
    from ..trainer.model_setup import load_policy
    opts = options or PlanOptions(target="cpu")
    model, _ = load_policy(recipe.model)
    before = _rss_bytes()
    plan = plan_recipe(recipe, PlanOptions(**{**opts.__dict__, "simulate": False, "model": model}))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    out = plan.to_dict()
    out["rss_growth_bytes"] = int(grown)
    return out


def measure(recipe_path: str, overrides: list[str], nproc: int, timeout: float = 600) -> dict:
    """Rank 0's measurement of one real step with ``nproc`` gloo processes (1: a subprocess of its own, so the
    resident-memory check starts from a fresh process)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "measured.json"
        args = ["-m", "dare.plan.validate", recipe_path, str(out), *overrides]
        cmd = [sys.executable, *args] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0 or not out.exists():
            raise RuntimeError(f"measurement failed ({res.returncode}): {res.stderr[-2000:]}")
        return json.loads(out.read_text())


def _main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from ..trainer.recipe import load_recipe
    from ..trainer.distributed import close_process_group
    torch.set_num_threads(1)
    recipe_path, out, overrides = argv[0], Path(argv[1]), argv[2:]
    recipe = load_recipe(recipe_path, overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    try:
        result = measure_here(recipe, PlanOptions(gpus=world, target="cpu"))
        if world == 1 or dist.get_rank() == 0:
            out.write_text(json.dumps(result))
    finally:
        if world > 1:
            close_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
