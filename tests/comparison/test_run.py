"""``dare compare`` (dare.comparison): the matched budget and paper settings of each run, the plan from the registry,
the report's data and table, and a short comparison end to end (integration tier)."""
import pytest

from dare.quickstart.assets import get_checkpoint


def test_compare_matches_updates_and_rollouts_and_uses_paper_settings():
    """Every method: the same optimizer updates and rollouts (mu x prompts per step, updates / mu steps); its lr is
    the recipe's times its paper lr over the anchor's, and its Sudoku script's values apply."""
    from dare.quickstart.assets import recipe_path
    from dare.comparison.run import CompareOptions, method_settings

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
    from dare.comparison.report import compare_table, learning_verdict

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
    assert "| coupled_grpo (default) | 2 | 24 x 16 | 0.0001 | 0.2 | 1 | - |" in table and "+21.0 | yes |" in table and "+0.0 | no |" in table


def test_compare_plan_follows_the_registry_and_supports():
    from dare.algorithms import ALGORITHMS
    from dare.comparison.run import CompareOptions, plan, rl_algorithms

    algos = rl_algorithms()
    assert "coupled_grpo" in algos and "sft" not in algos and "dpo" not in algos
    for ck, names in plan(CompareOptions()):
        assert names, ck.name
        for n in names:
            assert ck.attention in ALGORITHMS[n].supports
    with pytest.raises(ValueError, match="not registered"):
        plan(CompareOptions(algorithms=["no_such_algo"]))


@pytest.mark.integration
def test_compare_runs_one_algorithm_and_writes_table_and_figure(tmp_path):
    from dare.comparison.run import CompareOptions, run_compare

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


def test_train_reward_ends_use_a_quarter_of_a_short_run(tmp_path):
    """A mu = 8 method makes 6 steps: its first and last windows are 1 step each, not the same 6 steps twice."""
    import json
    from dare.comparison.run import _train_reward_ends
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i + 1, "reward_mean": r}) + "\n" for i, r in enumerate([.1, .2, .3, .4, .5, .6])))
    assert _train_reward_ends(path) == (0.1, 0.6)
    path.write_text("".join(json.dumps({"step": i + 1, "reward_mean": float(i)}) + "\n" for i in range(48)))
    assert _train_reward_ends(path) == (4.5, 42.5)  # 10-step windows
