"""Two-process equivalence cases, launched once for the whole test session (CONTRIBUTING.md, "Test tiers").

A case is a tiny training run that two processes (FSDP2 over gloo, optionally Ulysses sequence parallelism) must
reproduce as one process does. Test modules register their cases at import (``register``) and read the results
through the session fixture ``two_process_runs`` (tests/conftest.py): every case the session's selected tests ask
for is trained once alone (one process) and once under ``torchrun --nproc_per_node=2``, each side in ONE interpreter
that runs the cases one after another (tests/trainer/two_process_runner.py) -- the process start-up, imports and
gloo set-up (most of a tiny run's time) are paid once per side instead of once per case. The ``dare train``
command's own relaunch under torchrun keeps its test (tests/trainer/test_multiprocess.py).

Both sides run the cases in the same order in a fresh interpreter, and every case builds its own Trainer (model,
optimizer, data, seeds from the recipe), so a case sees what it would see alone; a test also checks one case against
a fresh ``dare train`` command.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "trainer" / "two_process_runner.py"
COMMON = ("logging.progress=false", "logging.tensorboard=false", "train.export=false")
# The trajectory methods' runs (TraceRL, DiRL, CJ-GRPO, JustGRPO, d-TreeRPO, MDPO): a reward a random tiny model
# scores above zero, a small Sudoku set, a one-layer model.
TRAJECTORY = ("logging.plot=false", "train.save_every=0", "reward.name=traj_sevens", "reward.workers=0",
              "data.dataset={name: sudoku, template: compact, limit: 16, shuffle_seed: 0}",
              "model.tiny_sizes={hidden_size: 32, num_layers: 1}")


@dataclass(frozen=True)
class Case:
    recipe: str  # relative to the repository root
    overrides: tuple[str, ...]  # both sides
    two: tuple[str, ...] = ("distributed.nproc=2",)  # the two-process side only
    grads: bool = False  # rank 0 keeps every optimizer step's whole gradient (fp64) for the test to compare


@dataclass
class Result:
    metrics: list[dict]  # metrics.jsonl rows
    counts: dict[str, dict]  # per rank: {"sharded": sharded scoring calls, "decoded": prompts decoded}
    grads: list = field(default_factory=list)  # per optimizer step: {parameter: gradient} (Case.grads)


CASES: dict[str, Case] = {}


def register(cases: dict[str, Case]) -> list[str]:
    """Add a test module's cases (names are global); returns their names, for ``parametrize``."""
    for name, case in cases.items():
        if name in CASES and CASES[name] != case:
            raise ValueError(f"two-process case {name!r} is registered twice with different settings")
        CASES[name] = case
    return list(cases)


def trajectory_case(algo: str, *overrides: str) -> Case:
    """``recipes/rl/<algo>.yaml`` on the trajectory methods' toy reward and data."""
    from tests.tiny_rl import tiny_random
    return Case(f"recipes/rl/{algo}.yaml", (*tiny_random(f"recipes/rl/{algo}.yaml"), *TRAJECTORY, *overrides))


def recipe_overrides(case: Case, two: bool, out: Path) -> list[str]:
    return [*COMMON, *case.overrides, *(case.two if two else ()), f"train.output_dir={out}"]


class Runs:
    """The session's runs: launched on the first request, for every selected test's case at once."""

    def __init__(self, wanted: list[str], root: Path):
        unknown = sorted(set(wanted) - set(CASES))
        if unknown:
            raise ValueError(f"tests ask for unregistered two-process cases: {unknown}")
        self.wanted, self.root = wanted, root
        self.errors: dict[str, str] = {}
        self.launched = False

    def _launch(self):
        self.launched = True
        spec = self.root / "cases.json"
        spec.write_text(json.dumps({name: {"recipe": CASES[name].recipe, "grads": CASES[name].grads,
                                           "one": recipe_overrides(CASES[name], False, self.root / "one" / name / "run"),
                                           "two": recipe_overrides(CASES[name], True, self.root / "two" / name / "run")}
                                    for name in self.wanted}))
        for side in ("one", "two"):
            err = _run(spec, side, timeout=300 + 120 * len(self.wanted))
            if err is not None:
                failed = self._first_failure(side)
                self.errors.update({name: f"the {side}-process run of {failed or 'the cases'} failed: {err}"
                                    for name in self.wanted if not (self.root / side / name / "done").exists()})

    def _first_failure(self, side: str) -> str | None:
        for name in self.wanted:
            if not (self.root / side / name / "done").exists():
                return name
        return None

    def __call__(self, name: str) -> tuple[Result, Result]:
        if name not in self.wanted:
            raise ValueError(f"{name!r} is not among this session's two-process cases (parametrize the test by it)")
        if not self.launched:
            self._launch()
        if name in self.errors:
            pytest.fail(self.errors[name][-4000:], pytrace=False)
        return self._read("one", name), self._read("two", name)

    def _read(self, side: str, name: str) -> Result:
        import torch
        folder = self.root / side / name
        metrics = [json.loads(l) for l in (folder / "run" / "metrics.jsonl").read_text().splitlines() if l.strip()]
        counts = {p.stem: json.loads(p.read_text()) for p in sorted((folder / "counts").glob("rank*.json"))}
        grads = torch.load(folder / "grads.pt") if CASES[name].grads else []
        return Result(metrics, counts, grads)


def wanted_cases(items) -> list[str]:
    """The cases the selected tests parametrize by ``case`` (in collection order, once each)."""
    out = []
    for item in items:
        if "two_process_runs" in getattr(item, "fixturenames", ()):
            name = getattr(item, "callspec", None) and item.callspec.params.get("case")
            if name is None:
                raise ValueError(f"{item.nodeid}: a test of two_process_runs must be parametrized by 'case'")
            if name not in out:
                out.append(name)
    return out


def same_history(one: list[dict], two: list[dict], keys, rel: float = 1e-5) -> None:
    """Step by step, ``keys`` (every one logged) of the two histories agree to ``rel`` (relative, floor 1)."""
    assert len(one) == len(two) > 0, (len(one), len(two))
    for a, b in zip(one, two):
        for key in keys:
            assert abs(a[key] - b[key]) <= rel * max(1.0, abs(a[key])), (key, a, b)


def _run(spec: Path, side: str, timeout: float) -> str | None:
    """Run the cases of ``spec`` on one side; None when it exits 0, else why not (the end of its output). On a
    timeout kill it with its torchrun workers."""
    from tests.trainer.helpers import kill_running, run_to_success
    launch = [sys.executable] if side == "one" else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    try:
        run_to_success([*launch, str(RUNNER), str(spec), side], env, timeout, merge_output=True,
                       on_timeout=lambda: kill_running(str(spec)))
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s (a hang: a collective one rank skipped?)"
    except AssertionError as e:  # a non-zero exit: the message is the end of its output
        return f"its output ends:\n{e}"
    return None
