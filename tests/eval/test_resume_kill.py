"""Kill ``dare eval`` with SIGKILL mid-run, rerun it, and get exactly the uninterrupted results."""
import json
import os
import subprocess
import sys
import time

import pytest

N = 20


def _cmd(out):
    return [sys.executable, "-m", "dare.cli", "eval", "--model", "tiny:dream", "--benchmarks", "sudoku", "--limit", str(N),
            "--batch-size", "1", "--gen-length", "32", "--block-length", "32", "--temperature", "1.0", "--template",
            "compact", "--no-progress", "--reward-workers", "1", "--output-dir", str(out)]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.integration
def test_sigkill_then_resume_gives_complete_results_without_duplicates(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    jsonl = tmp_path / "a" / "tiny-dream" / "sudoku.jsonl"
    proc = subprocess.Popen(_cmd(tmp_path / "a"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and len(_records(jsonl)) < 3:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    partial = len(_records(jsonl))
    assert 3 <= partial < N, f"the run was not interrupted mid-way ({partial} records)"
    subprocess.run(_cmd(tmp_path / "a"), env=env, check=True, capture_output=True, timeout=600)
    resumed = _records(jsonl)
    ids = [r["id"] for r in resumed]
    assert len(ids) == len(set(ids)) == N
    assert sorted(ids, key=lambda i: int(i.rsplit("/", 1)[1])) == [f"sudoku/test/{i}" for i in range(N)]
    subprocess.run(_cmd(tmp_path / "b"), env=env, check=True, capture_output=True, timeout=600)
    straight = {r["id"]: r for r in _records(tmp_path / "b" / "tiny-dream" / "sudoku.jsonl")}
    for r in resumed:
        assert (r["completion"], r["score"], r["seed"]) == (straight[r["id"]]["completion"], straight[r["id"]]["score"],
                                                            straight[r["id"]]["seed"])
    res_a = json.loads((tmp_path / "a" / "results.json").read_text())[0]["benchmarks"]["sudoku"]
    res_b = json.loads((tmp_path / "b" / "results.json").read_text())[0]["benchmarks"]["sudoku"]
    assert res_a["n_samples"] == res_b["n_samples"] == N and res_a["mean_score"] == res_b["mean_score"]
