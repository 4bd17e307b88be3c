"""Recipes for trainer tests: tiny models, few steps, no progress bar or TensorBoard."""
from pathlib import Path

from dare.config.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TOY_SFT = ROOT / "tests/assets/data/toy_sft.jsonl"
TOY_PREF = ROOT / "tests/assets/data/toy_pref.jsonl"


def sft_recipe(tmp_path, *overrides, family="llada"):
    base = [f"model.path=tiny:{family}", "model.tiny_sizes={hidden_size: 32, num_layers: 1}", "algorithm.name=sft",
            f"data.pairs={TOY_SFT}", "data.max_length=48", "optim.lr=3e-3", "train.steps=2", "train.batch_size=8",
            "train.micro_batch_size=2", f"train.output_dir={tmp_path}", "train.export=false",
            "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]
    return load_recipe(None, base + list(overrides))
