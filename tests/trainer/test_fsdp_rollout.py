"""Rollouts under FSDP2: ranks decode a data-dependent number of steps, so no collective may run per forward.

Without ``gathered_for_inference`` the rank that finishes first leaves the other blocked in an all-gather (a hang
or a "connection closed" crash): this test then fails on its timeout.
"""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.helpers import ROOT

WORKER = ROOT / "tests" / "trainer" / "fsdp_rollout_worker.py"


def _kill_workers() -> None:
    # torchrun starts its workers in sessions of their own: kill them by command line, not by process group.
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(WORKER) in (proc / "cmdline").read_bytes().decode(errors="ignore"):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.slow
def test_threshold_decoding_with_unequal_step_counts_completes_under_fsdp():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER), "gathered"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'src'}"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _kill_workers()
        pytest.fail("rollout under FSDP hung: ranks with different step counts blocked in a collective")
    assert proc.returncode == 0, out[-3000:]
    nfe = {int(r): int(n) for r, n in re.findall(r"rank (\d) nfe (\d+)", out)}
    assert set(nfe) == {0, 1}
    assert nfe[0] != nfe[1]  # the scenario is real: the ranks ran different numbers of forwards
