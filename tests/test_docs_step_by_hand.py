"""docs/rl_step_by_hand.md runs as written: its Python blocks execute in order in one namespace."""
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "rl_step_by_hand.md"


def test_the_step_by_hand_runs_and_its_pure_loss_equals_the_hook(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) == 2
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    assert "loss " in out and namespace["current"].value.shape == namespace["batch"].completion_ids.shape
    assert len(namespace["batch"].views[0]) == 3  # the fully masked view and the complementary pair
