"""The ``dare`` command line: ``dare <command> [options]``.

Each command is a module in ``dare.commands`` exposing ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int`` (and ``PASSTHROUGH = True`` for one that takes the rest of the line unparsed, as ``args.rest``:
``dare lm-eval``). Commands are discovered, not listed here, so adding one touches no shared file.
"""
from __future__ import annotations

import os

# OpenMP threads that wait for work spin by default. On a machine whose cores other jobs share, a spinning thread
# holds a core the thread it waits for needs, and a 2-thread forward can take 70x longer than at 1 thread. Passive
# waiting (sleep instead of spin) cannot collapse like that and costs little when the cores are free. libgomp reads
# this when torch is first imported, so it is set here, before any command imports torch; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402
import pkgutil  # noqa: E402
import sys  # noqa: E402

from . import commands  # noqa: E402


def _command_modules():
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"{commands.__name__}.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dare", description="Post-train and evaluate diffusion LLMs.")
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    parser.passthrough = set()  # commands that take the rest of the line unparsed (PASSTHROUGH)
    for mod in _command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
        if getattr(mod, "PASSTHROUGH", False):
            parser.passthrough.add(mod.NAME)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # A command with PASSTHROUGH = True (``dare lm-eval``) takes the rest of the line unparsed, as ``args.rest``.
    cut = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if cut is not None and argv[cut] in parser.passthrough:
        args = parser.parse_args(argv[:cut + 1])
        args.rest = argv[cut + 1:]
    else:
        args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # config / input / file-system errors (a full disk...): one line, no traceback
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        from .commands._errors import report
        from .config.core import clip
        report(args.command, clip(str(e)))  # a rank of a multi-process run: written for the launcher to print once
        return 2


if __name__ == "__main__":
    sys.exit(main())
