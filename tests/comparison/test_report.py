"""The comparison's report: its data (docs/comparison.json, what the table shows) renders the checked-in table byte
for byte, and a report written from runs renders back from its stored data alone."""
import json
from pathlib import Path

import pytest

from dare.comparison.report import comparison_data, compare_table, dump_data, load_data, render_summary, render_table

ROOT = Path(__file__).resolve().parents[2]


def _run(score, seed, seconds=60.0, first=0.3, last=0.5):
    return {"after": {"sudoku": {"mean_score": score, "accuracy": score / 10}}, "seed": seed, "seconds": seconds,
            "train_reward_first": first, "train_reward_last": last,
            "settings": {"mu": 2, "steps": 24, "prompts_per_step": 8, "updates": 48, "lr": 1e-4 / 3, "grad_clip": 0.2,
                         "temperature": 1.0, "rollouts": 1536, "paper_settings": True, "lora": None}}


def test_the_checked_in_table_is_rendered_from_its_stored_data():
    data = load_data(ROOT / "docs" / "comparison.json")
    assert render_table(data) == (ROOT / "docs" / "comparison_table.md").read_text(encoding="utf-8")
    for fam in data["families"]:  # every method of the table has its settings and measurements
        assert fam["anchor"] in {e["algorithm"] for e in fam["methods"]}
        for e in fam["methods"]:
            assert e["seeds"] >= 1
            assert {"mu", "steps", "prompts_per_step", "lr", "grad_clip", "temperature"} <= set(e["settings"])


def test_report_only_renders_the_stored_data_byte_for_byte(tmp_path, capsys):
    """``dare compare --report-only --data docs/comparison.json --docs DIR``: the checked-in table, no runs needed."""
    from dare.cli import main as dare_main
    assert dare_main(["compare", "--report-only", "--data", str(ROOT / "docs" / "comparison.json"),
                      "--output-dir", str(tmp_path / "out"), "--docs", str(tmp_path / "docs")]) == 0
    table = (ROOT / "docs" / "comparison_table.md").read_text(encoding="utf-8")
    assert (tmp_path / "docs" / "comparison_table.md").read_text(encoding="utf-8") == table
    assert (tmp_path / "out" / "comparison.md").read_text(encoding="utf-8") == table
    assert load_data(tmp_path / "docs" / "comparison.json") == load_data(ROOT / "docs" / "comparison.json")
    assert dare_main(["compare", "--data", str(ROOT / "docs" / "comparison.json"), "--output-dir", str(tmp_path)]) == 2
    assert "--data needs --report-only" in capsys.readouterr().err


def test_data_from_runs_round_trips_through_its_file(tmp_path):
    """What ``dare compare`` writes from its runs renders the same table from the file as from the runs."""
    results = {"llada": {"checkpoint": "ck", "task": "t", "anchor": "coupled_grpo",
                         "baseline": {"sudoku": {"mean_score": 0.41, "accuracy": 0.005}},
                         "runs": {"coupled_grpo": [_run(0.6, 0, 200.0), _run(0.6123456789, 1, 190.0)],
                                  "d1": [_run(0.5, 0, first=None, last=None)]},
                         "failed": {"spg": "RuntimeError: boom"}}}
    data = comparison_data(results, "sudoku")
    (tmp_path / "comparison.json").write_text(dump_data(data), encoding="utf-8")
    stored = load_data(tmp_path / "comparison.json")
    assert stored == data and render_table(stored) == compare_table(results, "sudoku")
    entry = stored["families"][0]["methods"][0]
    assert entry["algorithm"] == "coupled_grpo" and entry["seeds"] == 2
    assert entry["change"] == pytest.approx(0.6061728 - 0.41)
    table = render_table(stored)
    assert "| llada | coupled_grpo (default) | 2 | 24 x 8 | 3.33e-05 | 0.2 | 1 | - |" in table
    assert "| llada | d1 | 2 | 24 x 8 |" in table and "| 1 seed |" in table and "| 1 | - | 1.0 |" in table
    assert "| llada | spg | | | | | | | failed: RuntimeError: boom |" in table


def test_a_file_that_is_no_report_is_an_error_naming_it(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"llada": {}}))
    with pytest.raises(ValueError, match="x.json"):
        load_data(bad)


def _fam(family, baseline, runs: dict, failed=None):
    return {family: {"baseline": {"sudoku": {"mean_score": baseline, "accuracy": 0.005}}, "anchor": "a",
                     "checkpoint": f"{family}-ckpt", "task": "lazy_sudoku", "runs": runs, "failed": failed or {}}}


