"""The rollout benchmark runs end to end (small model, short generations) and prints its three tables; every row of
a batched group equals its serial decode."""
import pytest

from tests.scripts import load_script


@pytest.mark.integration
@pytest.mark.xdist_group("inductor")  # with tests/rollout/test_compiled_step.py: one worker's inductor compiles both
def test_bench_rollout_quick(capsys):
    mod = load_script("benchmarks/bench_rollout.py")
    assert mod.main(["--quick", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| mode")]
    compiles = mod.compile_problem() is None  # compiled rows need a working torch.compile
    modes = [r for r in rows if r.split("|")[1].strip() in {m[0] for m in mod.MODES}]
    assert [r.split("|")[1].strip() for r in modes] == [m[0] for m in mod.single_modes(True, compiles)]
    assert sum(m[4] for m in mod.single_modes(True, compiles)) == compiles  # one compiled mode where it can compile
    groups = [r for r in rows if r.startswith("| LLaDA, dual") or r.startswith("| SDAR, block")]
    assert len(groups) == (3 if compiles else 2) and all(r.split("|")[7].strip() == "yes" for r in groups)  # rows equal serial
    assert all(float(r.split("|")[10].strip().rstrip("x")) > 0 for r in groups)  # the GEMM-bound ceiling
    assert "| FLOPs per generated token" in out and "| model forward: GEMM" in out
