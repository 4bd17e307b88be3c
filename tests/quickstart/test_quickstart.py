"""The embedded default: the shipped checkpoint, its recipes, a short ``dare quickstart`` and ``dare compare``."""
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


def test_compare_matches_updates_and_rollouts_and_uses_paper_settings():
    """Every method: the same optimizer updates and rollouts (mu x prompts per step, updates / mu steps); its lr is
    the recipe's times its paper lr over the anchor's, and its Sudoku script's values apply."""
    from dare.quickstart.assets import recipe_path
    from dare.quickstart.compare import CompareOptions, method_settings

    ck = get_checkpoint("sudoku-llada-sft")
    rpath, base = recipe_path("compare.yaml"), [f"model.path={ck.path}"]
    opts = CompareOptions(updates=48)
    seen = {}
    for name in ("coupled_grpo", "d1", "spg", "tracerl"):
        ov, info = method_settings(rpath, base, name, "coupled_grpo", opts, [])
        seen[name] = info
        assert info["steps"] * info["mu"] == 48 and f"train.steps={info['steps']}" in ov
    assert len({i["rollouts"] for i in seen.values()}) == 1, seen
    assert (seen["d1"]["mu"], seen["spg"]["mu"], seen["tracerl"]["mu"], seen["coupled_grpo"]["mu"]) == (8, 4, 1, 2)
    assert seen["d1"]["lr"] == pytest.approx(3 * seen["coupled_grpo"]["lr"])  # 3e-6 vs 1e-6 in the papers
    assert seen["d1"]["temperature"] == 0.3 and seen["d1"]["grad_clip"] == 0.2 and seen["tracerl"]["grad_clip"] == 1.0
    assert seen["d1"]["lora"] == seen["spg"]["lora"] == 128 and seen["coupled_grpo"]["lora"] is None
    # a user's per-method override wins over the paper's value, and the budget follows it
    _, info = method_settings(rpath, base, "d1", "coupled_grpo", opts, ["algorithm.inner_iterations=4"])
    assert info["mu"] == 4 and info["steps"] == 12
    # --shared-settings: the recipe's lr / clip / temperature for every method, the budget still matched
    _, shared = method_settings(rpath, base, "d1", "coupled_grpo", CompareOptions(updates=48, paper_settings=False), [])
    assert shared["lr"] == seen["coupled_grpo"]["lr"] and shared["steps"] * shared["mu"] == 48
    with pytest.raises(ValueError, match="not a multiple"):
        method_settings(rpath, base, "d1", "coupled_grpo", CompareOptions(updates=20), [])


def test_learning_verdict_and_table():
    from dare.quickstart.report import compare_table, learning_verdict

    assert learning_verdict(0.20, 0.03, 0.25, 3) == "yes"
    assert learning_verdict(0.20, 0.12, 0.25, 3) == "no"  # within twice the seed spread
    assert learning_verdict(0.10, 0.01, 0.25, 3) == "no"  # under half the default method's gain
    assert learning_verdict(0.20, 0.0, 0.25, 1) == "1 seed"
    run = lambda score, seed: {"after": {"sudoku": {"mean_score": score, "accuracy": 0.0}}, "seed": seed, "seconds": 60,
                               "settings": {"mu": 2, "steps": 24, "prompts_per_step": 16, "lr": 1e-4, "grad_clip": 0.2,
                                            "temperature": 1.0}}
    res = {"llada": {"baseline": {"sudoku": {"mean_score": 0.4, "accuracy": 0.0}}, "anchor": "coupled_grpo",
                     "runs": {"coupled_grpo": [run(0.6, 0), run(0.62, 1)], "spg": [run(0.41, 0), run(0.39, 1)]}}}
    table = compare_table(res, "sudoku")
    assert "| coupled_grpo (default) | 2 | 24 x 16 | 0.0001 | 0.2 | 1 | - |" in table and "+0.210 | yes |" in table and "+0.000 | no |" in table


def test_compare_plan_follows_the_registry_and_supports():
    from dare.algorithms import ALGORITHMS
    from dare.quickstart.compare import CompareOptions, plan, rl_algorithms

    algos = rl_algorithms()
    assert "coupled_grpo" in algos and "sft" not in algos and "dpo" not in algos
    for ck, names in plan(CompareOptions()):
        assert names, ck.name
        for n in names:
            assert ck.attention in ALGORITHMS[n].supports
    with pytest.raises(ValueError, match="not registered"):
        plan(CompareOptions(algorithms=["no_such_algo"]))


@pytest.mark.slow
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
    assert "sampled mean reward (k=2)" in table and "pass@2" in table
    sampled = summary["before"]["sudoku"]["sampled"]
    assert sampled["k"] == 2 and sampled["n_examples"] == 8 and sampled["best_of_k_mean"] >= sampled["mean_score"]
    before, after = summary["before"]["sudoku"]["mean_score"], summary["after"]["sudoku"]["mean_score"]
    assert before > 0.2, "the shipped SFT checkpoint should already solve part of the held-out puzzles"
    assert after > 0.5 * before, f"held-out reward collapsed: {before} -> {after}"
    assert json.loads((run / "summary.json").read_text())["rl_steps"] == 4
    assert any("run folder" in l for l in lines)
    with pytest.raises(ValueError, match="already holds"):
        run_quickstart(QuickstartOptions(output_dir=str(run)), echo=lambda *a, **k: None)


@pytest.mark.slow
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


@pytest.mark.slow
def test_compare_runs_one_algorithm_and_writes_table_and_figure(tmp_path):
    from dare.quickstart.compare import CompareOptions, run_compare

    out = tmp_path / "cmp"
    opts = CompareOptions(algorithms=["d1"], families=["llada"], seeds=1, updates=2, eval_limit=16, output_dir=str(out),
                          overrides=["train.batch_size=2", "d1:algorithm.inner_iterations=1"], progress=False,
                          docs_dir=str(tmp_path / "docs"))
    results = run_compare(opts, echo=lambda *a, **k: None)
    runs = results["llada"]["runs"]["d1"]
    assert len(runs) == 1 and runs[0]["steps"] == 2 and runs[0]["settings"]["mu"] == 1
    assert runs[0]["settings"]["temperature"] == 0.3  # d1's Sudoku script
    assert "d1" in (out / "comparison.md").read_text()
    assert (tmp_path / "docs" / "comparison.png").exists()
    # rerunning reuses the finished run
    again = run_compare(opts, echo=lambda *a, **k: None)
    assert again["llada"]["runs"]["d1"][0]["seconds"] == runs[0]["seconds"]
    # --report-only tabulates what is finished and starts nothing
    opts.algorithms, opts.report_only = ["d1", "spg"], True
    report = run_compare(opts, echo=lambda *a, **k: None)
    assert list(report["llada"]["runs"]) == ["d1"] and not (out / "llada" / "spg").exists()


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


def test_train_reward_ends_use_a_quarter_of_a_short_run(tmp_path):
    """A mu = 8 method makes 6 steps: its first and last windows are 1 step each, not the same 6 steps twice."""
    import json
    from dare.quickstart.compare import _train_reward_ends
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i + 1, "reward_mean": r}) + "\n" for i, r in enumerate([.1, .2, .3, .4, .5, .6])))
    assert _train_reward_ends(path) == (0.1, 0.6)
    path.write_text("".join(json.dumps({"step": i + 1, "reward_mean": float(i)}) + "\n" for i in range(48)))
    assert _train_reward_ends(path) == (4.5, 42.5)  # 10-step windows
