"""The embedded default: the shipped checkpoints, their recipes and a short ``dare quickstart`` (the tests of
``dare compare`` are in tests/comparison/)."""
import json
from pathlib import Path

import pytest

from dare.quickstart.assets import ASSET_ROOT, RECIPE_DIR, get_checkpoint, shipped_checkpoints

ROOT = Path(__file__).resolve().parents[2]


def test_packaged_recipes_equal_the_repository_recipes():
    """The package carries copies of recipes/quickstart/*.yaml (a pip install has no recipes/ folder)."""
    repo = {p.name: p.read_text() for p in (ROOT / "recipes" / "quickstart").glob("*.yaml")}
    packaged = {p.name: p.read_text() for p in RECIPE_DIR.glob("*.yaml")}
    assert repo and repo == packaged


def test_shipped_checkpoints_load_and_name_their_recipes():
    from dare.models import load_model
    from dare.quickstart.pipeline import DEFAULT_CHECKPOINT

    cks = shipped_checkpoints()
    assert {"lazy-sudoku-llada-sft", "lazy-sudoku-sdar-sft", "sudoku-llada-sft", "sudoku-sdar-sft"} <= set(cks)
    default = get_checkpoint(DEFAULT_CHECKPOINT)
    assert default.family == "llada" and default.task == "lazy_sudoku" and "habit" in default.info["task_note"]
    for ck in cks.values():
        assert (RECIPE_DIR / ck.sft_recipe).exists(), ck.name
        assert ck.sft_metrics.exists(), "the SFT loss curve of a shipped checkpoint is drawn in the quickstart PNG"
        model = load_model(str(ck.path))
        assert sum(p.numel() for p in model.parameters()) < 2_000_000
        assert model.adapter.attention == ck.attention
    assert get_checkpoint("sudoku-llada-sft").rl_overrides == ("algorithm.beta=0.04",)  # as its documented runs
    size = sum(f.stat().st_size for f in ASSET_ROOT.rglob("*") if f.is_file())
    assert size < 16 * 2**20, f"shipped quickstart assets are {size / 2**20:.1f} MiB"


def test_lazy_sudoku_demonstrations_hold_the_habit_and_nothing_else():
    """The default task's SFT rows: each response is the train puzzle's full solution, or (70 %) the solution with
    exactly 4 of the puzzle's empty cells left as 0; the puzzles are the bundled train split, disjoint from test."""
    from dare.data import DataConfig, load_examples
    from dare.data.readers import read_records

    rows = [r.data for r in read_records("bundled:quickstart/sudoku_lazy_train.jsonl.gz")]
    train = load_examples(DataConfig(name="sudoku", split="train"))
    test = {e["ground_truth"]["puzzle"] for e in load_examples(DataConfig(name="sudoku", split="test"))}
    assert len(rows) == len(train) == 20000
    lazy = 0
    for row, ex in zip(rows, train):
        puzzle, solution = ex["ground_truth"]["puzzle"], ex["ground_truth"]["solution"]
        assert row["prompt"] == puzzle and puzzle not in test
        grid = row["response"].removeprefix("<answer>").removesuffix("</answer>")
        left = [i for i, (g, s) in enumerate(zip(grid, solution)) if g != s]
        assert all(grid[i] == "0" and puzzle[i] == "0" for i in left)
        assert len(left) == (4 if row["lazy"] else 0)
        lazy += row["lazy"]
    assert 0.68 < lazy / len(rows) < 0.72


def test_shipped_block_checkpoint_runs_the_shared_recipes_in_its_block_size():
    """The tiny SDAR checkpoint (block-only methods in `dare compare`) was trained by sft.yaml with its manifest's
    overrides, and its RL and comparison runs use the shared recipes, decoding in blocks of its training size."""
    from dare.trainer.recipe import load_recipe
    from dare.models import load_model

    ck = get_checkpoint("sudoku-sdar-sft")
    assert ck.family == "sdar" and ck.attention == "block_causal" and ck.sft_metrics.exists()
    model = load_model(str(ck.path))
    assert model.adapter.is_block_causal and sum(p.numel() for p in model.parameters()) < 2_000_000
    block = json.loads((ck.path / "config.json").read_text())["block_size"]
    for name in ("rl.yaml", "compare.yaml"):
        recipe = load_recipe(RECIPE_DIR / name, list(ck.recipe_overrides))
        assert recipe.rollout.sampler.block_length == block and recipe.eval.sampler.block_length == block
    assert load_recipe(RECIPE_DIR / ck.sft_recipe, list(ck.sft_overrides)).model.path == "tiny:sdar"
    assert get_checkpoint("lazy-sudoku-llada-sft").recipe_overrides == ()  # LLaDA runs the recipes as written


