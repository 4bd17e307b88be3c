"""Two processes (FSDP2 over gloo) train as one does: SFT on a dense and an MoE family, d1, VRPO's two passes (full and
LoRA), gradient sync on every micro-batch -- cases of the shared two-process runner (tests/trainer/two_processes.py)
-- and the ``dare train`` command's own relaunch under torchrun; kill -9 mid-run, then resume, bit for bit."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.trainer.helpers import ROOT, TOY_SFT, run_to_success
from tests.trainer.two_processes import CASES as TWO_CASES, Case, recipe_overrides, register, same_history

COMMON = ["logging.progress=false", "logging.tensorboard=false", "train.export=false"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def _train(out, *overrides, recipe="recipes/sft_tiny.yaml", timeout=300):
    data = [f"data.pairs={TOY_SFT}"] if "sft" in recipe else []
    cmd = [sys.executable, "-m", "dare.cli", "train", recipe, *COMMON, *data, f"train.output_dir={out}", *overrides]
    run_to_success(cmd, _env(), timeout)
    return _metrics(out)


def _metrics(out):
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]


SFT = ("train.steps=3", "train.batch_size=12", "train.micro_batch_size=1", f"data.pairs={TOY_SFT}")
D1 = ("train.steps=2", "algorithm.inner_iterations=2", "reward.workers=0", "model.dtype=float64",
      "rollout.sampler={gen_length: 8, block_length: 8, steps: 8, temperature: 1.0}")
VRPO = ("train.steps=3", "train.batch_size=4", "train.micro_batch_size=1", "algorithm.mc_samples=2",
        f"data.pairs={ROOT / 'tests/assets/data/toy_pref.jsonl'}")
CASES = register({
    "sft_llada": Case("recipes/sft_tiny.yaml", (*SFT, "model.path=tiny:llada")),
    "sft_sdar_moe": Case("recipes/sft_tiny.yaml", (*SFT, "model.path=tiny:sdar_moe")),
    # distributed.grad_sync=every (reduce-scatter each micro-batch) sums the same gradients as one process, as the
    # default (sync on the last micro-batch only: sft_llada) does
    "sft_llada_grad_sync_every": Case("recipes/sft_tiny.yaml", (*SFT, "model.path=tiny:llada"),
                                      two=("distributed.nproc=2", "distributed.grad_sync=every")),
    # float64: each rank decodes half the prompts, i.e. other batch shapes; float32 rounding of those may flip a
    # near-tie token, which is not promised to be identical (docs/samplers.md). The seeds and schedules are.
    "d1_llada": Case("recipes/d1_tiny.yaml", D1),
    "vrpo_sdar": Case("recipes/vrpo_tiny.yaml", (*VRPO, "model.path=tiny:sdar")),
    "lora_vrpo_llada": Case("recipes/vrpo_tiny.yaml", (*VRPO, "lora.enabled=true", "reference.mode=auto", "optim.lr=1e-2")),
})
KEYS = {"sft": ("loss", "grad_norm", "masked_frac"), "d1": ("loss", "kl", "entropy", "grad_norm", "ratio_mean"),
        "vrpo": ("loss", "grad_norm", "reward_margin")}


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_two_processes_reproduce_one_process(two_process_runs, case):
    one, two = two_process_runs(case)
    steps = 3 if "sft" in case or "vrpo" in case else 2
    assert len(one.metrics) == len(two.metrics) == steps
    if case.startswith("d1"):  # the same rollouts on 1 or 2 ranks
        assert [a["completion_len"] for a in one.metrics] == [b["completion_len"] for b in two.metrics]
    same_history(one.metrics, two.metrics, next(v for k, v in KEYS.items() if k in case))


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["sft_sdar_moe"])
def test_the_command_relaunches_itself_under_torchrun(tmp_path, two_process_runs, case):
    """``dare train ... distributed.nproc=2`` starts torchrun itself, and that fresh command trains as the shared
    runner's one-process side did for the same case (a case the runner ran after others: they leave no trace)."""
    one, _ = two_process_runs(case)
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "dare.cli", "train", TWO_CASES[case].recipe, *recipe_overrides(TWO_CASES[case], True, out)]
    err = run_to_success(cmd, _env(), 300)
    assert "launching 2 processes on each of 1 node(s)" in err
    same_history(one.metrics, _metrics(out), KEYS["sft"])


