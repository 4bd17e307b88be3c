"""One typed boundary between methods and the trainer (issue 39): a method's hooks ask the trainer for everything
through ``ctx.services`` (``dare.algorithms.Services``), which the trainer and the planner both fill."""
import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from dare.algorithms import Algorithm, Services
from dare.algorithms.registry import ALGORITHMS, load_builtin_algorithms

ALGORITHMS_DIR = Path(__file__).resolve().parents[2] / "src" / "dare" / "algorithms"
DECODERS = {"generate", "generate_tree"}


def _sources():
    return sorted(p for p in ALGORITHMS_DIR.rglob("*.py") if p.name != "__init__.py")


def _violations(path: Path, root: Path = ALGORITHMS_DIR) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root.parent.parent)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1] in ("rollout", "api", "tree") \
                and "rollout" in (node.module or "") and DECODERS & {a.name for a in node.names}:
            out.append(f"{where}: imports a decoder ({', '.join(sorted(DECODERS & {a.name for a in node.names}))}); "
                       "decode through ctx.services")
        if isinstance(node, ast.ImportFrom) and node.module and ("trainer" in node.module.split(".")):
            out.append(f"{where}: imports dare.trainer; ask ctx.services")
        if isinstance(node, ast.arg) and node.arg == "stage":
            out.append(f"{where}: takes the trainer's stage; ask ctx.services")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "stage":
            out.append(f"{where}: stage.{node.attr}; ask ctx.services")
    return out


def test_methods_use_nothing_of_the_trainer_but_ctx_services():
    found = [v for p in _sources() for v in _violations(p)]
    assert not found, "\n".join(found)


def test_the_check_sees_what_it_forbids(tmp_path):
    bad = tmp_path / "algorithms" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("from ..rollout import generate\nfrom ..trainer.rl import RolloutStage\n"
                   "def collect(self, stage, ctx):\n    return stage.collect(ctx)\n")
    found = _violations(bad, root=bad.parent)
    assert len(found) == 4, found


def test_every_collect_hook_takes_the_context_prompts_and_model():
    load_builtin_algorithms()
    for name, cls in sorted(ALGORITHMS.items()):
        params = list(inspect.signature(cls.collect).parameters)
        assert params == ["self", "ctx", "prompts", "model"], (name, params)
    assert list(inspect.signature(Algorithm.collect).parameters) == ["self", "ctx", "prompts", "model"]


def test_the_trainer_fills_every_service_of_an_rl_run(tmp_path):
    from dare.trainer.loop import Trainer
    from dare.trainer.recipe import load_recipe
    from tests.tiny_rl import tiny_random
    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes/rl/coupled_grpo.yaml", [
        *tiny_random("recipes/rl/coupled_grpo.yaml"),
        "model.tiny_sizes={hidden_size: 32, num_layers: 1}", "train.steps=1", f"train.output_dir={tmp_path}",
        "train.export=false", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"])
    tr = Trainer(recipe)
    try:
        services = tr.step_context(0).services
        unset = [f.name for f in dataclasses.fields(Services) if getattr(services, f.name) is None
                 and f.name not in ("rollout_micro_batch_size", "run_unit")]  # None in training: run here
        assert not unset, unset
        assert services.group_size == recipe.rollout.group_size and services.dataset is recipe.data.dataset
        assert services.all_reduce_sums({"a": 2.0}) == {"a": 2.0}  # one process
    finally:
        tr.close()


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Services)])
def test_every_service_is_documented(field):
    assert f"``{field}" in Services.__doc__, f"Services.{field} is not described in its docstring"


def test_cost_fields_are_marked_and_a_redeclared_default_keeps_its_mark():
    """The cost knobs are field metadata (``dare.algorithms.cost``), read by the tests, the paper grid and docs. The
    loop's own knob, ``inner_iterations`` (``Algorithm.inner_iterations``), is one in every config that has it: a
    subclass that changes its default without ``cost`` would drop the mark and its CPU runs would not shrink it."""
    from dare.algorithms import cost, cost_knobs
    load_builtin_algorithms()
    with_iterations = 0
    for name, cls in sorted(ALGORITHMS.items()):
        fields = {f.name for f in dataclasses.fields(cls.config_class)}
        if "inner_iterations" in fields:
            with_iterations += 1
            assert cost_knobs(cls.config_class).get("inner_iterations") == "iterations", name
    assert with_iterations >= 20
    assert cost_knobs(ALGORITHMS["bgpo"].config_class, "mc_samples") == {"num_mc": "mc_samples"}
    with pytest.raises(ValueError, match="cost kind must be one of"):
        cost(4, "forwards")


