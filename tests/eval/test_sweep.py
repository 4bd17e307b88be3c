"""``dare eval --sweep``: one full evaluation per setting and the accuracy-vs-TPF frontier (table, JSON, PNG)."""
import json

import pytest

from dare.cli import main
from dare.commands.eval import sweep_settings
from dare.eval.frontier import frontier_markdown, frontier_points
from dare.quickstart.assets import get_checkpoint


def test_sweep_settings_grid_and_errors():
    assert sweep_settings([]) == [()]
    assert sweep_settings(["threshold=0.5, 0.9"]) == [("sampler.threshold=0.5",), ("sampler.threshold=0.9",)]
    grid = sweep_settings(["sampler.cache=none,dual", "seed=0,1"])  # not a sampler field: kept as given
    assert grid == [("sampler.cache=none", "seed=0"), ("sampler.cache=none", "seed=1"),
                    ("sampler.cache=dual", "seed=0"), ("sampler.cache=dual", "seed=1")]
    for bad in ("threshold", "threshold=", "=0.5"):
        with pytest.raises(ValueError, match="expected KEY=V1,V2"):
            sweep_settings([bad])


def _res(model, bench, score, tpf):
    return {"model": model, "benchmarks": {bench: {"score": score, "tpf": tpf, "metric": "accuracy",
                                                   "nfe_per_sample": 10.0, "tokens_per_second": 5.0}}}


def test_frontier_marks_the_pareto_points_per_model_and_benchmark():
    runs = [("t=1.0", [_res("a", "x", 50.0, 1.0), _res("b", "x", 10.0, 1.0)]),
            ("t=0.9", [_res("a", "x", 50.0, 2.0), _res("b", "x", 12.0, 0.5)]),
            ("t=0.5", [_res("a", "x", 40.0, 3.0), _res("b", "x", 9.0, 0.9)]),
            ("lm", [{"model": "a", "benchmarks": {"mmlu": {"score": 60.0, "tpf": None}}}])]
    pts = {(p["model"], p["setting"]): p for p in frontier_points(runs)}
    assert len(pts) == 6  # the lm-eval task has no TPF: not a point
    # a: t=1.0 is dominated by t=0.9 (same score, higher TPF); t=0.5 trades score for speed: on the frontier.
    assert [pts[("a", s)]["pareto"] for s in ("t=1.0", "t=0.9", "t=0.5")] == [False, True, True]
    # b: t=0.5 (9.0 at 0.9) is dominated by t=1.0 (10.0 at 1.0); the other two are on the frontier.
    assert [pts[("b", s)]["pareto"] for s in ("t=1.0", "t=0.9", "t=0.5")] == [True, True, False]
    md = frontier_markdown(frontier_points(runs), "t")
    assert "| a | x | t=0.9 | 50.0 | 2.00 | 10.0 | 5.0 | * |" in md and "| a | x | t=1.0 | 50.0 | 1.00 | 10.0 | 5.0 |  |" in md


@pytest.mark.integration
def test_sweep_runs_every_setting_and_writes_the_frontier(tmp_path, one_thread):
    ckpt = str(get_checkpoint("lazy-sudoku-sdar-sft").path)
    out = tmp_path / "sweep"
    # --threshold is overridden by the sweep (a sweep's setting is applied last).
    assert main(["eval", "--model", ckpt, "--benchmarks", "sudoku", "--template", "compact", "--gen-length", "40",
                 "--limit", "6", "--batch-size", "6", "--device", "cpu", "--no-progress", "--reward-workers", "1",
                 "--threshold", "0.3", "--output-dir", str(out), "--sweep", "threshold=0.5,1.0"]) == 0
    data = json.loads((out / "frontier.json").read_text())
    assert data["swept"] == "threshold"
    pts = {p["setting"]: p for p in data["points"]}
    assert set(pts) == {"sampler.threshold=0.5", "sampler.threshold=1.0"}
    for setting, p in pts.items():
        res = json.loads((out / "sweep" / setting / "lazy-sudoku-sdar-sft" / "results.json").read_text())
        s = res["benchmarks"]["sudoku"]
        assert res["sampler"]["threshold"] == float(setting.split("=")[1])
        assert (p["score"], p["tpf"], p["nfe_per_sample"]) == (s["score"], s["tpf"], s["nfe_per_sample"])
    # Threshold 1.0 commits the schedule's one token per step (TPF <= 1); 0.5 commits several on this trained model.
    assert pts["sampler.threshold=1.0"]["tpf"] <= 1.0 < pts["sampler.threshold=0.5"]["tpf"]
    assert (out / "frontier.png").stat().st_size > 10_000 and (out / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert "| lazy-sudoku-sdar-sft | sudoku | sampler.threshold=0.5 |" in (out / "frontier.md").read_text()


def test_sweep_of_an_unknown_key_is_an_error_naming_it(tmp_path, capsys):
    assert main(["eval", "--model", "tiny:llada", "--benchmarks", "sudoku", "--output-dir", str(tmp_path),
                 "--sweep", "sampler.tresh=0.5,0.9"]) != 0
    assert "unknown config key 'sampler.tresh'" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()  # every setting is checked before the first evaluation
