"""The CLI makes OpenMP threads wait passively, set before torch (and its OpenMP runtime) is loaded: spinning
waiters on a machine whose cores other jobs share made a 2-thread forward ~70x slower than 1 thread."""
import os
import subprocess
import sys

CHECK = "import os, sys; import dare.cli; print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))"


def _run(env_extra):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def test_cli_sets_a_passive_openmp_wait_policy_before_torch_is_imported():
    assert _run({}) == ["False", "PASSIVE"]


def test_an_explicit_wait_policy_is_kept():
    assert _run({"OMP_WAIT_POLICY": "ACTIVE"}) == ["False", "ACTIVE"]
