"""Each RL method's paper settings (``Algorithm.paper``) and how ``dare compare`` turns them into recipe overrides."""
import pytest

from dare.algorithms import ALGORITHMS, get_algorithm, load_builtin_algorithms
from dare.algorithms.paper import PaperSettings, paper_overrides


def _rl():
    load_builtin_algorithms()
    return {n: c for n, c in sorted(ALGORITHMS.items()) if getattr(c, "uses_rollout", False)
            and c.__module__.startswith("dare.algorithms")}


@pytest.mark.parametrize("name", list(_rl()))
def test_every_rl_method_names_the_source_of_its_paper_settings(name):
    p = get_algorithm(name).paper
    assert isinstance(p, PaperSettings), f"{name} declares no paper settings"
    assert 0 < p.lr < 1e-3 and p.temperature > 0 and (p.grad_clip is None or p.grad_clip > 0)
    assert len(p.source) > 20
    assert isinstance(p.published_code, bool)
    fields = get_algorithm(name).config_class.__dataclass_fields__
    for task, values in p.per_task.items():
        assert set(values) <= {"lr", "grad_clip", "temperature", "algorithm"}, (name, task)
        assert set(values.get("algorithm", {})) <= set(fields), (name, task)
    for kind, values in p.per_attention.items():
        assert kind in get_algorithm(name).supports and set(values) == {"algorithm"}, (name, kind)
        assert set(values["algorithm"]) <= set(fields), (name, kind)
    from dare.rollout import SamplerConfig
    assert set(p.sampler) <= set(SamplerConfig.__dataclass_fields__), name


def test_overrides_scale_lr_relative_to_the_anchor_and_apply_task_values():
    d1, coupled = get_algorithm("d1"), get_algorithm("coupled_grpo")
    ov = paper_overrides(d1, coupled, 1e-4, "sudoku")
    # d1's authors train at 3e-6, DiffuCoder's at 1e-6: d1 gets 3x the anchor's rate; its Sudoku script's mu and
    # temperature replace the general ones.
    assert "optim.lr=0.0003" in ov and "optim.grad_clip=0.2" in ov
    assert "rollout.sampler.temperature=0.3" in ov and "algorithm.inner_iterations=8" in ov
    general = paper_overrides(d1, coupled, 1e-4, "math")
    assert "rollout.sampler.temperature=0.9" in general and not any("inner_iterations" in o for o in general)
    assert "optim.lr=0.0001" in paper_overrides(coupled, coupled, 1e-4, "sudoku")
    # ESPO's Sudoku script uses its own lr (3e-6, not its general 1e-6) and beta 1e-2
    espo = paper_overrides(get_algorithm("espo"), coupled, 1e-4, "sudoku")
    assert "optim.lr=0.0003" in espo and "algorithm.beta=0.01" in espo
    # the authors' LoRA adapters (r 128, alpha 64) for the methods trained with LoRA; the reference stays a copy
    assert {"lora.enabled=true", "lora.r=128", "lora.alpha=64", "reference.mode=copy"} <= set(ov)
    assert not any(o.startswith("lora.") for o in paper_overrides(coupled, coupled, 1e-4, "sudoku"))


def _comparison_lrs() -> dict[str, set[float]]:
    """Method -> the lr of its rows in the comparison's stored report (docs/comparison.json)."""
    import json
    from pathlib import Path
    data = json.loads((Path(__file__).resolve().parents[2] / "docs" / "comparison.json").read_text())
    out: dict[str, set[float]] = {}
    for fam in data["families"]:
        for entry in fam["methods"]:
            out.setdefault(entry["algorithm"], set()).add(entry["settings"]["lr"])
    return out


