"""``dare compare [--algorithms a,b] [--seeds 3] [--updates N]``: every registered RL algorithm on the embedded CPU
task (the shipped tiny SFT checkpoints) with a matched budget (same optimizer updates and rollouts), matched
rollout / reward / eval settings, and each method's own paper settings (lr scale, grad clip, temperature, task values).

Writes ``comparison.json`` (the report's data: SFT baseline and each algorithm's held-out mean reward, mean and
spread over seeds, settings), ``comparison.md`` (the table rendered from that data) and ``comparison.png`` (all reward
curves) to ``--output-dir``; ``--docs DIR`` writes the table (comparison_table.md), its data and the figure there.
Rerunning reuses finished runs, so newly registered algorithms are added by running it again. ``--report-only
--data FILE`` renders the table from a stored data file alone (docs/comparison.json: the checked-in table). The code
is ``dare.comparison``; see docs/comparison.md.
"""
from __future__ import annotations

NAME = "compare"
HELP = ("run every registered RL algorithm on the embedded CPU task (matched budget, each method's paper settings, "
        "several seeds): table + curves")


def add_arguments(p):
    p.add_argument("--algorithms", default=None, help="comma-separated algorithm names (default: every registered RL algorithm)")
    p.add_argument("--families", default=None, help="comma-separated model families of the shipped checkpoints "
                   "(default: all, e.g. llada,sdar; an algorithm runs on the families its `supports` lists)")
    p.add_argument("--task", default=None, help="task of the shipped checkpoints to compare on (default: the "
                   "default quickstart's; e.g. sudoku for the plain Sudoku checkpoints)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per algorithm (0..N-1)")
    p.add_argument("--updates", type=int, default=None,
                   help="optimizer updates per method (default: the compare recipe's train.steps); a method with mu "
                        "inner iterations runs updates/mu steps of mu x train.batch_size prompts (same rollouts)")
    p.add_argument("--shared-settings", action="store_true",
                   help="one lr / grad clip / temperature for every method (the recipe's) instead of each method's "
                        "paper settings; the budget stays matched")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out puzzles (default: the recipe's eval.limit)")
    p.add_argument("--output-dir", default="runs/compare", help="where runs and the table go (reused when rerun)")
    p.add_argument("--set", action="append", default=[], metavar="[ALGO:]KEY=VALUE", dest="overrides",
                   help="override a recipe field for every run, or for one algorithm with ALGO: in front "
                        "(e.g. --set optim.lr=2e-4 --set bgpo:algorithm.num_mc=8)")
    p.add_argument("--docs", default=None, metavar="DIR",
                   help="also write the table (comparison_table.md), its data (comparison.json) and the PNG to DIR "
                        "(e.g. docs)")
    p.add_argument("--merge", action="store_true",
                   help="with --docs: merge these runs' rows into DIR/comparison.json (a method's stored row is "
                        "replaced, other rows stay; the stored figure is kept), to add methods to a report whose "
                        "earlier runs are gone")
    p.add_argument("--report-only", action="store_true",
                   help="only write the table and figure of the runs already finished in --output-dir; start none")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="with --report-only: render the table from this stored comparison.json (e.g. "
                        "docs/comparison.json) instead of the runs in --output-dir (no figure: it needs the runs)")
    p.add_argument("--no-resume", action="store_true", help="rerun every run even when its results exist")
    p.add_argument("--threads", type=int, default=1, help="torch CPU intra-op threads per run (default 1; 0: PyTorch's "
                   "choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _names(value):
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def run(args) -> int:
    from dare.comparison.run import CompareOptions, report_from_data, run_compare

    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    if args.merge and not args.docs:
        raise ValueError("--merge needs --docs DIR (it merges into DIR/comparison.json)")
    if args.data and not args.report_only:
        raise ValueError("--data needs --report-only (it renders a stored report; it runs nothing)")
    opts = CompareOptions(algorithms=_names(args.algorithms), families=_names(args.families), task=args.task,
                          seeds=args.seeds, updates=args.updates, paper_settings=not args.shared_settings,
                          eval_limit=args.eval_limit, output_dir=args.output_dir,
                          overrides=list(args.overrides), resume=not args.no_resume, report_only=args.report_only,
                          docs_dir=args.docs, merge=args.merge,
                          threads=args.threads or None, progress=not args.no_progress)
    if args.data:
        report_from_data(args.data, opts)
        return 0
    results = run_compare(opts)
    failed = sum(len(r.get("failed", {})) for r in results.values())
    return 1 if failed and not any(r["runs"] for r in results.values()) else 0
