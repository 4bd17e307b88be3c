"""A run folder belongs to one run of one recipe: fingerprints, locks, verified checkpoints, one-line failures."""
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from dare.cli import main as dare_main
from dare.trainer.checkpoint import MANIFEST, CheckpointError, verify
from dare.trainer.loop import Trainer
from dare.trainer.run_folder import RecipeChanged, RunFolderBusy, RunLock, recipe_changes
from tests.trainer.helpers import ROOT, TOY_SFT, sft_recipe

SFT_ARGS = ["model.path=tiny:llada", "model.tiny_sizes={hidden_size: 32, num_layers: 1}", "algorithm.name=sft",
            f"data.pairs={TOY_SFT}", "data.max_length=48", "optim.lr=3e-3", "train.batch_size=8",
            "train.micro_batch_size=2", "train.export=false", "logging.progress=false", "logging.tensorboard=false",
            "logging.plot=false"]


def run_cli(*argv):
    """``dare ...`` in this process: (exit code, stderr lines)."""
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = dare_main(list(argv))
    return code, [line for line in err.getvalue().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ fingerprint
def test_a_changed_recipe_does_not_silently_resume(tmp_path):
    Trainer(sft_recipe(tmp_path, "train.steps=2")).run()
    other = tmp_path / "other.jsonl"
    shutil.copy(TOY_SFT, other)
    with pytest.raises(RecipeChanged) as err:
        Trainer(sft_recipe(tmp_path, "train.steps=2", "optim.lr=1e-2", f"data.pairs={other}", "train.seed=3"))
    msg = str(err.value)
    assert "optim.lr: 0.003 -> 0.01" in msg and "data.pairs:" in msg and "train.seed: 0 -> 3" in msg
    assert "train.resume=never" in msg and "train.allow_recipe_change=true" in msg
    # What a resume may change: the step budget (extend the run), logging, saving, micro-batching.
    extended = Trainer(sft_recipe(tmp_path, "train.steps=3", "train.micro_batch_size=4", "logging.plot=true",
                                  "train.keep_checkpoints=3"))
    assert extended.start_step == 2
    extended.close()
    with pytest.raises(RecipeChanged, match="train.steps=1, but .* is at step 2"):
        Trainer(sft_recipe(tmp_path, "train.steps=1"))
    state = json.loads((tmp_path / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert len(state["fingerprint"]) == 16


def test_the_opt_in_resumes_with_the_changes_and_says_so(tmp_path, caplog):
    Trainer(sft_recipe(tmp_path, "train.steps=2")).run()
    with caplog.at_level(logging.WARNING):
        t = Trainer(sft_recipe(tmp_path, "train.steps=3", "optim.lr=1e-2", "train.allow_recipe_change=true"))
    assert t.start_step == 2 and "optim.lr: 0.003 -> 0.01" in caplog.text
    t.run()
    state = json.loads((tmp_path / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["recipe"]["optim"]["lr"] == 0.01  # the next resume compares against the new recipe


def test_a_finished_run_reused_with_new_settings_fails_in_one_line(tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", "recipes/sft_tiny.yaml", *SFT_ARGS, "train.steps=1", f"train.output_dir={out}")[0] == 0
    exported_before = sorted(p.name for p in out.iterdir())
    code, lines = run_cli("train", "recipes/sft_tiny.yaml", *SFT_ARGS, "train.steps=1", f"train.output_dir={out}",
                          "optim.lr=1e-2")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dare train: error:") and "optim.lr" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == exported_before


def test_fingerprint_ignores_only_resumable_keys():
    base = {"optim": {"lr": 1e-3}, "train": {"steps": 5, "seed": 0, "save_every": 1}, "logging": {"wandb": False}}
    changed = {"optim": {"lr": 1e-3}, "train": {"steps": 50, "seed": 0, "save_every": 7}, "logging": {"wandb": True}}
    assert recipe_changes(base, changed) == []
    assert recipe_changes(base, {**changed, "train": {**changed["train"], "seed": 1}}) == ["train.seed: 0 -> 1"]


# ------------------------------------------------------------------------------------------------ lock
HOLD = ("import sys, time\nfrom dare.trainer.run_folder import RunLock\nRunLock(sys.argv[1], 'dare train').acquire()\n"
        "print('locked', flush=True)\ntime.sleep(120)\n")


def hold_lock(folder):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_in_the_same_folder_fails_at_once_and_a_killed_one_leaves_no_lock(tmp_path):
    holder = hold_lock(tmp_path)
    try:
        start = time.monotonic()
        with pytest.raises(RunFolderBusy, match=rf"in use by another run \(dare train, pid {holder.pid}"):
            Trainer(sft_recipe(tmp_path))
        assert time.monotonic() - start < 5  # before any model is built
        code, lines = run_cli("eval", "--model", "tiny:llada", "--benchmarks", "sudoku", "--limit", "1",
                              "--output-dir", str(tmp_path), "--no-progress")
        assert code == 2 and len(lines) == 1 and "in use by another run" in lines[0]
    finally:
        holder.send_signal(signal.SIGKILL)  # the kernel drops a flock with its process: nothing stale remains
        holder.wait()
    assert (tmp_path / ".lock").exists()
    t = Trainer(sft_recipe(tmp_path, "train.steps=1"))
    t.run()
    with RunLock(tmp_path, "test"):  # released at the end of run()
        pass


def test_output_dir_that_is_a_file_is_one_line(tmp_path):
    target = tmp_path / "a_file"
    target.write_text("x")
    code, lines = run_cli("train", "recipes/sft_tiny.yaml", *SFT_ARGS, f"train.output_dir={target}")
    assert code == 2 and lines == [f"dare train: error: output folder {target}: {target} is a file, not a folder"]
    code, lines = run_cli("eval", "--model", "tiny:llada", "--benchmarks", "sudoku", "--output-dir", str(target / "x"))
    assert code == 2 and len(lines) == 1 and "is a file, not a folder" in lines[0]


# ------------------------------------------------------------------------------------------------ checkpoints
def two_checkpoints(tmp_path):
    Trainer(sft_recipe(tmp_path, "train.steps=2", "train.save_every=1")).run()
    ck = tmp_path / "checkpoints"
    assert [p.name for p in sorted(ck.iterdir())] == ["step-1", "step-2"]
    return ck


def flip_a_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_bit_flip_is_caught_and_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, caplog):
    ck = two_checkpoints(tmp_path)
    manifest = json.loads((ck / "step-2" / MANIFEST).read_text())["files"]
    assert {"trainer_state.json", "rng-rank0.pt"} <= set(manifest) and any(n.startswith("dcp/") for n in manifest)
    assert verify(ck / "step-2") is None
    weights = next((ck / "step-2" / "dcp").glob("*.distcp"))
    flip_a_byte(weights)
    assert "does not match its sha256" in verify(ck / "step-2")
    with caplog.at_level(logging.WARNING):
        t = Trainer(sft_recipe(tmp_path, "train.steps=2", "train.save_every=1"))
    assert t.start_step == 1
    assert f"skipped damaged checkpoint(s) step-2: dcp/{weights.name} does not match its sha256" in caplog.text
    t.close()
    with pytest.raises(CheckpointError, match=f"damaged checkpoint: dcp/{weights.name}"):  # asked for by name: no fallback
        Trainer(sft_recipe(tmp_path / "new", f"train.resume={ck / 'step-2'}"))
    rng = ck / "step-1" / "rng-rank0.pt"
    rng.write_bytes(rng.read_bytes()[:20])  # truncated
    with pytest.raises(CheckpointError, match="no intact checkpoint.*step-1: rng-rank0.pt has 20 bytes"):
        Trainer(sft_recipe(tmp_path, "train.steps=2"))


def test_checkpoints_without_a_manifest_still_name_a_truncated_rng_file(tmp_path):
    ck = two_checkpoints(tmp_path)
    (ck / "step-2" / MANIFEST).unlink()  # as written by an older dare
    rng = ck / "step-2" / "rng-rank0.pt"
    rng.write_bytes(rng.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=r"rng-rank0.pt: unreadable .*the checkpoint is damaged"):
        Trainer(sft_recipe(tmp_path, "train.steps=3"))


def test_a_checkpoint_missing_its_shard_and_manifest_falls_back_to_the_previous_intact_one(tmp_path, caplog):
    # Without a manifest there is nothing to check sizes against, so the checkpoint is checked against itself:
    # every file its DCP metadata names must be there (a manifest-less checkpoint may come from an older dare).
    ck = two_checkpoints(tmp_path)
    (ck / "step-2" / MANIFEST).unlink()
    shard = next((ck / "step-2" / "dcp").glob("*.distcp"))
    shard.unlink()
    assert f"dcp/{shard.name} is missing" in verify(ck / "step-2")
    with caplog.at_level(logging.WARNING):
        t = Trainer(sft_recipe(tmp_path, "train.steps=3"))
    assert t.start_step == 1
    assert f"skipped damaged checkpoint(s) step-2: dcp/{shard.name} is missing" in caplog.text
    t.close()
    (ck / "step-1" / "dcp" / ".metadata").unlink()
    (ck / "step-1" / MANIFEST).unlink()
    assert "dcp/.metadata is missing" in verify(ck / "step-1")


def _save_unchecked(t, step, monkeypatch):
    """Write a checkpoint of ``t`` past the writer's finiteness check, as a checkpoint from elsewhere could be."""
    import dare.trainer.finite_state as finite_state
    with monkeypatch.context() as m:
        m.setattr(finite_state, "first_non_finite", lambda state, prefix="": None)
        t.ckpt.save(step, t.model, t.optimizer, {"step": step, "scheduler": t.scheduler.state_dict(), "recipe": {}})


def test_non_finite_weights_at_load_name_the_tensor(tmp_path, monkeypatch):
    t = Trainer(sft_recipe(tmp_path, "train.steps=2"))
    t.train_step(0)
    name, param = next((n, p) for n, p in t.model.named_parameters() if "layers.0" in n)
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    # Trainer.save_checkpoint and the checkpoint writer refuse a NaN state; bypass them.
    _save_unchecked(t, 1, monkeypatch)
    t.close()
    with pytest.raises(CheckpointError, match=rf"tensor model\.{name} holds non-finite values"):
        Trainer(sft_recipe(tmp_path, "train.steps=2"))


def _poison_adam(t, value):
    """An infinite (or NaN) second moment with finite weights: what one step of overflowing gradient squares leaves."""
    name, param = next((n, p) for n, p in t.model.named_parameters() if "layers.0" in n)
    t.optimizer.state[param]["exp_avg_sq"].view(-1)[0] = value
    return name


def test_a_poisoned_optimizer_state_is_never_written_and_the_last_intact_checkpoint_is_named(tmp_path):
    """Issue 41, finding 4: weights finite, Adam's exp_avg_sq not. The writer refuses it (keeping the good checkpoint
    that rotation would have removed) and names that one as the last intact checkpoint."""
    t = Trainer(sft_recipe(tmp_path, "train.steps=3", "train.keep_checkpoints=1"))
    t.train_step(0)
    t.save_checkpoint(1)
    t.train_step(1)
    name = _poison_adam(t, float("inf"))
    assert all(bool(torch.isfinite(p).all()) for p in t.model.parameters())
    with pytest.raises(CheckpointError, match=rf"not writing checkpoint step-2: tensor optim\.state\.{name}\.exp_avg_sq "
                                              rf"holds non-finite values .*the last intact checkpoint is .*step-1\b"):
        t.save_checkpoint(2)
    t.close()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]


def test_a_checkpoint_with_a_non_finite_optimizer_state_is_refused_at_load(tmp_path, monkeypatch):
    t = Trainer(sft_recipe(tmp_path, "train.steps=2"))
    t.train_step(0)
    name = _poison_adam(t, float("nan"))
    _save_unchecked(t, 1, monkeypatch)
    t.close()
    with pytest.raises(CheckpointError, match=rf"step-1: tensor optim\.state\.{name}\.exp_avg_sq holds non-finite"):
        Trainer(sft_recipe(tmp_path, "train.steps=2"))


def test_a_failed_save_leaves_no_tmp_folder_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    import dare.trainer.checkpoint as checkpoint
    t = Trainer(sft_recipe(tmp_path, "train.steps=2", "train.save_every=1"))
    t.train_step(0)
    t.save_checkpoint(1)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)  # half a file on disk, then the device is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint step-2 .*No space left on device .*step-1 is intact"):
        t.save_checkpoint(2)
    t.close()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]


def test_a_full_disk_is_one_line_from_the_command(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot mount a small tmpfs in a user namespace here")
    out = tmp_path / "run"
    args = " ".join(f"'{a}'" for a in SFT_ARGS + ["train.steps=1", f"train.output_dir={out}"])
    script = (f"mount -t tmpfs -o size=64k tmpfs {tmp_path} && {sys.executable} -m dare.cli train recipes/sft_tiny.yaml "
              f"{args}; echo rc=$?; ls -a {out}/checkpoints")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors and len(errors) == 1, done.stderr[-2000:]
    assert errors[0].startswith("dare train: error: cannot write checkpoint step-1") and "No space left on device" in errors[0]
    assert "rc=2" in done.stdout and ".tmp-" not in done.stdout, done.stdout
