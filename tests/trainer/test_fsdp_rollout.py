"""Rollouts under FSDP2: ranks decode a data-dependent number of steps, so no collective may run per forward.

Without ``gathered_for_inference`` the rank that finishes first leaves the other blocked in an all-gather (a hang
or a "connection closed" crash): this test then fails on its timeout.
"""
import re

import pytest

from tests.trainer.helpers import ROOT, run_workers

WORKER = ROOT / "tests" / "trainer" / "fsdp_rollout_worker.py"


@pytest.mark.integration
@pytest.mark.multiprocess
def test_threshold_decoding_with_unequal_step_counts_completes_under_fsdp():
    out = run_workers(WORKER, "gathered", timeout=240,
                      hang="rollout under FSDP hung: ranks with different step counts blocked in a collective")
    nfe = {int(r): int(n) for r, n in re.findall(r"rank (\d) nfe (\d+)", out)}
    assert set(nfe) == {0, 1}
    assert nfe[0] != nfe[1]  # the scenario is real: the ranks ran different numbers of forwards
