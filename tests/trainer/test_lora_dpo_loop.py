import math

import pytest
import torch

from dare.models import load_model
from dare.models.lora import adapters_disabled, has_lora
from dare.trainer.loop import Trainer
from dare.trainer.reference import LoraDisabledReference
from tests.trainer.helpers import TOY_PREF, sft_recipe


@pytest.mark.parametrize("family", ["llada", "llada_moe", "dream", "sdar", "sdar_moe", "llada2_moe"])
def test_lora_on_every_family_trains_and_exports_merged(tmp_path, family):
    recipe = sft_recipe(tmp_path, "lora.enabled=true", "lora.r=4", "optim.lr=3e-2", "train.export=true",
                        "model.tiny_sizes={hidden_size: 32, num_layers: 2}", family=family)  # LLaDA2's layer 0 is dense
    trainer = Trainer(recipe)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    if family in ("llada_moe", "sdar_moe", "llada2_moe"):
        assert any(".experts." in n for n in trainable)
    if family == "llada2_moe":
        assert any("qkv_proj" in n for n in trainable)
    trainer.run()
    assert any(p.abs().sum() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)
    merged = load_model(tmp_path / "export")
    assert not has_lora(merged)
    ids = torch.randint(10, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = trainer.model(ids).logits
        with adapters_disabled(trainer.model):
            base = trainer.model(ids).logits
        assert torch.allclose(merged(ids).logits, adapted, atol=1e-5)
        assert not torch.allclose(adapted, base, atol=1e-4)


def _pref_recipe(tmp_path, *extra):
    return sft_recipe(tmp_path, "algorithm.name=vrpo", "algorithm.mc_samples=4", "algorithm.beta=0.5",
                      f"data.pairs={TOY_PREF}", "data.max_length=64", "optim.lr=1e-3",
                      "model.tiny_sizes={hidden_size: 64, num_layers: 2}", *extra)


def test_vrpo_learns_toy_preferences(tmp_path):
    hist = Trainer(_pref_recipe(tmp_path, "train.steps=12", "reference.mode=copy")).run()
    assert hist[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # theta = ref with shared noise: s = 0 exactly
    last = hist[-4:]
    assert sum(h["loss"] for h in last) / 4 < 0.45
    assert sum(h["pref_accuracy"] for h in last) / 4 > 0.8


def test_lora_preference_training_uses_the_adapter_disabled_base_as_reference(tmp_path):
    trainer = Trainer(_pref_recipe(tmp_path, "lora.enabled=true", "optim.lr=1e-2", "train.steps=3"))
    assert isinstance(trainer.reference, LoraDisabledReference)
    hist = trainer.run()
    assert hist[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # LoRA-B starts at 0: policy == base
    assert hist[-1]["loss"] != pytest.approx(math.log(2), abs=1e-3)


@pytest.mark.parametrize("family", ["llada_moe", "dream", "sdar_moe", "llada2_moe"])
def test_preference_training_runs_on_every_family(tmp_path, family):
    hist = Trainer(_pref_recipe(tmp_path, f"model.path=tiny:{family}", "algorithm.mc_samples=2", "train.steps=2",
                                "train.batch_size=4", "reference.mode=copy")).run()
    assert hist[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert math.isfinite(hist[1]["loss"])


def test_lora_run_resumes_exactly(tmp_path):
    """The frozen base is not in the checkpoint (ignore_frozen_params); loading fills only the trainable adapters."""
    straight = Trainer(sft_recipe(tmp_path / "a", "lora.enabled=true", "train.steps=3")).run()
    Trainer(sft_recipe(tmp_path / "b", "lora.enabled=true", "train.steps=1", "train.save_every=1")).run()
    resumed = Trainer(sft_recipe(tmp_path / "b", "lora.enabled=true", "train.steps=3"))
    assert resumed.start_step == 1
    assert [h["loss"] for h in resumed.run()] == [h["loss"] for h in straight[1:]]
    from dare.trainer.checkpoint import CheckpointError
    from dare.trainer.run_folder import RecipeChanged
    with pytest.raises(RecipeChanged, match="lora.enabled: True -> False"):  # the fingerprint names the change
        Trainer(sft_recipe(tmp_path / "b", "train.steps=3"))
    with pytest.raises(CheckpointError, match="different recipe"):  # forced: full parameters cannot load LoRA weights
        Trainer(sft_recipe(tmp_path / "b", "train.steps=3", "train.allow_recipe_change=true"))
