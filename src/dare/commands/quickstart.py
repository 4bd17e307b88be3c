"""``dare quickstart``: a tiny diffusion LM learns 4x4 Sudoku on a CPU in minutes, and RL visibly helps.

Starts from the shipped SFT checkpoint (a tiny LLaDA trained by ``recipes/quickstart/sft.yaml``), evaluates it on
held-out puzzles with dare's benchmark runner, runs Coupled-GRPO with the ``dare train`` executor
(``recipes/quickstart/rl.yaml``), evaluates again and prints a before/after table; the run folder gets the
checkpoints, metrics, the table and a PNG of the SFT loss and RL reward curves. ``--from-scratch`` reruns the SFT
stage first. See docs/quickstart.md.
"""
from __future__ import annotations

NAME = "quickstart"
HELP = "tiny LLaDA on 4x4 Sudoku on CPU: SFT checkpoint -> eval -> RL (Coupled-GRPO) -> eval, table + PNG"


def add_arguments(p):
    p.add_argument("--output-dir", default=None, help="run folder (default: runs/quickstart/<timestamp>)")
    p.add_argument("--from-scratch", action="store_true", help="rerun the SFT stage instead of using the shipped checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the RL (and SFT) runs and of the evaluation")
    p.add_argument("--rl-steps", type=int, default=None, help="RL steps (default: the recipe's train.steps)")
    p.add_argument("--sft-steps", type=int, default=None, help="with --from-scratch: SFT steps (default: the recipe's)")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out puzzles (default: the recipe's eval.limit)")
    p.add_argument("--checkpoint", default=None, help="shipped SFT checkpoint to start from (default: sudoku-llada-sft)")
    p.add_argument("--rl-recipe", default=None, help="RL recipe (default: the packaged recipes/quickstart/rl.yaml)")
    p.add_argument("--sft-recipe", default=None, help="SFT recipe for --from-scratch (default: the checkpoint's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="rl_set",
                   help="override any RL recipe field, e.g. --set algorithm.name=spg --set optim.lr=5e-4")
    p.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any SFT recipe field (with --from-scratch)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: PyTorch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args) -> int:
    from dare.quickstart.pipeline import DEFAULT_CHECKPOINT, QuickstartOptions, run_quickstart

    if args.sft_set and not args.from_scratch:
        raise ValueError("--sft-set only applies with --from-scratch (the shipped checkpoint is already trained)")
    opts = QuickstartOptions(output_dir=args.output_dir, from_scratch=args.from_scratch, seed=args.seed,
                             rl_steps=args.rl_steps, sft_steps=args.sft_steps, eval_limit=args.eval_limit,
                             checkpoint=args.checkpoint or DEFAULT_CHECKPOINT, rl_overrides=list(args.rl_set),
                             sft_overrides=list(args.sft_set), rl_recipe=args.rl_recipe, sft_recipe=args.sft_recipe,
                             threads=args.threads, progress=not args.no_progress)
    run_quickstart(opts)
    return 0