def test_merge_replaces_a_methods_row_adds_new_ones_and_keeps_the_rest():
    from dare.comparison.report import merge_data
    stored = comparison_data({**_fam("llada", 0.41, {"a": [_run(0.5, 0), _run(0.52, 1)], "b": [_run(0.45, 0)]},
                                     failed={"c": "boom"}),
                              **_fam("sdar", 0.79, {"a": [_run(0.8, 0)]})}, "sudoku")
    new = comparison_data(_fam("llada", 0.4102, {"b": [_run(0.6, 0), _run(0.62, 1)], "c": [_run(0.55, 0)],
                                                 "d": [_run(0.3, 0)]}), "sudoku")
    merged = merge_data(stored, new)
    llada, sdar = merged["families"]
    assert [e["algorithm"] for e in llada["methods"]] == ["a", "b", "c", "d"]
    rows = {e["algorithm"]: e for e in llada["methods"]}
    assert rows["a"] == stored["families"][0]["methods"][0]          # kept as stored
    assert rows["b"]["seeds"] == 2 and rows["b"]["mean"] == pytest.approx(0.61)  # replaced by the new runs
    assert llada["failed"] == {} and llada["baseline"]["mean_score"] == 0.41  # c ran now; the stored baseline stays
    assert sdar == stored["families"][1]
    assert stored["families"][0]["methods"][1]["mean"] == pytest.approx(0.45)  # the stored data is not modified
    with pytest.raises(ValueError, match="SFT baseline's mean_score differs"):
        merge_data(stored, comparison_data(_fam("llada", 0.45, {"b": [_run(0.6, 0)]}), "sudoku"))


def test_dare_compare_merge_writes_the_merged_table_into_docs(tmp_path, capsys):
    """``--merge --docs DIR``: DIR's table and data gain the rows, its figure is not replaced."""
    from dare.cli import main as dare_main
    from dare.comparison.run import CompareOptions, write_report
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "comparison.json").write_text((ROOT / "docs" / "comparison.json").read_text())
    (docs / "comparison.png").write_bytes(b"stored figure")
    stored = load_data(docs / "comparison.json")
    base = stored["families"][0]["baseline"]["mean_score"]
    new = comparison_data(_fam(stored["families"][0]["family"], base, {"zz_new": [_run(0.6, 0), _run(0.61, 1)]}),
                          "sudoku")
    png = tmp_path / "new.png"
    png.write_bytes(b"new figure")
    write_report(tmp_path / "out", new, str(docs), echo=lambda *a, **k: None, png=png, merge=True)
    merged = load_data(docs / "comparison.json")
    assert "zz_new" in {e["algorithm"] for e in merged["families"][0]["methods"]}
    assert len(merged["families"][0]["methods"]) == len(stored["families"][0]["methods"]) + 1
    assert (docs / "comparison_table.md").read_text() == render_table(merged)
    assert (docs / "comparison.png").read_bytes() == b"stored figure"
    assert load_data(tmp_path / "out" / "comparison.json") == new  # the run folder's own report: its runs only
    assert dare_main(["compare", "--merge", "--output-dir", str(tmp_path)]) == 2
    assert "--merge needs --docs" in capsys.readouterr().err
    assert CompareOptions().merge is False


def _entry(algo, change, spread, seeds=3):
    return {"algorithm": algo, "seeds": seeds, "mean": 0.4 + change, "spread": spread, "change": change}


def test_the_summary_counts_the_verdicts_of_the_table():
    """The README's and docs/comparison.md's paragraph is computed from the data by the table's own bar: a method
    that joins changes its counts, with nothing written by hand."""
    fam = {"family": "llada", "checkpoint": "ck", "anchor": "a", "baseline": {"mean_score": 0.4, "accuracy": 0.0},
           "failed": {"z": "out of memory"},
           "methods": [_entry("a", 0.180, 0.010), _entry("b", 0.100, 0.010), _entry("c", 0.080, 0.005),  # c: < 0.09
                       _entry("d", 0.120, 0.070), _entry("e", -0.150, 0.003)]}                       # d: spread
    text = " ".join(render_summary({"benchmark": "sudoku", "families": [fam]}, {"c", "b"}).split())
    assert text.startswith("On the tiny llada checkpoint (`ck`, SFT 40.0 %, 3 seeds each) 2 of the 5 methods pass "
                           "the bar, +10.0 to +18.0 points; below it `c` (+8.0 ± 0.5), `d` (+12.0 ± 7.0), "
                           "`e` (-15.0 ± 0.3); failed: `z`.")
    assert text.endswith("`b` and `c` run at a documented factor on their paper's relative lr (each oscillated, "
                         "collapsed or left the reference in one step at the paper's ratio).")
    fam["methods"], fam["failed"] = [_entry("a", 0.08, 0.01), _entry("b", 0.05, 0.01)], {}
    assert "all 2 methods pass the bar, +5.0 to +8.0 points." in " ".join(render_summary(
        {"benchmark": "sudoku", "families": [fam]}).split())

