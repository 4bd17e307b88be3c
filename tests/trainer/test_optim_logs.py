import json
import math

import pytest

from dare.trainer.logs import MetricsLogger, read_metrics
from dare.trainer.optim import LRSchedule


def test_lr_schedules():
    const = LRSchedule("constant", warmup=4, total=20)
    assert [const(s) for s in (0, 2, 4, 19)] == [0.0, 0.5, 1.0, 1.0]
    cos = LRSchedule("cosine", warmup=0, total=10)
    assert cos(0) == 1.0 and cos(5) == pytest.approx(0.5) and cos(10) == pytest.approx(0.0)
    floor = LRSchedule("cosine_with_min_lr", warmup=2, total=12, min_ratio=0.1)
    assert floor(2) == 1.0 and floor(12) == pytest.approx(0.1) and floor(7) == pytest.approx(0.1 + 0.9 * 0.5)
    lin = LRSchedule("linear", warmup=0, total=4)
    assert [lin(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    with pytest.raises(ValueError, match="unknown lr schedule"):
        LRSchedule("exp", 0, 1)


def test_metrics_logger_jsonl_tensorboard_plot_and_truncation(tmp_path):
    lg = MetricsLogger(tmp_path, enabled=True, tensorboard=True)
    for step in range(1, 6):
        lg.log(step, {"loss": 1.0 / step, "reward_mean": step / 10, "eval/sudoku": 3.0, "step_time": 0.1})
    png = lg.plot()
    lg.close()
    assert png.exists() and png.stat().st_size > 2000
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and math.isclose(rows[1]["loss"], 0.5)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 0.1')  # a line cut by kill -9
    lg2 = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    lg2.truncate_after(3)
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert MetricsLogger(tmp_path / "off", enabled=False).plot() is None and not (tmp_path / "off").exists()
