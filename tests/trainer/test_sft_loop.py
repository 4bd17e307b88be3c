import json
from dataclasses import dataclass

import pytest
import torch

from dare.algorithms import register_algorithm
from dare.algorithms.sft import SFT, SFTConfig
from dare.config import ConfigError
from dare.data.schema import DataError
from dare.models import load_model
from dare.trainer.loop import Trainer, TrainingError
from tests.trainer.helpers import sft_recipe


def test_sft_loss_decreases_on_toy_data(tmp_path):
    recipe = sft_recipe(tmp_path, "train.steps=40", "train.batch_size=16", "model.tiny_sizes={hidden_size: 64, num_layers: 2}",
                        "optim.schedule=cosine_with_min_lr", "optim.warmup_steps=4", "optim.min_lr_ratio=0.1")
    losses = [m["loss"] for m in Trainer(recipe).run()]
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.75 * first, (first, last)


@pytest.mark.parametrize("family", ["llada", "llada_moe", "dream", "sdar", "sdar_moe", "llada2_moe"])
def test_every_family_trains_and_exports(tmp_path, family):
    recipe = sft_recipe(tmp_path, "train.export=true", "logging.plot=true", family=family)
    trainer = Trainer(recipe)
    hist = trainer.run()
    assert len(hist) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    reloaded = load_model(tmp_path / "export")
    ids = torch.randint(10, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, trainer.model(ids).logits, atol=1e-5)
    assert (tmp_path / "training_curves.png").stat().st_size > 1000
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_exact_resume_in_process(tmp_path):
    straight = Trainer(sft_recipe(tmp_path / "a", "train.steps=4")).run()
    interrupted = Trainer(sft_recipe(tmp_path / "b", "train.steps=4"))
    for s in range(2):
        interrupted.train_step(s)
    interrupted.save_checkpoint(2)
    resumed = Trainer(sft_recipe(tmp_path / "b", "train.steps=4"))
    assert resumed.start_step == 2
    hist = resumed.run()
    assert [h["loss"] for h in hist] == [h["loss"] for h in straight[2:]]


def test_half_written_checkpoint_is_ignored(tmp_path):
    t = Trainer(sft_recipe(tmp_path, "train.steps=2"))
    t.run()
    ck = tmp_path / "checkpoints"
    (ck / "step-5").mkdir()  # no COMPLETE marker: a kill during save
    (ck / ".tmp-step-6").mkdir()
    assert Trainer(sft_recipe(tmp_path, "train.steps=3")).start_step == 2
    with pytest.raises(ValueError, match="resume=never"):  # would mix two runs' checkpoints in one folder
        Trainer(sft_recipe(tmp_path, "train.steps=3", "train.resume=never"))


@dataclass
class NaNSFTConfig(SFTConfig):
    name: str = "test_nan_sft"


@register_algorithm
class NaNSFT(SFT):
    """SFT whose loss is NaN at the steps listed in ``bad`` (a test double for a diverging run)."""
    name = "test_nan_sft"
    config_class = NaNSFTConfig
    bad: set = set()

    def loss(self, ctx, batch, current, iteration):
        loss, m = super().loss(ctx, batch, current, iteration)
        return (loss * float("nan") if ctx.step in self.bad else loss), m


def test_nan_steps_are_skipped_then_abort(tmp_path, caplog):
    NaNSFT.bad = {1}
    t = Trainer(sft_recipe(tmp_path / "a", "algorithm.name=test_nan_sft", "train.steps=3"))
    before = [p.detach().clone() for p in t.model.parameters()]
    hist = t.run()
    assert hist[1].get("skipped") == 1.0 and "skipped" not in hist[0] and t.bad_steps == 1
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters()))
    NaNSFT.bad = {0, 1, 2}
    with caplog.at_level("WARNING", logger="dare"), \
            pytest.raises(TrainingError, match=r"max_bad_steps=1\).*; no checkpoint was written before it$"):
        Trainer(sft_recipe(tmp_path / "b", "algorithm.name=test_nan_sft", "train.steps=3", "train.max_bad_steps=1")).run()
    assert not (tmp_path / "b" / "checkpoints").exists()
    assert "step 1: non-finite loss (loss nan, grad norm" in caplog.text