@pytest.mark.integration
def test_kill9_mid_run_then_resume_matches_uninterrupted_bit_for_bit(tmp_path):
    args = ["train.steps=30", "train.save_every=4", "train.batch_size=8", "model.tiny_sizes={hidden_size: 32, num_layers: 1}"]
    straight = _train(tmp_path / "straight", *args)
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "dare.cli", "train", "recipes/sft_tiny.yaml", *COMMON, f"data.pairs={TOY_SFT}",
           f"train.output_dir={run}", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker = run / "checkpoints" / "step-8" / "COMPLETE"
    deadline = time.time() + 300
    while not marker.exists():
        assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.01)
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(r["step"] for r in _metrics(run))
    assert killed_at < 30
    resumed = _train(run, *args)
    assert [r["step"] for r in resumed] == list(range(1, 31))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight]


@pytest.mark.integration
@pytest.mark.multiprocess
def test_a_bad_recipe_in_a_multi_process_run_is_one_line(tmp_path):
    """Every rank meets a batch that does not divide over 3 processes: the error is printed once, as one line, without
    torchrun's ChildFailedError traceback (it was printed three times, then the launcher's traceback)."""
    cmd = [sys.executable, "-m", "dare.cli", "train", "recipes/d1_tiny.yaml", *COMMON, "distributed.nproc=3",
           f"train.output_dir={tmp_path / 'run'}", "train.steps=1"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode == 2 and errors == [
        "dare train: error: train.batch_size=4 prompts must be divisible by the 3 data-parallel ranks "
        "(distributed.nproc x nnodes / sequence_parallel; each generates whole groups)"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr


def test_the_launcher_prints_the_first_ranks_line_or_names_the_process_that_died(monkeypatch, capsys):
    """dare/commands/_errors.py without processes: ranks' reported lines (the lowest rank's is printed), a rank that
    died without one (its exit code or signal), Ctrl-C; the error folder is handed to the ranks and taken back."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from dare.commands import _errors

    def failing(reports, exitcode):
        def run(args):
            for rank in reports:
                monkeypatch.setenv("RANK", str(rank))
                _errors.report("train", f"bad input seen by rank {rank}")
            raise ChildFailedError("dare", {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=exitcode,
                                                               error_file="") for r in (2, 1)})
        return run

    for reports, exitcode, rc, line in (
            ([2, 1], 2, 2, "dare train: error: bad input seen by rank 1"),
            ([], -9, 1, "dare train: error: process 1 of the run was killed by SIGKILL (its output is above)"),
            ([], 3, 1, "dare train: error: process 1 of the run exited with code 3 (its output is above)")):
        monkeypatch.setattr(torchrun, "run", failing(reports, exitcode))
        assert _errors.launch("train", ["--standalone", "--nproc_per_node=3", "-m", "dare.cli"]) == rc
        assert capsys.readouterr().err.strip().splitlines() == [line]
        assert _errors.ERROR_DIR not in os.environ
    monkeypatch.setattr(torchrun, "run", lambda args: (_ for _ in ()).throw(SignalException("SIGINT", signal.SIGINT)))
    assert _errors.launch("train", ["--standalone", "--nproc_per_node=2", "-m", "dare.cli"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
    monkeypatch.delenv("RANK", raising=False)
    _errors.report("train", "outside a launched run")  # no folder: printed here
    assert capsys.readouterr().err == "dare train: error: outside a launched run\n"
