"""The rollout benchmark runs end to end (small models, short generations) and prints its table."""
import importlib.util
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_rollout_quick(capsys):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_rollout.py"
    spec = importlib.util.spec_from_file_location("bench_rollout", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--quick", "--gen-length", "32", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "NFE" not in line]
    assert len(rows) == 11
    assert all("x |" in r or "baseline" in r for r in rows)
