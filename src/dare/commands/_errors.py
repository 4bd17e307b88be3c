"""One line per error, once per command, also when ``dare train`` runs as several processes.

Every rank of a multi-process run meets the same bad input (a batch that does not divide over the processes, a
damaged checkpoint) and used to print the same line, then torchrun added its ``ChildFailedError`` traceback. Now the
relaunching ``dare train`` runs the launcher in its own process (``launch``) and hands its ranks a folder
(``DARE_ERROR_DIR``): a rank writes its one-line error there instead of printing it (``report``), and the launcher
prints the lowest rank's line once, without the launcher's traceback. A rank that dies of something else (a crash
with its own traceback, a signal) is named with its exit code; its output is above.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

ERROR_DIR = "DARE_ERROR_DIR"


def report(command: str, message: str) -> None:
    """``dare <command>: error: <message>`` on stderr; in a rank of a run ``launch`` started, written for it instead."""
    folder, rank = os.environ.get(ERROR_DIR), os.environ.get("RANK")
    if folder and rank is not None and rank.isdigit():
        try:
            (Path(folder) / f"rank{int(rank):06d}.txt").write_text(f"dare {command}: error: {message}\n")
            return
        except OSError:  # the launcher's folder is gone: say it here
            pass
    print(f"dare {command}: error: {message}", file=sys.stderr)


def launch(command: str, torchrun_argv: list[str]) -> int:
    """``python -m torch.distributed.run <torchrun_argv>``, in this process: 0 when every rank succeeds, else one line
    for the first failure (2 for a rank's reported error, as the command itself returns for bad input; 1 otherwise;
    130 on Ctrl-C)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    elastic = logging.getLogger("torch.distributed.elastic")
    level = elastic.level
    with tempfile.TemporaryDirectory(prefix="dare-errors-") as folder:
        before = os.environ.get(ERROR_DIR)
        os.environ[ERROR_DIR] = folder  # the ranks inherit it
        elastic.setLevel(logging.CRITICAL)  # its failure summary is what the line below says
        try:
            run(parse_args(torchrun_argv))
            return 0
        except ChildFailedError as e:
            reported = sorted(Path(folder).glob("rank*.txt"))
            if reported:
                print(reported[0].read_text().strip(), file=sys.stderr)
                return 2
            rank, failure = min(e.failures.items())
            code = failure.exitcode
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
                else f"exited with code {code}"
            print(f"dare {command}: error: process {rank} of the run {how} (its output is above)", file=sys.stderr)
            return 1
        except SignalException:
            print("interrupted", file=sys.stderr)
            return 130
        finally:
            elastic.setLevel(level)
            if before is None:
                os.environ.pop(ERROR_DIR, None)
            else:
                os.environ[ERROR_DIR] = before
