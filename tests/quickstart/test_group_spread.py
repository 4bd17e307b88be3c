"""scripts/group_spread.py: the group statistics behind d1's temperature note (docs/algorithms/d1.md)."""
import json

import pytest

from tests.scripts import load_script


def load():
    return load_script("scripts/group_spread.py")


def test_spread_of_hand_made_groups(tmp_path):
    rows = [("a", "x", 0.5), ("a", "x", 0.5), ("a", "x", 0.5),  # one completion three times: no signal
            ("b", "p", 0.0), ("b", "q", 1.0), ("b", "r", 0.5)]
    f = tmp_path / "s.jsonl"
    f.write_text("\n".join(json.dumps({"id": i, "completion": c, "score": s}) for i, c, s in rows))
    s = load().spread(f)
    assert s["groups"] == 2 and s["zero_variance_groups"] == 0.5
    assert s["distinct"] == pytest.approx(2.0)  # 1 and 3
    assert s["mean"] == pytest.approx(0.5)
    assert s["within_group_std"] == pytest.approx((0 + (1 / 6) ** 0.5) / 2)  # population std of (0, 1, 0.5)
    assert s["best_minus_mean"] == pytest.approx((0 + 0.5) / 2)
