"""The published plans (docs/plan_recipes.json, written by scripts/plan_recipes.py) are current and say what they
should, checked without planning: each plan stores what it depended on (the recipe's shape key, the functions that
ran, the files read, torch's version: dare/plan/provenance.py), and a plan whose recipe, code or config changed since
fails here with the command that refreshes it. A representative set is planned again in the integration tier."""
import functools
import json

import pytest

from dare.plan.gpus import GIB
from dare.plan.planner import PlanOptions, plan_recipe
from dare.plan.provenance import is_own
from dare.trainer.recipe import load_recipe
from tests.scripts import ROOT, load_script

PLAN_RECIPES = load_script("scripts/plan_recipes.py")
REFRESH = "python scripts/plan_recipes.py (--workers N: one per 16 GiB of RAM)"


@functools.lru_cache(maxsize=1)
def _cache() -> dict:
    return json.loads(PLAN_RECIPES.OUT_JSON.read_text())


@functools.lru_cache(maxsize=None)
def _recipe(rel: str):
    """A recipe as it is now (read once per process: the checks below read all 283)."""
    return load_recipe(ROOT / rel)


def _published(rel: str) -> dict:
    cache = _cache()
    key = PLAN_RECIPES.shape_key(_recipe(rel))
    assert key in cache["plans"], f"{rel} is not planned in docs/plan_recipes.json: run {REFRESH}"
    return cache["plans"][key]


def _peaks(plan) -> dict:
    phases = plan["phases"] if isinstance(plan, dict) else [p.__dict__ for p in plan.phases]
    return {p["name"]: p["peak_bytes"] for p in phases}


def test_every_published_plan_is_current():
    _check_current(_cache())


def test_a_plan_stored_without_its_record_fails_the_check():
    """The published cache narrowed to the representative's plan with its record dropped (the other plans' records
    are checked above; re-hashing them here would only repeat that)."""
    published = _cache()
    key = published["recipes"][REPRESENTATIVE[0]]
    plan = {k: v for k, v in published["plans"][key].items() if k != "depends"}
    sharing = [rel for rel, k in published["recipes"].items() if k == key]  # the message names one of them
    cache = {"recipes": {rel: key for rel in sharing}, "plans": {key: plan}, "provenance": published["provenance"]}
    with pytest.raises(AssertionError, match=r"^1 published plans carry no record") as failed:
        _check_current(cache)
    assert any(rel in str(failed.value) for rel in sharing)


def _check_current(cache: dict) -> None:
    stale = PLAN_RECIPES.stale_plans(cache)
    recipes: dict[str, list[str]] = {}
    for rel, key in cache["recipes"].items():
        recipes.setdefault(key, []).append(rel)
    # a plan stored without its record (what it depended on) could not be checked current: every one carries it
    unrecorded = sorted(recipes.get(k, [k])[0] for k, v in stale.items() if PLAN_RECIPES.NO_RECORD in v)
    assert not unrecorded, (f"{len(unrecorded)} published plans carry no record of what they depend on, so nothing "
                            f"can tell whether they are current: {unrecorded[:10]}; run {REFRESH}")
    ours = {k: v for k, v in stale.items() if any(is_own(c) for c in v)}
    lines = [f"  {recipes.get(k, ['(no recipe)'])[0]} (+{len(recipes.get(k, [])) - 1} sharing its step): "
             + "; ".join(list(v.values())[:3]) + (f" (+{len(v) - 3} more)" if len(v) > 3 else "")
             for k, v in sorted(ours.items(), key=lambda kv: recipes.get(kv[0], [""])[0])]
    assert not ours, (f"{len(ours)} of {len(cache['plans'])} published plans are stale: code, a config or a recipe "
                      f"they were planned with changed. Refresh them (only the stale ones are planned again): "
                      f"{REFRESH}\n" + "\n".join(lines[:20]))
    if stale:  # only other packages moved (a torch other than the one the plans were made with, transformers' code)
        first = next(iter(stale.values()))
        pytest.skip(f"{len(stale)} published plans were made under other packages' code "
                    f"({next(iter(first.values()))}); their currency is checked under the packages they were planned "
                    "with")