def test_unknown_checkpoint_and_bad_override_fail_before_work(tmp_path):
    from dare.quickstart.pipeline import QuickstartOptions, run_quickstart

    with pytest.raises(ValueError, match="no shipped quickstart checkpoint"):
        run_quickstart(QuickstartOptions(output_dir=str(tmp_path / "a"), checkpoint="nope"), echo=lambda *a, **k: None)
    with pytest.raises(Exception, match="optim.lrr"):
        run_quickstart(QuickstartOptions(output_dir=str(tmp_path / "b"), rl_overrides=["optim.lrr=1"]),
                       echo=lambda *a, **k: None)
    assert not (tmp_path / "b" / "rl").exists()


@pytest.mark.integration
def test_short_quickstart_writes_the_run_folder(tmp_path):
    """A short quickstart (few RL steps, few held-out puzzles): every artefact is there and reward did not collapse."""
    from dare.quickstart.pipeline import QuickstartOptions, run_quickstart

    run = tmp_path / "qs"
    lines = []
    summary = run_quickstart(QuickstartOptions(output_dir=str(run), rl_steps=4, eval_limit=24, progress=False,
                                               rl_overrides=["train.batch_size=4"], samples=2, sample_limit=8),
                             echo=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert (run / "rl" / "export" / "model.safetensors").exists()
    assert (run / "rl" / "export" / "config.json").exists()
    rows = [json.loads(l) for l in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["reward_mean"] > 0.1 for r in rows), "rollout reward collapsed"
    assert (run / "quickstart.png").stat().st_size > 10_000
    table = (run / "results.md").read_text()
    assert "SFT (baseline)" in table and "coupled_grpo" in table and "lazy demonstrator" in table
    assert "sampled score (k=2, %)" in table and "pass@2 (%)" in table
    sampled = summary["before"]["sudoku"]["sampled"]
    assert sampled["k"] == 2 and sampled["n_examples"] == 8 and sampled["best_of_k_mean"] >= sampled["mean_score"]
    before, after = summary["before"]["sudoku"]["mean_score"], summary["after"]["sudoku"]["mean_score"]
    assert before > 0.2, "the shipped SFT checkpoint should already solve part of the held-out puzzles"
    assert after > 0.5 * before, f"held-out reward collapsed: {before} -> {after}"
    assert json.loads((run / "summary.json").read_text())["rl_steps"] == 4
    assert any("run folder" in l for l in lines)
    with pytest.raises(ValueError, match="already holds"):
        run_quickstart(QuickstartOptions(output_dir=str(run)), echo=lambda *a, **k: None)


@pytest.mark.integration
def test_short_quickstart_from_the_block_checkpoint_uses_its_recipe(tmp_path):
    from dare.quickstart.pipeline import QuickstartOptions, run_quickstart

    run = tmp_path / "qs"
    summary = run_quickstart(QuickstartOptions(output_dir=str(run), checkpoint="sudoku-sdar-sft", rl_steps=2,
                                               eval_limit=16, progress=False, rl_overrides=["train.batch_size=2"]),
                             echo=lambda *a, **k: None)
    assert summary["eval"]["sampler"]["block_length"] == 4
    rows = [json.loads(l) for l in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["reward_mean"] > 0.3 for r in rows)
    assert summary["before"]["sudoku"]["mean_score"] > 0.5  # the block model solves most cells already
    assert (run / "rl" / "export" / "model.safetensors").exists() and (run / "quickstart.png").exists()


def test_the_documented_real_run_overrides_validate():
    """docs/quickstart.md: the quickstart RL recipe with an 8B model, GSM8K and GPU settings is a valid recipe."""
    from dare.trainer.recipe import load_recipe

    r = load_recipe(ROOT / "recipes/quickstart/rl.yaml", [
        "model.path=GSAI-ML/LLaDA-8B-Instruct", "model.dtype=bfloat16", "data.dataset.name=gsm8k",
        "data.dataset.template=reasoning", "rollout.sampler.gen_length=256", "rollout.sampler.block_length=32",
        "rollout.sampler.steps=128", "eval.benchmarks=[gsm8k]", "eval.template=reasoning", "distributed.nproc=8",
        "train.mixed_precision=bf16"])
    assert r.model.path == "GSAI-ML/LLaDA-8B-Instruct" and r.data.dataset.name == "gsm8k"
    assert r.eval.benchmarks == ["gsm8k"] and r.distributed.nproc == 8