def test_documented_comparison_factors_scale_the_relative_lr():
    """The comparison's documented factors on the relative lr (each departing method's ``departure``, read by
    dare.comparison.departures): the rate is the product, formatted so a run made with `--set <method>:optim.lr=<that rate>` is the same
    run -- the rate of the method's rows in the stored comparison."""
    from dare.comparison.departures import lr_departures, lr_factor
    coupled = get_algorithm("coupled_grpo")
    lrs = _comparison_lrs()
    departures = lr_departures()
    assert departures
    for name, dep in departures.items():
        cls = get_algorithm(name)
        ov = paper_overrides(cls, coupled, 1e-4, "sudoku", lr_factor=lr_factor(name))
        rate = 1e-4 * cls.paper.for_task("sudoku")["lr"] / coupled.paper.for_task("sudoku")["lr"] * dep.factor
        assert f"optim.lr={rate:.6g}" in ov, name
        for want in lrs[name]:
            assert f"optim.lr={want:.6g}" in ov, name
    assert lr_factor("coupled_grpo") == 1.0 and "coupled_grpo" not in departures
    # a manifest entry is the class's own: EGSPO-SA (a subclass of EGSPO) keeps its paper ratio
    assert lr_factor("egspo") == 0.5 and lr_factor("egspo_sa") == 1.0


def test_every_documented_departure_states_its_reason_and_where_it_was_measured():
    from pathlib import Path

    from dare.comparison.departures import lr_departures
    from dare.quickstart.assets import shipped_checkpoints
    root = Path(__file__).resolve().parents[2]
    for name, dep in lr_departures().items():
        assert name in _rl(), f"{name}: a departure of no registered RL method"
        assert 0 < dep.factor and dep.factor != 1.0, name
        assert len(dep.note) > 40, "a departure on the embedded task needs its reason"
        assert dep.checkpoints and set(dep.checkpoints) <= set(shipped_checkpoints()), name
        assert (root / dep.doc).is_file(), (name, dep.doc)


def test_decoding_and_per_attention_values():
    """CJ-GRPO decodes with its paper's EOSER + ASS; TraceRL shrinks trajectories by 8 on full attention (rl_llada.yaml)
    and not on block models (rl_sdar.yaml)."""
    coupled = get_algorithm("coupled_grpo")
    cj = paper_overrides(get_algorithm("cj_grpo"), coupled, 1e-4, "sudoku", "bidirectional")
    assert "rollout.sampler.schedule=ass" in cj and "rollout.sampler.eoser=true" in cj
    assert "algorithm.shrink=8" in paper_overrides(get_algorithm("tracerl"), coupled, 1e-4, "sudoku", "bidirectional")
    assert "algorithm.shrink=1" in paper_overrides(get_algorithm("tracerl"), coupled, 1e-4, "sudoku", "block_causal")


def test_a_method_without_paper_settings_is_an_error():
    with pytest.raises(ValueError, match="declares no paper settings"):
        paper_overrides(get_algorithm("sft"), get_algorithm("d1"), 1e-4, None)


@pytest.mark.parametrize("name", list(_rl()))
def test_the_method_doc_states_its_paper_settings(name):
    """docs/algorithms/<name>.md carries the registry's paper settings verbatim, so the two cannot drift apart
    (``python scripts/generate.py`` writes them; tests/test_generate.py checks every generated file)."""
    from pathlib import Path

    from dare.algorithms.paper import paper_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "algorithms" / f"{name}.md"
    assert paper_markdown(get_algorithm(name)) in doc.read_text()


@pytest.mark.parametrize("name", list(_rl()))
def test_paper_overrides_give_a_valid_recipe_on_the_compare_task(name):
    """Every method's paper overrides load into the compare recipe and its sampler builds (CJ-GRPO's ASS fixes its own
    step count, so the recipe's 20 steps must not reach it: that failed the first compare run)."""
    from pathlib import Path
    from dare.trainer.recipe import load_recipe
    from dare.rollout.masked import masked_blocks
    root = Path(__file__).resolve().parents[2]
    ov = paper_overrides(get_algorithm(name), get_algorithm("coupled_grpo"), 1e-4, "sudoku", "bidirectional")
    recipe = load_recipe(root / "recipes/quickstart/compare.yaml", [f"algorithm.name={name}", *ov])
    assert sum(b.steps for b in masked_blocks(recipe.rollout.sampler)) >= 1
    if "bidirectional" in get_algorithm(name).supports:  # the start-up check of the run (d-TreeRPO: no recording)
        from dare.algorithms import build_algorithm
        from dare.models import tiny
        build_algorithm(recipe.algorithm).check_rollout(recipe.rollout.sampler, tiny("llada").adapter)
