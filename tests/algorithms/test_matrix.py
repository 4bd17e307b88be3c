"""The algorithm x family support matrix: generated from the registries, published in the README, and every
supported cell trains (2 optimisation steps of ``dare train`` on a tiny model).

Cells come from ``dare.algorithms.ALGORITHMS`` x ``dare.models.FAMILIES`` (attention kinds from the families' tiny
configs), never from a hand list. The default suite runs the first registered family of each attention kind; the
other families are in the integration tier.
"""
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dare.algorithms import ALGORITHMS, StepContext, build_algorithm, cost_knobs, load_builtin_algorithms
from dare.algorithms.matrix import (ATTENTION_KINDS, MARKERS, algorithm_infos, family_attention, marked_block,
                                    markdown_matrix, supported_cells, with_matrix)
from dare.cli import main as dare_main
from dare.trainer.recipe import load_recipe
from dare.models import FAMILIES, tiny, tiny_tokenizer
from dare.trainer.loop import Trainer
from tests.algorithms.helpers import rl_batch
from tests.algorithms.toy_task import one_thread, single_thread  # noqa: F401  (autouse fixture; registers the toy reward)
from tests.threads import TEST_THREADS
from tests.tiny_rl import tiny_random

ROOT = Path(__file__).resolve().parents[2]
load_builtin_algorithms()
# The package's own algorithms (other test modules register test doubles in the same global registry).
BUILTIN = {n: c for n, c in ALGORITHMS.items() if c.__module__.startswith("dare.algorithms.")}

# A cell run shrinks every cost field of its config (``dare.algorithms.cost``: inner iterations, MC samples, trained
# steps) to this: no list of field or algorithm names.
SHRUNK_COST = 2
TINY_BLOCK = 4  # the tiny SDAR block size; LLaDA2's tiny config keeps its published 32


def tiny_recipe(name: str) -> Path:
    """The CPU recipe of a registered algorithm: ``recipes/rl/<name>.yaml`` or ``recipes/<name>_tiny.yaml``."""
    for path in (ROOT / "recipes/rl" / f"{name}.yaml", ROOT / "recipes" / f"{name}_tiny.yaml"):
        if path.is_file():
            return path
    raise FileNotFoundError(f"algorithm {name!r} has no tiny recipe (recipes/rl/{name}.yaml or recipes/{name}_tiny.yaml)")


def _default_families() -> set[str]:
    attn = family_attention()
    return {next(f for f, k in attn.items() if k == kind) for kind in ATTENTION_KINDS if kind in attn.values()}


def _builtin_cells():
    return [(a, f) for a, f in supported_cells() if a in BUILTIN]


def _cells():
    fast = _default_families()
    return [pytest.param(a, f, id=f"{a}-{f}", marks=() if f in fast else pytest.mark.integration) for a, f in _builtin_cells()]


def _accepts_one_block(recipe, family: str) -> bool:
    """Whether the recipe's algorithm accepts an 8-token, one-block rollout (its own ``check_rollout``)."""
    sampler = dataclasses.replace(recipe.rollout.sampler, gen_length=8, block_length=8, steps=8, steps_per_block=None)
    adapter = tiny(family, tokenizer=tiny_tokenizer(), num_layers=1, hidden_size=32).adapter
    try:
        build_algorithm(recipe.algorithm).check_rollout(sampler, adapter)
    except ValueError:
        return False
    return True


def run_cell(tmp_path, name: str, family: str):
    """``dare train`` of the algorithm's tiny recipe on ``tiny:<family>`` for 2 steps; returns the metric history."""
    cls = ALGORITHMS[name]
    overrides = [*tiny_random(tiny_recipe(name), family), f"model.path=tiny:{family}",
                 "model.tiny_sizes={hidden_size: 32, num_layers: 1}", "train.steps=2",
                 "train.batch_size=2", "train.micro_batch_size=4", f"train.output_dir={tmp_path}", "train.resume=never",
                 "train.export=false", "train.save_every=0", "logging.progress=false", "logging.tensorboard=false",
                 "logging.plot=false"]
    overrides += [f"algorithm.{k}={SHRUNK_COST}" for k in cost_knobs(cls.config_class)]
    if cls.uses_rollout:
        # One 8-token block on masked models (MDPO and CJ-GRPO's ASS need single-block rollouts), the tiny block
        # size on block models (TraceRL / DiRL replay the model's blocks), the tiny canvas (4) on encoder-decoder ones.
        block = TINY_BLOCK if family_attention()[family] in ("block_causal", "encoder_decoder") else 8
        recipe = load_recipe(tiny_recipe(name))
        if block == 8 and not _accepts_one_block(recipe, family):
            block = 4  # two blocks for a method that refuses one (d-OPSD's teacher reveals future blocks)
        sampler = ["rollout.sampler.gen_length=8", f"rollout.sampler.block_length={block}"]
        if recipe.rollout.sampler.steps_per_block is None:
            sampler.append("rollout.sampler.steps=8")
        overrides += ["rollout.group_size=4", "reward.name=mc_test_sevens", "reward.workers=0",
                      "data.dataset.limit=8", *sampler]
    recipe = load_recipe(tiny_recipe(name), overrides)
    with single_thread():
        return Trainer(recipe).run()


# --- the matrix itself -------------------------------------------------------------------------------------------


