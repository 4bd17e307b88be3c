"""The README's tour runs line by line, as written, in a fresh folder (issue 40: its second training line once stopped
on the first one's run folder, under 30 lines of launcher traceback).

Every line of the tour's ``bash`` block runs in order in one working folder that holds this checkout's recipes,
assets and scripts (so each line writes its run folder where a new user's would), except the lines that need what CI
does not have -- a hub download, a GPU, 8 GPUs -- or a placeholder the user fills in; each such line is skipped for a
reason this test names, so a new line of the tour runs here unless it is one of those. Lines that train or evaluate
run with a smaller budget appended (``train.steps``, ``--limit``): the run folders, launches and output are the
tour's own.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (pattern in the line, why CI cannot run it as written)
NOT_HERE = [
    (r"GSAI-ML/|Dream-org/|JetLM/|inclusionAI/", "downloads a full-size model from the hub"),
    (r"distributed\.nproc=8", "needs 8 GPUs"),
    (r"--model PATH\b", "a placeholder for the user's own checkpoint"),
    (r"recipes/eval/sdar_8b_chat\.yaml", "a full-size model on a GPU"),
    (r"^dare plan recipes/paper/", "plans an 8B step (minutes of CPU); the published plans are checked by "
                                   "tests/plan/test_published_plans.py"),
]
# what a line gets appended so that it finishes in seconds (its folders and launch unchanged)
SMALLER = [
    (r"^dare train ", ["train.steps=2", "train.save_every=0"]),
    (r"^dare train recipes/(quickstart|rl)/", ["train.batch_size=2"]),  # RL: 2 prompts a step
    (r"^dare eval --model ", ["--limit", "4"]),
    (r"^dare eval recipes/", ["--limit", "1"]),
]


def tour_lines() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## A short tour"):]
    block = section[section.index("```bash") + len("```bash"):]
    block = block[:block.index("```")]
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and
             not line.strip().startswith("#")]
    other = [line for line in lines if not line.startswith("dare ")]
    assert not other, f"tour lines this test does not know how to run (teach it): {other}"
    return lines


def why_skipped(line: str):
    return next((why for pattern, why in NOT_HERE if re.search(pattern, line)), None)


def _workspace(tmp: Path) -> Path:
    for name in ("recipes", "src", "tests", "scripts"):
        (tmp / name).symlink_to(ROOT / name, target_is_directory=True)
    return tmp


def test_the_tour_is_parsed_and_every_skip_is_named():
    lines = tour_lines()
    assert len(lines) >= 10 and lines[0] == "dare models"
    assert sum(why_skipped(line) is None for line in lines) >= 6  # most of the tour runs on a CPU
    first, second = runnable_halves()
    assert any(line.startswith("dare train recipes/sft_tiny.yaml model.path=") for line in first)  # the clash case
    assert any(line.startswith("dare train recipes/quickstart/rl.yaml") for line in first)  # an RL line that learns


def runnable_halves() -> list[list[str]]:
    """The lines that run here, in tour order, cut in two halves that each fit a test's time (60 s: CONTRIBUTING's
    integration tier). The halves run in separate fresh folders; the first holds the training lines that share
    a recipe (the clash the test was written for) and the RL line that learns."""
    lines = [line for line in tour_lines() if not why_skipped(line)]
    cut = next(i for i, line in enumerate(lines) if line.startswith("dare train recipes/quickstart/compare.yaml"))
    return [lines[:cut], lines[cut:]]


@pytest.mark.integration
@pytest.mark.parametrize("half", [pytest.param(0, id="first-half", marks=pytest.mark.multiprocess),  # torchrun
                                  pytest.param(1, id="second-half")])
def test_the_tour_runs_line_by_line(tmp_path, half):
    work = _workspace(tmp_path)
    dare = Path(sys.executable).with_name("dare")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    ran = []
    for line in runnable_halves()[half]:
        args = shlex.split(line)
        for pattern, extra in SMALLER:
            if re.search(pattern, line):
                limit = args.index("--limit") if "--limit" in args else None
                if limit is not None and extra[0] == "--limit":
                    del args[limit:limit + 2]
                args += extra
        out = subprocess.run([str(dare), *args[1:]], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"`{line}` failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        assert "Traceback" not in out.stderr, f"`{line}` printed a traceback:\n{out.stderr[-3000:]}"
        ran.append(line)
    assert ran == runnable_halves()[half] and len(ran) >= 3, ran
