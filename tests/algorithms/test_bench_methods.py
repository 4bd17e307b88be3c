"""The methods benchmark (JustGRPO forwards, d-TreeRPO tree cost) runs end to end and prints its two tables."""
import pytest

from tests.scripts import load_script


@pytest.mark.integration
def test_bench_methods_quick(capsys):
    mod = load_script("benchmarks/bench_methods.py")
    assert mod.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    jg = [r for r in rows if r.startswith(("| llada, ", "| sdar, "))]
    trees = [r for r in rows if "leaves per prompt" in r]
    assert len(jg) == 2 and len(trees) == 5
    sdar = jg[1].split("|")
    assert sdar[3].strip().startswith("1 /")  # one forward on block models
    assert all(float(r.split("|")[4].strip().rstrip("x")) > 1.0 for r in trees)  # fewer sequence-forwards
