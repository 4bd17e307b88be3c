# OpenCompass config: GSM8K (generation, OpenCompass's own scorer) with a dare model.
# Run it from the OpenCompass environment (docs/eval.md), e.g.
#   DARE_MODEL=GSAI-ML/LLaDA-8B-Instruct .venv-oc/bin/opencompass recipes/eval/opencompass_gsm8k.py -w runs/opencompass
# Environment knobs: DARE_MODEL (checkpoint folder / hub id), DARE_DTYPE, DARE_GEN_LENGTH, DARE_BLOCK_LENGTH,
# DARE_NUM_GPUS, DARE_BATCH_SIZE, DARE_GSM8K_DIR (a local folder holding GSM8K's train.jsonl and test.jsonl: runs
# offline), DARE_LIMIT (first N), DARE_PROMPT (unset: OpenCompass's 4-shot chain-of-thought prompt; "dare": the bare
# question as the one user turn, which is `dare eval --template dare`'s GSM8K prompt, so both harnesses decode the
# same prompts; the scorer stays OpenCompass's: the last number of the completion).
from mmengine.config import read_base

with read_base():
    from opencompass.configs.datasets.gsm8k.gsm8k_gen import gsm8k_datasets

from dare.eval.opencompass_model import DareOpenCompassModel


def _env(name, default=None):  # (OpenCompass dumps the config's top-level names: no module objects there)
    import os
    return os.environ.get(name, default)


_gen = int(_env("DARE_GEN_LENGTH", "256"))
datasets = []
for _d in gsm8k_datasets:
    _d = dict(_d)
    if _env("DARE_GSM8K_DIR"):
        _d["path"] = _env("DARE_GSM8K_DIR")
    if _env("DARE_LIMIT"):
        _d["reader_cfg"] = dict(_d["reader_cfg"], test_range=f"[0:{int(_env('DARE_LIMIT'))}]")
    _infer = dict(_d["infer_cfg"], inferencer=dict(_d["infer_cfg"]["inferencer"], max_out_len=_gen))
    if _env("DARE_PROMPT") == "dare":
        # Zero-shot: one HUMAN turn holding the question alone (the model class wraps it in the chat template).
        _infer["prompt_template"] = dict(_infer["prompt_template"], template=dict(round=[dict(role="HUMAN", prompt="{question}")]))
    _d["infer_cfg"] = _infer
    datasets.append(_d)

models = [
    dict(
        type=DareOpenCompassModel,
        abbr=_env("DARE_MODEL", "LLaDA-8B-Instruct").rstrip("/").split("/")[-1],
        path=_env("DARE_MODEL", "GSAI-ML/LLaDA-8B-Instruct"),
        dtype=_env("DARE_DTYPE", "bfloat16"),
        chat_template=True,
        sampler=dict(gen_length=_gen, block_length=int(_env("DARE_BLOCK_LENGTH", str(min(32, _gen)))), steps=_gen),
        mc_num=32,
        max_out_len=_gen,
        max_seq_len=4096,
        batch_size=int(_env("DARE_BATCH_SIZE", "8")),
        run_cfg=dict(num_gpus=int(_env("DARE_NUM_GPUS", "1"))),
    )
]
del _env, _gen, _d, _infer
