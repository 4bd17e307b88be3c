"""recipes/eval/<model>.yaml: every row of the DARE paper's Table 2 for the four full-size models, with the settings of
DARE's OpenCompass configs (yjyddq/DARE @ 83ae8a3, opencompass/<model>_examples/), as dare eval resolves them."""
import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from dare.commands import eval as eval_cmd
from dare.eval.runner import sampler_for
from dare.models import tiny
from dare.rollout.api import check_config

ROOT = Path(__file__).resolve().parents[2]
# Table 2 row -> the dare benchmark or lm-eval task that evaluates it.
ROWS = {"MMLU": "mmlu_generative", "MMLU-Pro": "mmlu_pro", "HellaSwag": "hellaswag", "ARC-C": "arc_challenge_chat",
        "GSM8K": "gsm8k", "MATH": "math500", "GPQA": "gpqa_diamond_generative_n_shot", "AIME24": "aime24",
        "AIME25": "aime25", "OlympiadBench": "olympiadbench", "HumanEval": "humaneval", "MBPP": "mbpp"}
GENERATIVE = [r for r in ROWS if r != "HellaSwag"]  # lm-eval's HellaSwag is multiple choice (no sampler)

# The published settings, transcribed from each config: (gen_length, block_length, tokens per step schedule) ...
LLADA = {  # llada_instruct_gen_<bench>_length<L>_block<B>.py: steps = L, cache from use_cache / dual_cache
    "MMLU": (3, 3, "dual"), "MMLU-Pro": (256, 256, "dual"), "ARC-C": (512, 512, "prefix"), "GSM8K": (256, 8, "prefix"),
    "MATH": (512, 64, "prefix"), "GPQA": (128, 64, "prefix"), "AIME24": (2048, 64, "dual"), "AIME25": (2048, 64, "prefix"),
    "OlympiadBench": (2048, 64, "prefix"), "HumanEval": (512, 32, "prefix"), "MBPP": (512, 32, "prefix")}
DREAM = {"MMLU": 128, "MMLU-Pro": 128, "ARC-C": 512, "GSM8K": 256, "MATH": 512, "GPQA": 128, "AIME24": 2048,
         "AIME25": 2048, "OlympiadBench": 2048, "HumanEval": 512, "MBPP": 512}  # dream_instruct_gen_<bench>_length<L>.py
LLADA2 = {"MMLU": 256, "MMLU-Pro": 256, "ARC-C": 512, "GSM8K": 256, "MATH": 512, "GPQA": 128, "AIME24": 2048,
          "AIME25": 2048, "OlympiadBench": 2048, "HumanEval": 512, "MBPP": 512}  # llada2_mini_gen_<bench>.py
RECIPES = {"llada_8b_instruct": ("GSAI-ML/LLaDA-8B-Instruct", "llada"),
           "dream_7b_instruct": ("Dream-org/Dream-v0-Instruct-7B", "dream"),
           "sdar_8b_chat": ("JetLM/SDAR-8B-Chat", "sdar"), "llada2_mini": ("inclusionAI/LLaDA2.0-mini", "llada2_moe")}


def _config(name):
    p = argparse.ArgumentParser()
    eval_cmd.add_arguments(p)
    return eval_cmd.build_config(p.parse_args([str(ROOT / "recipes" / "eval" / f"{name}.yaml")]))


def _row_sampler(cfg, model, row):
    base = eval_cmd.sampler_for_model(cfg.sampler, model, cfg.model_block_length)
    name = ROWS[row]
    if name in cfg.lm_eval.tasks:
        (sampler,) = [s for s, _, tasks in eval_cmd.lm_eval_groups(cfg, base) if name in tasks]
        return sampler
    return sampler_for(SimpleNamespace(name=name), base, cfg.sampler_overrides)


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_table2_row_has_the_published_settings(name):
    cfg = _config(name)
    hub_id, family = RECIPES[name]
    assert cfg.models == [hub_id]
    covered = set(cfg.benchmarks) | set(cfg.lm_eval.tasks)
    assert {ROWS[r] for r in ROWS} == covered, f"{name}: rows without a benchmark or task"
    assert set(cfg.sampler_overrides) <= covered  # no override names a row the recipe does not run
    assert cfg.n_samples_overrides == {"aime24": 8, "aime25": 8}  # OpenCompass's aime*_gen_repeat8
    model = tiny(family)
    for row in GENERATIVE:
        s = _row_sampler(cfg, model, row)
        check_config(model, s)  # the family can decode it (cache kind, remasking, block rules)
        if family == "llada":
            L, B, cache = LLADA[row]
            assert (s.gen_length, s.block_length, s.steps, s.cache) == (L, B, L, cache), row
            assert s.remasking == "low_confidence" and s.temperature == (1.0 if row.startswith("AIME") else 0.0)
        elif family == "dream":
            L = DREAM[row]
            assert (s.gen_length, s.block_length, s.steps, s.remasking) == (L, L, L, "entropy"), row
            assert (s.temperature, s.top_p, s.cache) == (0.2, 0.95, "none")
        elif family == "sdar":  # sdar_8b_chat_gen_<bench>_length4096.py: block 4, 4 denoising steps, greedy static
            assert (s.gen_length, s.block_length, s.steps_per_block, s.remasking) == (4096, 4, 4, "static"), row
            assert (s.temperature, s.cache) == (0.0, "block")
        else:
            assert (s.gen_length, s.block_length, s.steps_per_block) == (LLADA2[row], 32, 32), row
            assert (s.remasking, s.threshold, s.minimal_topk, s.eos_early_stop, s.temperature, s.cache) == (
                "dynamic", 0.95, 1, False, 0.0, "block")


def test_lm_eval_tasks_keep_the_published_length():
    """A recipe's per-task gen_length wins over the task's max_gen_toks (mmlu_pro asks 2048; LLaDA's is 256)."""
    from dare.eval import register_lm_eval
    from dare.models.tokenizer import tiny_tokenizer

    cfg = _config("llada_8b_instruct")
    groups = eval_cmd.lm_eval_groups(cfg, cfg.sampler)
    (sampler, fixed, _), = [g for g in groups if "mmlu_pro" in g[2]]
    lm = register_lm_eval()(model=tiny("llada"), tokenizer=tiny_tokenizer(), sampler=sampler, fixed_gen_length=fixed)
    assert fixed and lm._sampler_for({"max_gen_toks": 2048}).gen_length == 256
    free = register_lm_eval()(model=tiny("llada"), tokenizer=tiny_tokenizer(), sampler=sampler)
    assert free._sampler_for({"max_gen_toks": 2048}).gen_length == 2048
