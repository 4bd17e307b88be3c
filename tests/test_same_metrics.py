"""scripts/same_metrics.py: a refactor's check that two runs log the same numbers (timings aside)."""
import json

from tests.scripts import load_script

SM = load_script("scripts/same_metrics.py")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_equal_runs_pass_and_timings_are_ignored(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [{"step": 1, "loss": 0.5, "step_time": 1.0}, {"step": 2, "loss": 0.25}])
    b = _write(tmp_path / "b.jsonl", [{"step": 1, "loss": 0.5, "step_time": 9.0}, {"step": 2, "loss": 0.25}])
    assert SM.main([str(a), str(b)]) == 0
    assert "same numbers: 2 steps" in capsys.readouterr().out


def test_one_rounding_step_of_difference_fails_and_is_named(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [{"step": 1, "loss": 0.1, "kl": 1e-5}])
    b = _write(tmp_path / "b.jsonl", [{"step": 1, "loss": 0.1 + 2 ** -56, "kl": 1e-5}])
    assert SM.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "loss: differs on 1 of 1 steps" in out and "kl" not in out


def test_missing_steps_or_fields_fail(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.1}])
    b = _write(tmp_path / "b.jsonl", [{"step": 1, "loss": 0.1}])
    c = _write(tmp_path / "c.jsonl", [{"step": 1}, {"step": 2, "loss": 0.1}])
    assert SM.main([str(a), str(b)]) == 1
    assert SM.differences(SM.read(a), SM.read(c)) == ["step line 0: fields only before ['loss'], only after []"]
