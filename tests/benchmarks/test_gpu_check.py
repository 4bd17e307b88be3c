"""benchmarks/gpu_check.py, the one command a lent GPU is spent on: its CPU mode runs every part at tiny shapes (so
the script cannot rot between GPUs), and its report keeps going past a part that fails or cannot run."""
import json

import pytest

from tests.rollout.fixture_cases import FOLDERS
from tests.scripts import load_script


def _check():
    return load_script("benchmarks/gpu_check.py")


@pytest.mark.integration
def test_quick_cpu_mode_runs_every_part_and_writes_the_tables(tmp_path):
    check = _check()
    assert check.main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    results = {r["part"]: r for r in report["results"]}
    assert list(results) == list(check.PARTS)
    assert {p: r["status"] for p, r in results.items()} == {p: "ok" for p in check.PARTS}
    families = [r["family"] for r in results["correctness"]["rows"]]
    assert families == FOLDERS and all(r["ok"] for r in results["correctness"]["rows"])
    assert all(r["fp32 vs reference"] <= 1e-4 for r in results["correctness"]["rows"])
    backends = [r for r in results["backends"]["rows"] if "ok" in r]
    assert {(r["family"], r["dtype"]) for r in backends} == {(f, d) for f in ("llada", "dream", "sdar")
                                                             for d in ("float32", "bfloat16")}
    speed = results["speed"]["rows"]
    assert any(r["what"].startswith("SDAR") for r in speed) and any("SFT" in r["what"] for r in speed)
    assert all(r["per s"] > 0 and r["FLOPs"] > 0 for r in speed)
    phases = [(r["config"], r["phase"]) for r in results["plan"]["rows"]]
    assert ("LoRA SFT (tiny)", "update") in phases and ("d1 + LoRA (tiny)", "rollout") in phases
    assert all(abs(r["deviation"]) <= 0.05 and r["real s (under the trackers)"] > 0 for r in results["plan"]["rows"])
    md = (tmp_path / "gpu_check.md").read_text()
    for part in check.PARTS:
        assert f"## {part}: ok" in md


def test_a_failing_part_is_recorded_and_the_next_part_runs(tmp_path, monkeypatch):
    check = _check()

    def broken(ctx):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")

    def unavailable(ctx):
        raise check.gpu_parts.Skip("flash-attn is not installed")

    monkeypatch.setattr(check.gpu_parts, "correctness", broken)
    monkeypatch.setattr(check.gpu_parts, "backends", unavailable)
    assert check.main(["--device", "cpu", "--parts", "correctness,backends", "--out", str(tmp_path)]) == 1
    results = json.loads((tmp_path / "gpu_check.json").read_text())["results"]
    assert [(r["part"], r["status"]) for r in results] == [("correctness", "error"), ("backends", "skipped")]
    assert results[0]["reason"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## backends: skipped" in md and "flash-attn is not installed" in md


def test_unknown_parts_and_a_missing_cuda_device_are_one_line_errors(tmp_path, capsys):
    check = _check()
    with pytest.raises(SystemExit):
        check.main(["--parts", "speed,colour", "--out", str(tmp_path)])
    assert "unknown part(s) ['colour']" in capsys.readouterr().err
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            check.main(["--device", "cuda", "--out", str(tmp_path)])
        assert "no CUDA device is visible" in capsys.readouterr().err


def test_full_size_configurations_resolve_and_too_little_memory_is_a_skip(monkeypatch):
    """What only a GPU runs, checked here as far as a CPU can: the plan part's full-size recipes load and validate with
    their overrides, and a full-shape model that does not fit is a one-line skip (built on the meta device only)."""
    import torch
    from dare.trainer.recipe import load_recipe
    from tests.scripts import ROOT
    parts = _check().gpu_parts
    for label, rel, overrides in parts.plan_configs(quick=False):
        recipe = load_recipe(ROOT / rel, overrides)
        assert recipe.distributed.nproc == 1 and recipe.model.path == parts.LLADA_8B, label
    ctx = parts.Context(device=torch.device("cpu"), quick=False)
    monkeypatch.setattr(parts.Context, "free_bytes", lambda self: 2 ** 30)
    with pytest.raises(parts.Skip, match=r"GSAI-ML/LLaDA-8B-Instruct: 1\d\.\d GiB of torch.bfloat16 weights do not fit"):
        parts.full_shape_model(parts.LLADA_8B, ctx)
