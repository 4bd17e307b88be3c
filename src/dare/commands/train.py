"""``dare train RECIPE.yaml [key=value ...]``: SFT, LoRA, DPO/VRPO and RL with one executor.

With ``distributed.nproc > 1`` the command relaunches itself under torchrun (``python -m torch.distributed.run``),
so users never call the launcher themselves.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

NAME = "train"
HELP = "post-train a diffusion LM from a recipe (SFT, LoRA, DPO/VRPO, RL); key=value overrides any recipe field"

log = logging.getLogger(__name__)


def add_arguments(p):
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10 optim.lr=1e-5")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")


def run(args) -> int:
    import yaml

    from dare.config.core import to_dict
    from dare.trainer.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if args.print_config:
        print(yaml.safe_dump(to_dict(recipe), sort_keys=False))
        return 0
    d = recipe.distributed
    if (d.nproc > 1 or d.nnodes > 1) and "WORLD_SIZE" not in os.environ:
        from dare.trainer.distributed import torchrun_command
        cmd = torchrun_command(d.nproc, ["--log-level", str(args.log_level), "train", args.recipe, *args.overrides],
                               d.nnodes, d.rdzv_endpoint, d.rdzv_id)
        log.info("launching %d processes on each of %d node(s): %s", d.nproc, d.nnodes, " ".join(cmd))
        from ._errors import launch
        launcher = [sys.executable, "-m", "torch.distributed.run"]
        if cmd[:len(launcher)] != launcher:  # torchrun_command's form: run it as it is
            return subprocess.call(cmd)
        return launch("train", cmd[len(launcher):])  # one line for a rank's error, not one per rank + a traceback
    from dare.trainer.loop import Trainer, TrainingError

    trainer = Trainer(recipe)
    finished = False
    try:
        history = trainer.run()
        finished = True
    except TrainingError as e:  # diverged: a clear message, no traceback (once, from a multi-process run)
        from ._errors import report
        report("train", str(e))
        return 1
    finally:
        trainer.env.close(sync=finished)
    if trainer.env.is_main and history:
        last = history[-1]
        print(f"dare train: {len(history)} steps, final loss {last.get('loss', float('nan')):.4f}; "
              f"run folder {recipe.train.output_dir}")
    return 0