def test_a_batch_is_built_from_a_rollout_and_takes_rows_of_another():
    """``RLBatch.from_rollout`` maps a rollout's fields by name; ``take_row`` swaps in another try of the same prompt
    (IGPO's hinted round, d-OPSD's pass@k) with everything that belongs to the completion, and nothing else."""
    import torch

    from dare.algorithms import RLBatch
    from dare.rollout.result import Rollout

    def rollout(fill: int) -> Rollout:
        N, P, G = 2, 3, 4
        comp = torch.full((N, G), fill)
        return Rollout(sequences=torch.cat([torch.ones(N, P, dtype=torch.long), comp], 1),
                       attention_mask=torch.ones(N, P + G, dtype=torch.long), prompt_length=P, completion_ids=comp,
                       completion_mask=torch.ones(N, G, dtype=torch.long), step_map=torch.full((N, G), fill),
                       nfe=7, prompt_index=torch.zeros(N, dtype=torch.long), entropy_map=torch.full((N, G), float(fill)),
                       stop_token_ids=(2,), hint_mask=torch.full((N, G), fill > 6))
    first, second = rollout(5), rollout(9)
    batch = RLBatch.from_rollout(first, uid=torch.tensor([10, 11]), group=torch.tensor([1, 1]),
                                 rewards=torch.zeros(2), examples=[{"a": 0}, {"a": 1}], completions=["x", "y"])
    assert batch.completion_mask.dtype == torch.bool and batch.prompt_mask.dtype == torch.bool
    assert batch.nfe == 7 and batch.stop_token_ids == (2,) and torch.equal(batch.step_map, first.step_map)
    batch.take_row(1, second, 0, torch.tensor(1.0), {"a": 9}, "z")
    assert batch.completion_ids.tolist() == [[5] * 4, [9] * 4] and batch.step_map[1].tolist() == [9] * 4
    assert batch.entropy_map[1].tolist() == [9.0] * 4 and batch.rewards.tolist() == [0.0, 1.0]
    assert batch.examples == [{"a": 0}, {"a": 9}] and batch.completions == ["x", "z"]
    assert batch.uid.tolist() == [10, 11] and batch.group.tolist() == [1, 1]
    assert batch.hint_mask.tolist() == [[False] * 4, [True] * 4]  # the hints come with the row
    # every field both name is the rollout's (no hand-kept list): a new rollout record reaches the batch by its name
    theirs = {f.name for f in dataclasses.fields(Rollout)} | {"prompt_ids", "prompt_mask"}
    assert set(RLBatch.rollout_fields()) == theirs & {f.name for f in dataclasses.fields(RLBatch)}
    assert {"hint_mask", "entropy_map", "trajectory", "step_map"} <= set(RLBatch.rollout_fields())
    plain = dataclasses.replace(second, hint_mask=None)  # a rollout without hints: the row holds none
    batch.take_row(1, plain, 1, 0.0)
    assert batch.hint_mask[1].tolist() == [False] * 4
    with pytest.raises(ValueError, match="records entropy_map but the other rollout does not"):
        batch.take_row(1, dataclasses.replace(second, entropy_map=None), 0, 0.0)
    with pytest.raises(ValueError, match="completion positions"):
        batch.take_row(0, dataclasses.replace(second, completion_ids=torch.zeros(2, 5, dtype=torch.long)), 0, 0.0)


def _stage_writes(path: Path) -> list[str]:
    """Assignments in a method's source to a batch field the loop's stages own (``batch.state = ...``,
    ``RLBatch(..., state=...)``)."""
    owned = {"state", "frozen", "views", "old_logp", "ref_logp", "ref_views", "advantages"}
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in owned:
                out.append(f"{path.name}:{node.lineno}: assigns .{t.attr}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "RLBatch":
            out += [f"{path.name}:{node.lineno}: RLBatch({k.arg}=...)" for k in node.keywords if k.arg in owned]
    return out


def test_the_stage_fields_have_one_writer_the_loop():
    """``batch.state`` is ``prepare``'s, ``batch.frozen`` is ``score_frozen``'s, the views and scores the stages':
    every one is stored by ``dare.trainer.stages`` from what a hook returns, never set by a method itself (issue 39
    item 4: IGPO's hints ride the rollout's ``hint_mask``, d-TreeRPO's trees its ``collect``'s ``tree`` field)."""
    found = [w for p in _sources() if p.name != "batch.py" for w in _stage_writes(p)]
    assert not found, "\n".join(found)


def test_the_one_writer_check_sees_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def collect(batch):\n    batch.state = 1\n    return RLBatch(uid=0, frozen=2)\n")
    assert len(_stage_writes(bad)) == 2


# ---- no list outside a method's own module names it (CONTRIBUTING: "what a method touches") ------------------------
SOURCE_ROOT = ALGORITHMS_DIR.parent
# "sft" is also the SFT data kind (``Algorithm.data_kind``) and the name of a pipeline stage, not only a method.
DATA_KIND_NAMES = {"sft"}


def _docstrings(tree) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            out.add(id(node.body[0].value))
    return out


def _named_methods(path: Path, owners: dict[str, Path]) -> list[str]:
    """Each string constant of ``path`` (docstrings aside) that is a registered method's name, where ``path`` is not
    the module that defines the method's class."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    return [f"{path.name}:{node.lineno}: names the method {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            and node.value in owners and node.value not in DATA_KIND_NAMES and owners[node.value] != path]


def _owners() -> dict[str, Path]:
    load_builtin_algorithms()
    return {name: Path(inspect.getsourcefile(cls)).resolve() for name, cls in ALGORITHMS.items()}


def test_no_module_of_dare_names_a_method_outside_its_own():
    """Adding a method edits no list elsewhere: the loop, planner, comparison and generators reach every method
    through the registry, so no module but the method's own spells its name."""
    owners = _owners()
    assert len(owners) >= 24
    found = [v for p in sorted(SOURCE_ROOT.rglob("*.py")) for v in _named_methods(p.resolve(), owners)]
    assert not found, "a hand-kept list names a method:\n" + "\n".join(found)


def test_the_method_name_check_sees_a_list(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('ON_POLICY = ("d1", "coupled_grpo")\nKIND = "sft"\n\n\ndef f():\n    """d1 in prose."""\n')
    owners = _owners()
    assert _named_methods(probe.resolve(), owners) == ["probe.py:1: names the method 'd1'",
                                                       "probe.py:1: names the method 'coupled_grpo'"]
    # the module that defines a method's class may name it (VRPO in dpo.py, EGSPO-SA in egspo.py)
    assert _named_methods(SOURCE_ROOT / "algorithms" / "dpo.py", owners) == []
