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


def test_a_line_that_is_not_utf8_is_left_out_with_its_number_not_a_codec_error(tmp_path, caplog):
    """A damaged metrics.jsonl (a binary line) stopped a resume with a bare UnicodeDecodeError (issue 41, finding 6)."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 0.5}\n\xff\xfe\x00binary\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    with caplog.at_level("WARNING"):
        assert read_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]  # the cut last line too
    assert "metrics.jsonl, line 2: not UTF-8 text" in caplog.text
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    logger.truncate_after(1)
    assert path.read_text() == '{"step": 1, "loss": 0.5}\n' and sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.jsonl"]


def test_files_a_reader_may_open_are_swapped_in_whole(tmp_path, monkeypatch, caplog):
    """metrics.jsonl's rewrite on resume and the curves PNG are written beside and renamed over the old file (issue 41,
    finding 2): a failed write leaves the old file and no .partial; a full disk while plotting is a warning."""
    import errno
    import os

    from matplotlib.figure import Figure

    from dare.files import write_file, write_text
    target = tmp_path / "results.md"
    write_text(target, "old")

    def failing(tmp):
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError):
        write_file(target, failing)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.md"]
    logger = MetricsLogger(tmp_path / "run", enabled=True, tensorboard=False)
    logger.log(1, {"loss": 1.0})
    png = logger.plot()
    before = png.read_bytes()
    assert before.startswith(b"\x89PNG")

    def full_disk(self, fname, *args, **kwargs):
        open(fname, "wb").write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", full_disk)
    logger.log(2, {"loss": 0.5})
    with caplog.at_level("WARNING"):
        assert logger.plot() is None
    assert "could not write" in caplog.text and "No space left on device" in caplog.text
    assert png.read_bytes() == before and not list(png.parent.glob(".*partial*"))
