"""``dare quickstart``: a tiny diffusion LM, SFT'd on demonstrations with a bad habit, gets measurably better
through dLLM RL on a CPU in minutes.

The default task is "lazy Sudoku": the shipped tiny LLaDA was SFT'd (``recipes/quickstart/sft_lazy_sudoku.yaml``) on
4x4 Sudoku demonstrations of which 70 % leave 4 empty cells as 0, so it learned that habit; the Sudoku verifier
penalises it. The quickstart evaluates the SFT model on held-out puzzles with dare's benchmark runner (greedy, and k
samples at the rollout temperature), runs Coupled-GRPO with the ``dare train`` executor (``recipes/quickstart/rl.yaml``),
evaluates again and prints a before/after table; the run folder gets the checkpoints, metrics, results.md and a PNG.
``--checkpoint`` picks another shipped checkpoint (the block-diffusion SDAR one, or the plain-Sudoku ones: the hard
case where RL does not help); ``--from-scratch`` reruns the SFT stage first. See docs/quickstart.md.
"""
from __future__ import annotations

NAME = "quickstart"
HELP = "tiny LLaDA on lazy 4x4 Sudoku on CPU: SFT checkpoint -> eval -> RL (Coupled-GRPO) -> eval, table + PNG"


def add_arguments(p):
    p.add_argument("--output-dir", default=None, help="run folder (default: runs/quickstart/<timestamp>)")
    p.add_argument("--from-scratch", action="store_true", help="rerun the SFT stage instead of using the shipped checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the RL (and SFT) runs and of the evaluation")
    p.add_argument("--rl-steps", type=int, default=None, help="RL steps (default: the recipe's train.steps)")
    p.add_argument("--sft-steps", type=int, default=None, help="with --from-scratch: SFT steps (default: the recipe's)")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out puzzles (default: the recipe's eval.limit)")
    p.add_argument("--checkpoint", default=None, help="shipped SFT checkpoint to start from (default: lazy-sudoku-llada-sft;"
                   " also lazy-sudoku-sdar-sft, and the plain-Sudoku sudoku-llada-sft / sudoku-sdar-sft)")
    p.add_argument("--rl-recipe", default=None, help="RL recipe (default: the packaged recipes/quickstart/rl.yaml)")
    p.add_argument("--sft-recipe", default=None, help="SFT recipe for --from-scratch (default: the checkpoint's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="rl_set",
                   help="override any RL recipe field, e.g. --set algorithm.name=spg --set optim.lr=5e-4")
    p.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any SFT recipe field (with --from-scratch)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU intra-op threads (default 1: tiny models are "
                   "overhead-bound, and 2 threads on a busy 2-core machine ran up to 33x slower; 0: PyTorch's choice)")
    p.add_argument("--samples", type=int, default=4, help="k completions per held-out puzzle at the rollout "
                   "temperature, before and after RL (mean reward, best-of-k, pass@k); 0: greedy only")
    p.add_argument("--sample-limit", type=int, default=50, help="... on the first N held-out puzzles (default 50; "
                   "0: all of them)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args) -> int:
    from dare.quickstart.pipeline import DEFAULT_CHECKPOINT, QuickstartOptions, run_quickstart

    if args.sft_set and not args.from_scratch:
        raise ValueError("--sft-set only applies with --from-scratch (the shipped checkpoint is already trained)")
    opts = QuickstartOptions(output_dir=args.output_dir, from_scratch=args.from_scratch, seed=args.seed,
                             rl_steps=args.rl_steps, sft_steps=args.sft_steps, eval_limit=args.eval_limit,
                             checkpoint=args.checkpoint or DEFAULT_CHECKPOINT, rl_overrides=list(args.rl_set),
                             sft_overrides=list(args.sft_set), rl_recipe=args.rl_recipe, sft_recipe=args.sft_recipe,
                             threads=args.threads or None, samples=args.samples,
                             sample_limit=args.sample_limit or None, progress=not args.no_progress)
    run_quickstart(opts)
    return 0