def test_family_attention_comes_from_the_tiny_models():
    attn = family_attention()
    assert list(attn) == list(FAMILIES) and set(attn.values()) == set(ATTENTION_KINDS)
    for fam, kind in attn.items():
        assert tiny(fam, tokenizer=tiny_tokenizer(), num_layers=1, hidden_size=32).adapter.attention == kind


def test_every_algorithm_declares_its_attention_kinds_and_an_estimator_line():
    for name, cls in ALGORITHMS.items():
        supports = getattr(cls, "supports", None)
        assert supports and set(supports) <= set(ATTENTION_KINDS), name
        assert (cls.__dict__.get("__doc__") or "").strip(), f"{name}: the class docstring's first line is its summary"
    infos = {a.name: a for a in algorithm_infos()}
    assert set(infos) == set(ALGORITHMS)
    for a in infos.values():
        assert a.families == [f for f, k in family_attention().items() if k in a.supports] and a.mc_samples >= 1


UNSUPPORTED = [(name, kind) for name, cls in sorted(BUILTIN.items()) for kind in ATTENTION_KINDS
               if kind not in cls.supports]


@pytest.mark.parametrize("name,kind", UNSUPPORTED)
def test_unsupported_attention_kinds_get_a_clear_error(name, kind):
    family = next(f for f, k in family_attention().items() if k == kind)
    model = tiny(family, tokenizer=tiny_tokenizer(), num_layers=1, hidden_size=32)
    algo = build_algorithm(ALGORITHMS[name].config_class())
    with pytest.raises(ValueError, match=f"this model is '{kind}'"):  # the check the trainer runs at start-up
        algo.check_model(model.adapter)


def test_dare_algorithms_lists_every_registered_algorithm(capsys):
    assert dare_main(["algorithms"]) == 0
    out = capsys.readouterr().out
    for a in algorithm_infos():
        row = next(line for line in out.splitlines() if line.startswith(f"| `{a.name}` |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == a.kind and cells[3] == str(a.mc_samples) and cells[4] == a.summary
        assert cells[2] == ("all" if len(a.families) == len(FAMILIES) else ", ".join(a.families))


def test_matrix_marks_exactly_the_supported_cells(capsys):
    assert dare_main(["algorithms", "--matrix"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == markdown_matrix()
    fams = list(family_attention())
    cells = set(supported_cells())
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert len(rows) == len(ALGORITHMS)
    for row in rows:
        parts = [c.strip() for c in row.strip("|").split("|")]
        name = parts[0].strip("`")
        assert [p == "✓" for p in parts[2:]] == [(name, f) in cells for f in fams]
    assert f"{len(cells)} supported cells" in out


def test_readme_support_matrix_is_generated():
    """The README block is the output of ``dare algorithms --matrix`` (a fresh process: only the package's algorithms)."""
    out = subprocess.run([sys.executable, "-m", "dare.cli", "algorithms", "--matrix"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = marked_block(readme)
    assert readme[start:end].strip() == out, (
        "README.md's support matrix is stale: run `dare algorithms --matrix --write README.md`")
    rows = {line.split("`")[1] for line in out.splitlines() if line.startswith("| `")}
    assert rows == set(BUILTIN)
    if set(ALGORITHMS) == set(BUILTIN):  # in-process, the same table (unless test doubles are registered)
        assert with_matrix(readme) == readme


def test_write_replaces_only_the_marked_block(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text(f"# title\n\nbefore\n{MARKERS[0]}\nold table\n{MARKERS[1]}\nafter\n", encoding="utf-8")
    assert dare_main(["algorithms", "--matrix", "--write", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("# title\n\nbefore\n") and text.endswith(f"{MARKERS[1]}\nafter\n") and "old table" not in text
    assert markdown_matrix() in text
    bad = tmp_path / "bad.md"
    bad.write_text("no markers\n", encoding="utf-8")
    assert dare_main(["algorithms", "--matrix", "--write", str(bad)]) == 2
    assert "support-matrix" in capsys.readouterr().err


# --- every supported cell trains --------------------------------------------------------------------------------


def test_every_algorithm_has_a_tiny_recipe():
    for name in BUILTIN:
        assert load_recipe(tiny_recipe(name)).algorithm.name == name


@pytest.mark.parametrize("name,family", _cells())
def test_supported_cell_trains_two_steps(tmp_path, name, family):
    hist = run_cell(tmp_path, name, family)
    assert len(hist) == 2, hist
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in hist), hist
    assert any(h["grad_norm"] > 0 for h in hist), hist  # a real update happened
    if ALGORITHMS[name].uses_rollout:
        assert all(h["nfe"] > 0 for h in hist)


def test_cells_cover_the_registry_with_one_default_family_per_attention_kind():
    params = _cells()
    assert {(p.values[0], p.values[1]) for p in params} == set(_builtin_cells())
    fast = {p.values[1] for p in params if not p.marks}
    assert {family_attention()[f] for f in fast} == set(ATTENTION_KINDS) and len(fast) == len(ATTENTION_KINDS)
    assert len(params) == sum(len(a.families) for a in algorithm_infos() if a.name in BUILTIN)
    assert torch.get_num_threads() == TEST_THREADS  # the autouse fixture keeps tiny models single-threaded
