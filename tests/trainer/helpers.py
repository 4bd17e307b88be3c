"""Recipes for trainer tests: tiny models, few steps, no progress bar or TensorBoard."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dare.trainer.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TOY_SFT = ROOT / "tests/assets/data/toy_sft.jsonl"
TOY_PREF = ROOT / "tests/assets/data/toy_pref.jsonl"


def run_to_success(cmd, env, timeout, merge_output: bool = False, on_timeout=None):
    """Run ``cmd`` from the repository root in a session of its own, so a hung run is killed together with its
    torchrun workers; assert it exits 0 (showing the end of stderr otherwise) and return its stderr (stdout and
    stderr with ``merge_output``). On a timeout ``on_timeout()`` runs after the kill, then TimeoutExpired is raised."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_output else subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if on_timeout is not None:
            on_timeout()
        raise
    text = out if merge_output else err
    assert proc.returncode == 0, text[-3000:]
    return text


def kill_running(marker: str) -> None:
    """SIGKILL every process whose command line holds ``marker`` (torchrun starts its workers in sessions of their
    own, so killing the launcher's session leaves them)."""
    for pid in Path("/proc").iterdir():
        try:
            if pid.name.isdigit() and marker in (pid / "cmdline").read_bytes().decode(errors="ignore"):
                os.kill(int(pid.name), signal.SIGKILL)
        except OSError:
            pass


def run_workers(script: Path, *args: str, timeout: float, hang: str) -> str:
    """Run ``script`` on 2 processes under torchrun (OMP_NUM_THREADS=1, the repository importable); assert it exits
    0 and return its output. On ``timeout`` kill torchrun and its workers and fail with ``hang``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'src'}"}
    try:
        return run_to_success(cmd, env, timeout, merge_output=True, on_timeout=lambda: kill_running(str(script)))
    except subprocess.TimeoutExpired:
        pytest.fail(hang)


def sft_recipe(tmp_path, *overrides, family="llada"):
    base = [f"model.path=tiny:{family}", "model.tiny_sizes={hidden_size: 32, num_layers: 1}", "algorithm.name=sft",
            f"data.pairs={TOY_SFT}", "data.max_length=48", "optim.lr=3e-3", "train.steps=2", "train.batch_size=8",
            "train.micro_batch_size=2", f"train.output_dir={tmp_path}", "train.export=false",
            "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]
    return load_recipe(None, base + list(overrides))