def test_every_planned_full_size_recipe_fits_and_the_docs_count_the_rest():
    """Every full-size recipe planned at its current settings fits 8 x 80 GB (one that stops fitting fails here),
    the table docs/plan_recipes.md has one row per planned recipe, and docs/paper_recipes.md counts the paper recipes
    not planned yet (a recipe edited without re-planning has another shape key and counts as unplanned)."""
    cache = _cache()
    planned, unplanned_paper, failing = [], [], []
    for rel in PLAN_RECIPES.full_size_recipes():
        plan = cache["plans"].get(PLAN_RECIPES.shape_key(_recipe(rel)))
        if plan is None:
            unplanned_paper += [rel] if rel.startswith("recipes/paper/") else []
            continue
        planned.append(rel)
        if plan["error"] or not plan["fits"]:
            failing.append((rel, plan["error"] or f"{plan['peak_bytes'] / GIB:.1f} GiB"))
    assert not failing, f"do not fit 8 x 80 GB or could not be planned: {failing}"
    table = PLAN_RECIPES.OUT_MD.read_text()
    assert sorted(line.split("`")[1] for line in table.splitlines() if line.startswith("| `recipes/")) == sorted(planned)
    doc = PLAN_RECIPES.PAPER_MD.read_text()
    if unplanned_paper:
        assert f"Not planned yet ({len(unplanned_paper)})" in doc
    else:
        assert "Not planned yet" not in doc


def test_each_recipe_row_carries_its_own_run_length():
    """Recipes that share a planned step (a paper cell's math and code recipes: 467 and 750 steps) each report the
    hours of their own run: the step's time times the recipe's train.steps, in the table and in the recipe's header."""
    cache = _cache()
    rows = {line.split("`")[1]: line.split(" | ") for line in PLAN_RECIPES.OUT_MD.read_text().splitlines()
            if line.startswith("| `recipes/")}
    shared = 0
    for rel, key in cache["recipes"].items():
        plan = cache["plans"].get(key)
        if plan is None or plan["error"]:
            continue
        steps = _recipe(rel).train.steps
        shared += steps != plan["steps"]
        hours = plan["seconds_per_step"] * steps / 3600
        assert rows[rel][7] == f"{hours:.1f}", (rel, rows[rel][7], hours)
        if rel.startswith("recipes/paper/"):
            assert f"~{hours:.0f} h for {steps} steps" in (ROOT / rel).read_text(), rel
    assert shared > 0  # the case this is about: a recipe whose step was planned from another recipe


def test_full_size_sft_plan_llada_8b():
    """LLaDA-8B SFT over 8 GPUs from the shipped config.json: the shards are exactly 1/8 of the model (the published
    plan, current by the test above)."""
    r = load_recipe(ROOT / "recipes/sft_llada_8b.yaml")
    plan = _published("recipes/sft_llada_8b.yaml")
    assert plan["error"] is None and plan["parameters"] == 8_015_581_184 and plan["world"] == 8
    update = plan["phases"][-1]["breakdown"]
    shard = plan["parameters"] * 4 / 8  # fp32 master weights
    assert abs(update["parameters"] - shard) < 0.01 * shard
    assert abs(update["optimizer states"] - 2 * shard) < 0.01 * 2 * shard
    # 6 N T per token trained, plus the recomputed forward of checkpointing: between 6 and 8 N T
    tokens = r.train.batch_size // 8 * r.data.max_length
    assert 5.5 * plan["parameters"] * tokens < plan["flops_per_step"] < 8.5 * plan["parameters"] * tokens
    assert plan["fits"] and plan["peak_bytes"] < plan["budget"]


# Planned again at full size and compared with the published plan: what the fingerprints cannot see (torch's kernels
# and meta functions, other packages) would show here. One RL recipe (its rollout, score and update phases run every
# kind of kernel a plan counts), the cheapest at full size (81 s on 2 busy cores; DiffusionGemma's 26B plans take 3-7
# minutes each and are checked by their records alone).
REPRESENTATIVE = ["recipes/paper/dream_7b_instruct/d1_math.yaml"]


@pytest.mark.integration
@pytest.mark.parametrize("rel", REPRESENTATIVE)
def test_representative_recipe_planned_again_equals_its_published_plan(rel):
    published = _published(rel)
    plan = plan_recipe(load_recipe(ROOT / rel), PlanOptions(), rel)
    assert plan.error is None and plan.fits, (rel, plan.peak_bytes / GIB, plan.error)
    assert set(_peaks(published)) == set(_peaks(plan))
    # Within 1 MiB per phase: a per-row counter added to the rollout moves a peak by bytes, not the published GiB.
    for name, peak in _peaks(plan).items():
        assert abs(_peaks(published)[name] - peak) <= 2**20, (f"the plan changed: run {REFRESH}", name,
                                                               _peaks(published), _peaks(plan))
    assert abs(published["flops_per_step"] - plan.flops_per_step) <= 1e-9 * plan.flops_per_step
