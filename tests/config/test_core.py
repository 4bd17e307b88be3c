from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from dare.config import ConfigError, apply_overrides, from_dict, load_config, parse_override


@dataclass
class Optim:
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    schedule: Literal["constant", "cosine"] = "constant"


@dataclass
class Recipe:
    name: str = "run"
    steps: int = 10
    grad_clip: Optional[float] = 1.0
    optim: Optim = field(default_factory=Optim)


def test_unknown_key_names_full_path_and_suggests_closest():
    with pytest.raises(ConfigError) as e:
        from_dict(Recipe, {"optim": {"lrr": 1e-4}})
    assert "optim.lrr" in str(e.value) and "Did you mean 'lr'" in str(e.value)


def test_unknown_top_level_key_from_override(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("steps: 3\n")
    with pytest.raises(ConfigError, match="'stpes'.*Did you mean 'steps'"):
        load_config(Recipe, f, ["stpes=4"])


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError) as e:
        from_dict(Recipe, {"steps": "ten"})
    assert "steps" in str(e.value) and "expected int" in str(e.value)
    with pytest.raises(ConfigError, match="optim.schedule"):
        from_dict(Recipe, {"optim": {"schedule": "cosin"}})
    with pytest.raises(ConfigError, match="optim.betas\\[1\\]"):
        from_dict(Recipe, {"optim": {"betas": [0.9, "x"]}})


def test_overrides_parse_yaml_values_and_scientific_floats(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("optim:\n  lr: 3e-6\n")
    cfg = load_config(Recipe, f, ["steps=7", "optim.schedule=cosine", "grad_clip=null", "optim.betas=[0.8,0.9]"])
    assert cfg.steps == 7 and cfg.optim.lr == 3e-6 and cfg.grad_clip is None
    assert cfg.optim.schedule == "cosine" and cfg.optim.betas == [0.8, 0.9]
    assert parse_override("optim.lr=1e-5") == (["optim", "lr"], 1e-5)


def test_int_accepted_for_float_but_not_bool_for_int():
    assert from_dict(Optim, {"lr": 1}).lr == 1.0
    with pytest.raises(ConfigError):
        from_dict(Recipe, {"steps": True})


def test_override_must_have_equals():
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["steps"])


def test_a_key_given_twice_in_a_recipe_names_the_key_and_both_lines(tmp_path):
    # YAML keeps the last of two equal keys without a word: here the first optim section (lr 3e-3) would vanish.
    recipe = tmp_path / "twice.yaml"
    recipe.write_text("optim:\n  lr: 3e-3\nsteps: 2\noptim:\n  schedule: cosine\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml: key 'optim' appears twice \(lines 1 and 4\)"):
        load_config(Recipe, recipe)
    nested = tmp_path / "nested.yaml"
    nested.write_text("optim:\n  lr: 3e-3\n  lr: 1e-5\n")
    with pytest.raises(ConfigError, match=r"key 'optim.lr' appears twice \(lines 2 and 3\)"):
        load_config(Recipe, nested)
    from dare.config import load_yaml
    assert load_yaml(_write(tmp_path / "ok.yaml", "a:\n  x: 1\nb:\n  x: 2\n")) == {"a": {"x": 1}, "b": {"x": 2}}


def _alias_bomb(levels: int) -> str:
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_before_it_is_walked(tmp_path):
    # 10^8 values from 80 aliases: walking them took 85 s before the duplicate-key check counted shared nodes once
    with pytest.raises(ConfigError, match=r"bomb\.yaml: its aliases expand to more than 1,000,000 values"):
        load_config(Recipe, _write(tmp_path / "bomb.yaml", _alias_bomb(8)))
    with pytest.raises(ConfigError, match=r"override optim.lr: its aliases expand to more than 1,000,000 values"):
        parse_override("optim.lr=" + "[" + ", ".join("&a%d [%s]" % (i, ", ".join([f"*a{i - 1}" if i else "1"] * 10))
                                                      for i in range(8)) + "]")
    from dare.config import load_yaml  # aliases themselves are fine: a shared section loads as its copy
    assert load_yaml(_write(tmp_path / "ok.yaml", "a: &s {x: 1}\nb: *s\n")) == {"a": {"x": 1}, "b": {"x": 1}}


def _write(path, text):
    path.write_text(text)
    return path