def test_bad_rows_and_config_errors_name_the_culprit(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "only a prompt"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl, row 1 \(line 2\): missing field 'response'"):
        Trainer(sft_recipe(tmp_path, f"data.pairs={bad}"))
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "a", "response": "' + "x" * 100 + '"}\n')
    with pytest.raises(DataError, match="over data.max_length=48"):
        Trainer(sft_recipe(tmp_path, f"data.pairs={long}"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": "a", "response": "  "}\n')
    with pytest.raises(DataError, match="'response' is empty"):
        Trainer(sft_recipe(tmp_path, f"data.pairs={empty}"))
    with pytest.raises(ConfigError, match="algorithm.weightin"):
        sft_recipe(tmp_path, "algorithm.weightin=uniform")
    with pytest.raises(ConfigError, match="p_mask_prompt"):  # a d1 key is not an SFT key
        sft_recipe(tmp_path, "algorithm.p_mask_prompt=0.1")
    with pytest.raises(ConfigError, match="unknown algorithm 'sftt'"):
        sft_recipe(tmp_path, "algorithm.name=sftt")


def test_real_checkpoint_folder_trains_and_exports(tmp_path):
    from tests.conftest import FIXTURES
    recipe = sft_recipe(tmp_path, f"model.path={FIXTURES / 'sdar-tiny'}", "model.tokenizer=tiny", "model.mask_token_id=500",
                        "model.tiny_sizes={}", "train.export=true")
    trainer = Trainer(recipe)
    assert trainer.model.family == "sdar"
    trainer.run()
    reloaded = load_model(tmp_path / "export")
    ids = torch.randint(10, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, trainer.model(ids).logits, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_step(tmp_path):
    a = Trainer(sft_recipe(tmp_path / "a", "train.steps=2")).run()
    b = Trainer(sft_recipe(tmp_path / "b", "train.steps=2", "model.gradient_checkpointing=true")).run()
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6) and x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)


def test_periodic_evaluation_during_training(tmp_path):
    recipe = sft_recipe(tmp_path, "train.steps=2", "train.eval_every=2", "eval.benchmarks=[sudoku]", "eval.limit=2",
                        "eval.batch_size=2", "eval.template=compact", "reward.workers=0",
                        "eval.sampler={gen_length: 8, block_length: 8, steps: 4}")
    hist = Trainer(recipe).run()
    assert "eval/sudoku" in hist[-1] and "eval/sudoku" not in hist[0]
    assert (tmp_path / "eval" / "step-2" / "results.json").exists()
    with pytest.raises(ConfigError, match="eval.benchmarks"):
        sft_recipe(tmp_path, "train.eval_every=2")


def test_every_top_level_recipe_is_valid():
    from dare.trainer.recipe import load_recipe
    from tests.trainer.helpers import ROOT
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert len(recipes) >= 10
    for path in recipes:
        recipe = load_recipe(path)
        assert recipe.algorithm.name in path.name or recipe.algorithm.name == "sft", path


def test_bf16_mixed_precision_keeps_fp32_parameters(tmp_path):
    t = Trainer(sft_recipe(tmp_path, "train.steps=2", "train.mixed_precision=bf16"))
    hist = t.run()
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    fp32 = Trainer(sft_recipe(tmp_path / "fp32", "train.steps=1")).run()
    assert hist[0]["loss"] != fp32[0]["loss"] and abs(hist[0]["loss"] - fp32[0]["loss"]) < 0.05 * fp32[0]["loss"]


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    from dare.trainer.checkpoint import CheckpointError
    from dare.trainer.run_folder import RecipeChanged
    Trainer(sft_recipe(tmp_path, "train.steps=1")).run()
    bigger = "model.tiny_sizes={hidden_size: 48, num_layers: 1}"
    with pytest.raises(RecipeChanged, match="model.tiny_sizes.hidden_size: 32 -> 48"):  # caught before loading
        Trainer(sft_recipe(tmp_path, "train.steps=2", bigger))
    with pytest.raises(CheckpointError, match="different recipe"):  # opted in: the shapes still cannot load
        Trainer(sft_recipe(tmp_path, "train.steps=2", bigger, "train.allow_recipe_change=true"))
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        Trainer(sft_recipe(tmp_path / "x", f"train.resume={tmp_path / 'nowhere'}"))
