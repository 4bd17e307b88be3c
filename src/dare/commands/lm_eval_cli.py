"""``dare lm-eval <lm-eval's own arguments>``: lm-evaluation-harness's command line with the ``dare`` model registered.

lm-eval finds a model class only once its module is imported, and its command line imports none of another package's
(``lm_eval --model dare`` says "no model for this name found"). This command registers dare's model
(``dare.eval.register_lm_eval``) and hands every argument after ``lm-eval`` to lm-eval's own CLI unchanged::

    dare lm-eval --model dare --model_args pretrained=PATH,mc_num=32 --tasks arc_easy --limit 20
    dare lm-eval run --model dare --model_args pretrained=PATH --tasks my_task --include_path ./tasks
    dare lm-eval ls tasks

The checkpoint's own decoding settings apply as under ``dare eval`` (docs/eval.md); sampler fields are model_args.
Needs ``pip install "dare[eval]"``.
"""
from __future__ import annotations

import sys

NAME = "lm-eval"
HELP = "lm-evaluation-harness's own command line with the dare model registered (every argument passed through)"
PASSTHROUGH = True  # dare's parser leaves every argument after "lm-eval" to lm-eval's (args.rest)


def add_arguments(p):
    p.add_argument("rest", nargs="*", metavar="ARGS",
                   help="lm-eval's arguments, e.g. --model dare --model_args pretrained=PATH --tasks TASK")


def run(args) -> int:
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.utils import setup_logging
    except ImportError as e:
        raise ValueError(f"dare lm-eval needs lm-evaluation-harness: pip install \"dare[eval]\" ({e})") from None
    from dare.eval import register_lm_eval

    register_lm_eval()
    rest = list(args.rest) or ["--help"]
    import lm_eval.tasks

    saved, manager = sys.argv, lm_eval.tasks.TaskManager
    sys.argv = ["lm_eval", *rest]  # lm-eval's parser reads sys.argv (and adds its "run" subcommand to a legacy line)
    include, tasks = _flag(rest, "--include_path"), _flag(rest, "--tasks")
    if include and tasks:  # as dare eval: lm-eval's own ~15 s task index only when a task may need it
        from .eval import task_manager
        names = [t.strip() for t in tasks.split(",") if t.strip()]
        # lm-eval's own arguments (metadata, ...) kept; only whether its task folder is indexed is decided here
        lm_eval.tasks.TaskManager = lambda **given: task_manager(lambda **kw: manager(**{**given, **kw}), include, names)
    try:
        setup_logging()
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    finally:
        sys.argv, lm_eval.tasks.TaskManager = saved, manager
    return 0


def _flag(argv: list, name: str):
    """The value of ``name VALUE`` or ``name=VALUE`` in ``argv`` (lm-eval's spelling), else None."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None
